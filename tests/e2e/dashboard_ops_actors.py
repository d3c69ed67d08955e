"""Actors of the dashboard's operator tests, on queues of their own (a queue's page, a
worker killed while its jobs run): ``dramatiq tests.e2e.dashboard_ops_actors``. Apart from
:mod:`.dashboard_actors`, so that the other tests' worker never claims their jobs.

The broker is configured from DRAMATIQ_PG_URL and DRAMATIQ_PG_SCHEMA (the test's schema).
"""

from __future__ import annotations

import time

import dramatiq

from dramatiq_pg_broker import PostgresBroker

dramatiq.set_broker(PostgresBroker(poll_interval=0.2))


@dramatiq.actor(actor_name="dash.page_quick", queue_name="dash_page", max_retries=0)
def page_quick() -> None:
    """Succeeds at once (the queue page's throughput)."""


@dramatiq.actor(actor_name="dash.page_fail", queue_name="dash_page", max_retries=0)
def page_fail() -> None:
    """Fails for good at once (the queue page's failures of the last hour)."""
    raise RuntimeError("the partner's API said no")


@dramatiq.actor(actor_name="dash.hang", queue_name="dash_page", max_retries=3)
def hang(seconds: float) -> None:
    """Runs ``seconds``, or until aborted (in short sleeps: an abort interrupts Python code,
    not a call blocked in the kernel): keeps the queue at its limit."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)


@dramatiq.actor(actor_name="dash.doomed", queue_name="dash_dead", max_retries=3)
def doomed(seconds: float) -> None:
    """Runs until its worker is killed."""
    time.sleep(seconds)
