"""The actors of ``dramatiq tests.e2e.budget_app``: a worker that uses everything that can
take a connection in a worker process. The test process declares them on its own broker to
send their messages.

Four queues; actors that send from worker threads (``fan_out``), store results
(``double``), block on another message's result (``await_double``: a waiter of the
process's LISTEN connection), fail once and are retried (``flaky``), hold a rate limiter
(``limited``), report progress and run long enough to be aborted (``slow``), under
dramatiq-abort's ``Abortable`` (its watcher waits on the LISTEN connection too). The
heartbeat, the reaper, the worker registry and the scheduler's maintenance run as in any
worker. ``tests/e2e/test_connection_budget.py`` counts its connections.
"""

from __future__ import annotations

import time

import dramatiq
from dramatiq.rate_limits import ConcurrentRateLimiter
from dramatiq.results import Results
from dramatiq_abort import Abortable

from dramatiq_pg_broker import PostgresBroker, current_job
from dramatiq_pg_broker.backends.abort import PostgresEventBackend
from dramatiq_pg_broker.rate_limits import PostgresRateLimiterBackend
from dramatiq_pg_broker.results import PostgresBackend

#: The worker's queues.
QUEUES = ("budget_a", "budget_b", "budget_c", "budget_d")


def declare(broker: PostgresBroker) -> dict[str, dramatiq.Actor]:
    """The worker's actors, with their middleware, on ``broker``; returns them by name."""
    results = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=results))
    broker.add_middleware(Abortable(backend=PostgresEventBackend(broker=broker)))
    limiter = ConcurrentRateLimiter(PostgresRateLimiterBackend(broker=broker), "budget", limit=4)

    @dramatiq.actor(broker=broker, queue_name=QUEUES[0], store_results=True)
    def double(n: int) -> int:
        return 2 * n

    @dramatiq.actor(broker=broker, queue_name=QUEUES[1])
    def fan_out(n: int) -> None:
        """Sends from a worker thread."""
        for i in range(n):
            double.send(i)

    @dramatiq.actor(broker=broker, queue_name=QUEUES[1])
    def await_double(n: int) -> None:
        """Blocks on another message's result (up to 5 s)."""
        message = double.send(n)
        try:
            message.get_result(backend=results, block=True, timeout=5_000)
        except dramatiq.results.ResultTimeout:
            pass

    @dramatiq.actor(broker=broker, queue_name=QUEUES[2], max_retries=3, min_backoff=50)
    def flaky() -> None:
        if current_job().attempt == 1:
            raise RuntimeError("the first attempt fails")

    @dramatiq.actor(broker=broker, queue_name=QUEUES[3], max_retries=0)
    def limited() -> None:
        with limiter.acquire(raise_on_failure=False):
            time.sleep(0.005)

    @dramatiq.actor(broker=broker, queue_name=QUEUES[3], max_retries=0)
    def slow(seconds: float) -> None:
        """Reports progress while it runs, long enough for an abort to reach it."""
        job = current_job()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            job.progress({"left": deadline - time.monotonic()})
            time.sleep(0.05)

    return {a.actor_name: a for a in (double, fan_out, await_double, flaky, limited, slow)}
