"""``dramatiq tests.e2e.prometheus_actors``: this broker with Dramatiq's own Prometheus
middleware added, as a user would add it."""

from __future__ import annotations

import dramatiq
from dramatiq.middleware.prometheus import Prometheus

from dramatiq_pg_broker import PostgresBroker

broker = PostgresBroker(poll_interval=0.2)
broker.add_middleware(Prometheus())
dramatiq.set_broker(broker)


@dramatiq.actor(actor_name="prom.ok", queue_name="prom", max_retries=0)
def ok(n: int) -> int:
    return n


@dramatiq.actor(actor_name="prom.boom", queue_name="prom", max_retries=0)
def boom() -> None:
    raise RuntimeError("boom")
