"""Actors for the dashboard's browser tests and the admin API's end-to-end test:
``dramatiq tests.e2e.dashboard_actors``.

The broker is configured from DRAMATIQ_PG_URL and DRAMATIQ_PG_SCHEMA (the test's schema).
"""

from __future__ import annotations

import os
import time

import dramatiq

from dramatiq_pg_broker import PostgresBroker

dramatiq.set_broker(PostgresBroker(poll_interval=0.2))


@dramatiq.actor(actor_name="dash.add", queue_name="dash", max_retries=0)
def add(a: int, b: int) -> int:
    return a + b


@dramatiq.actor(actor_name="dash.flaky", queue_name="dash", max_retries=0)
def flaky(flag_path: str) -> str:
    """Fails until the file ``flag_path`` exists: the test creates it before retrying."""
    if not os.path.exists(flag_path):
        raise RuntimeError(f"{flag_path} does not exist yet")
    return "fixed"


@dramatiq.actor(actor_name="dash.sleep", queue_name="dash", max_retries=3)
def sleep(seconds: float) -> None:
    """Runs until aborted (the abort test) or ``seconds`` pass: in short sleeps, so that
    an abort's exception, raised between two of them, ends it within a tenth of a second
    (no exception interrupts a sleep, and the job runs until its thread leaves it)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
