"""Actors for the queue-limit e2e test: one on a limited queue and one on an unlimited
queue, each sleeping :data:`JOB_SECONDS`. The ``dramatiq`` subprocesses import
:mod:`tests.e2e.queue_limits_app`, which declares them on a broker configured from
``DRAMATIQ_PG_*``; the test process declares them on its own broker to send."""

from __future__ import annotations

import time

import dramatiq

#: The queue the test limits, and the one it leaves unlimited.
LIMITED = "e2e_limited"
UNLIMITED = "e2e_unlimited"

#: How long every job takes.
JOB_SECONDS = 0.2


def declare(broker: dramatiq.Broker) -> tuple[dramatiq.Actor, dramatiq.Actor]:
    """The two actors, on ``broker``."""

    @dramatiq.actor(broker=broker, queue_name=LIMITED, actor_name="limited_job", max_retries=0)
    def limited_job(n: int) -> None:
        time.sleep(JOB_SECONDS)

    @dramatiq.actor(broker=broker, queue_name=UNLIMITED, actor_name="unlimited_job", max_retries=0)
    def unlimited_job(n: int) -> None:
        time.sleep(JOB_SECONDS)

    return limited_job, unlimited_job
