"""Actors for the admin API's end-to-end test: ``dramatiq tests.e2e.admin_actors``.

The broker is configured from DRAMATIQ_PG_URL and DRAMATIQ_PG_SCHEMA (the test's schema).
"""

from __future__ import annotations

import dramatiq

from dramatiq_pg_broker import PostgresBroker

dramatiq.set_broker(PostgresBroker(poll_interval=0.2))


@dramatiq.actor(actor_name="e2e.add", queue_name="e2e_admin", max_retries=0)
def add(a: int, b: int) -> int:
    return a + b


@dramatiq.actor(actor_name="e2e.explode", queue_name="e2e_admin", max_retries=0)
def explode(reason: str) -> None:
    raise RuntimeError(reason)
