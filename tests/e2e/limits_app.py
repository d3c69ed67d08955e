"""``dramatiq tests.e2e.limits_app``: actors that share one PostgreSQL rate-limiter backend
across every worker process, on a broker configured from ``DRAMATIQ_PG_*``.

Executions are recorded in the ``executions`` table (see :mod:`tests.e2e.worker_actors`),
timed by the database's clock, so the test can check that no two critical sections
overlapped, whichever process or thread ran them.
"""

from __future__ import annotations

import time

import dramatiq
from dramatiq.middleware import GroupCallbacks
from dramatiq.rate_limits import ConcurrentRateLimiter

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.rate_limits import PostgresRateLimiterBackend
from tests.e2e.worker_actors import record

QUEUE = "limits"

broker = PostgresBroker()
dramatiq.set_broker(broker)
backend = PostgresRateLimiterBackend(broker=broker)
broker.add_middleware(GroupCallbacks(backend))

#: A distributed mutex: one holder at a time across every process and host.
mutex = ConcurrentRateLimiter(backend, "e2e-exclusive", limit=1)


@dramatiq.actor(queue_name=QUEUE, max_retries=10_000, min_backoff=10, max_backoff=100)
def exclusive(hold: float) -> None:
    """Holds the mutex for ``hold`` seconds; a busy mutex raises RateLimitExceeded and the
    message is retried shortly."""
    with mutex.acquire():
        record("start")
        time.sleep(hold)
        record("finish")


@dramatiq.actor(queue_name=QUEUE, max_retries=3)
def member(hold: float) -> None:
    record("start")
    time.sleep(hold)
    record("finish")


@dramatiq.actor(queue_name=QUEUE, max_retries=3)
def group_done() -> None:
    record("start")
