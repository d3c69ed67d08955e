"""Demo actors: ``dramatiq demo_actors --processes 2 --threads 4``.

Importing this module sets a :class:`PostgresBroker` (configured from ``DRAMATIQ_PG_*``)
as Dramatiq's global broker and declares the demo actors on the ``demo`` queue:

- ``demo.success``  returns quickly;
- ``demo.fail``     always raises, so it is retried with backoff and ends ``failed``;
- ``demo.slow``     works for a few seconds, renewing its lease and reporting progress;
- ``demo.timeout``  sleeps past its lease without renewing (``heartbeat=False``), so the
                     reaper requeues it and finally fails it;
- ``demo.flaky``    fails until a given attempt, then succeeds;
- ``demo.tick``     runs every 5 seconds (a periodic actor): both worker processes run the
                     schedule, and each tick still makes exactly one job.
"""

from __future__ import annotations

import logging
import time

import dramatiq

from dramatiq_pg_broker import PostgresBroker, current_job, periodic

logger = logging.getLogger("demo_actors")

broker = PostgresBroker()
dramatiq.set_broker(broker)

#: Demo retries are quick so the demo reaches its end states within a minute.
DEMO_BACKOFF = {"min_backoff": 500, "max_backoff": 4000}


class DemoFailure(Exception):
    """The failure the demo actors raise on purpose."""


@dramatiq.actor(actor_name="demo.success", queue_name="demo", max_retries=3)
def success(message: str = "hello") -> str:
    """Succeeds at once."""
    logger.info("demo.success: %s", message)
    return message


@dramatiq.actor(actor_name="demo.fail", queue_name="demo", max_retries=2, **DEMO_BACKOFF)
def fail(reason: str = "this job always fails") -> None:
    """Fails every attempt: retried twice with backoff, then dead-lettered."""
    raise DemoFailure(reason)


@dramatiq.actor(actor_name="demo.slow", queue_name="demo", max_retries=3)
def slow(seconds: float = 3.0, steps: int = 5) -> None:
    """Works for ``seconds``, renewing its lease and reporting progress at each step."""
    job = current_job()
    for step in range(1, steps + 1):
        time.sleep(seconds / steps)
        if job is not None and not job.progress({"step": step, "of": steps}):
            logger.warning("demo.slow lost its lease; stopping early.")
            return


@dramatiq.actor(
    actor_name="demo.timeout", queue_name="demo", max_retries=1, heartbeat=False, **DEMO_BACKOFF
)
def timeout(seconds: float = 30.0) -> None:
    """Sleeps past its lease without renewing it: each expiry is an interruption, which the
    reaper requeues, and it fails once its interruptions reach the bound
    (``DRAMATIQ_PG_MAX_INTERRUPTIONS``, 2 in the demo). Its own late outcome is discarded."""
    time.sleep(seconds)


@dramatiq.actor(actor_name="demo.flaky", queue_name="demo", max_retries=5, **DEMO_BACKOFF)
def flaky(succeed_on_attempt: int = 3) -> str:
    """Fails until attempt ``succeed_on_attempt``, then succeeds."""
    job = current_job()
    attempt = job.attempt if job is not None else 1
    if attempt < succeed_on_attempt:
        raise DemoFailure(f"attempt {attempt} of {succeed_on_attempt} fails")
    return f"succeeded on attempt {attempt}"


@periodic(every=5)
@dramatiq.actor(actor_name="demo.tick", queue_name="demo", max_retries=0)
def tick() -> None:
    """A periodic actor: one job every 5 seconds, whatever the number of workers."""
    job = current_job()
    logger.info("demo.tick: job %s", job.id if job is not None else "?")
