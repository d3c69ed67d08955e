"""Actors for the queue-limit e2e tests: one on a limited queue and one on an unlimited
queue, each sleeping :data:`JOB_SECONDS`; and, for the tests that time every job, one actor
per queue of :data:`SPAN_QUEUES` that records when it starts and when its thread leaves it
(the ``executions`` table of :mod:`tests.e2e.worker_actors`, by the database's clock). The
``dramatiq`` subprocesses import :mod:`tests.e2e.queue_limits_app`, which declares them on
a broker configured from ``DRAMATIQ_PG_*``; the test process declares them on its own
broker to send."""

from __future__ import annotations

import time

import dramatiq

from dramatiq_pg_broker import current_job
from tests.e2e.worker_actors import record

#: The queue the test limits, and the one it leaves unlimited.
LIMITED = "e2e_limited"
UNLIMITED = "e2e_unlimited"

#: How long every job takes.
JOB_SECONDS = 0.2

#: The queues of the timed tests, one each: a limit declared in code (a fresh deploy, and
#: a worker that declares it beside one that does not), an aborted job, a killed worker.
CODE_LIMITED = "e2e_code_limited"
MIXED_LIMITED = "e2e_mixed_limited"
ABORT_LIMITED = "e2e_abort_limited"
CRASH_LIMITED = "e2e_crash_limited"
SPAN_QUEUES = (CODE_LIMITED, MIXED_LIMITED, ABORT_LIMITED, CRASH_LIMITED)


def declare(broker: dramatiq.Broker) -> tuple[dramatiq.Actor, dramatiq.Actor]:
    """The two actors, on ``broker``."""

    @dramatiq.actor(broker=broker, queue_name=LIMITED, actor_name="limited_job", max_retries=0)
    def limited_job(n: int) -> None:
        time.sleep(JOB_SECONDS)

    @dramatiq.actor(broker=broker, queue_name=UNLIMITED, actor_name="unlimited_job", max_retries=0)
    def unlimited_job(n: int) -> None:
        time.sleep(JOB_SECONDS)

    return limited_job, unlimited_job


def declare_spans(broker: dramatiq.Broker) -> dict[str, dramatiq.Actor]:
    """One actor per queue of :data:`SPAN_QUEUES`, on ``broker``, by queue: it sleeps
    ``seconds`` (only in its first attempt with ``first_only``), recording ``start`` first
    and ``finish`` as its thread leaves it, whatever ends it (an abort's ``JobAborted``
    too)."""
    actors = {}
    for queue in SPAN_QUEUES:

        @dramatiq.actor(
            broker=broker,
            queue_name=queue,
            actor_name=f"span_{queue}",
            max_retries=3,
            min_backoff=100,
            max_backoff=100,
        )
        def span(seconds: float, first_only: bool = False) -> None:
            record("start")
            try:
                if not first_only or current_job().attempt == 1:
                    time.sleep(seconds)
            finally:
                record("finish")

        actors[queue] = span
    return actors
