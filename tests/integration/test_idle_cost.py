"""What an idle worker costs the server: statements per queue per poll interval.

Every statement the broker sends goes through a psycopg cursor's ``execute``; the test
counts those calls (made by any thread of this process while the worker runs). The
server's own per-database transaction counter (``pg_stat_database``) was tried first, but
it varied by a third between identical runs whose server logs held the same statements.

A worker's start costs a fixed number of statements (the schema check, the first reaper
run, the schedules), however long it then idles. So the worker is run twice, idling a
short and a long while, and the bound applies to the difference: what the extra idle time
cost, per poll interval.
"""

from __future__ import annotations

import threading
import time

import dramatiq
import psycopg
import pytest
from dramatiq import Worker

from dramatiq_pg_broker import PostgresBroker

pytestmark = pytest.mark.timeout(120)

QUEUES = ("idle_a", "idle_b", "idle_c")
POLL_INTERVAL = 0.5
REAPER_INTERVAL = 2.0
SHORT_IDLE, LONG_IDLE = 1.0, 7.0


class StatementCounter:
    """Counts ``psycopg.Cursor.execute`` calls while installed (a context manager)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._monkeypatch = monkeypatch
        self._original = psycopg.Cursor.execute

    def __enter__(self) -> StatementCounter:
        original, counter = self._original, self

        def execute(cursor, *args, **kwargs):
            with counter._lock:
                counter.count += 1
            return original(cursor, *args, **kwargs)

        self._monkeypatch.setattr(psycopg.Cursor, "execute", execute)
        return self

    def __exit__(self, *exc) -> None:
        self._monkeypatch.setattr(psycopg.Cursor, "execute", self._original)


def _idle_run(pg_url: str, schema: str, monkeypatch, seconds: float) -> tuple[int, float]:
    """Run a worker that idles ``seconds``; returns (statements it issued, seconds run)."""
    with StatementCounter(monkeypatch) as counter:
        broker = PostgresBroker(url=pg_url, schema=schema, poll_interval=POLL_INTERVAL,
                                reaper_interval=REAPER_INTERVAL)  # fmt: skip
        for queue_name in QUEUES:
            dramatiq.actor(lambda: None, actor_name=f"noop_{queue_name}",
                           queue_name=queue_name, broker=broker)  # fmt: skip
        worker = Worker(broker, worker_threads=1)
        started = time.monotonic()
        worker.start()
        try:
            time.sleep(seconds)  # the idle period being measured, not a wait for a result
        finally:
            worker.stop()
            broker.close()
        return counter.count, time.monotonic() - started


def test_idle_worker_issues_at_most_one_statement_per_queue_per_poll_interval(
    pg_url, schema, monkeypatch
):
    short, short_seconds = _idle_run(pg_url, schema, monkeypatch, SHORT_IDLE)
    long, long_seconds = _idle_run(pg_url, schema, monkeypatch, LONG_IDLE)

    assert short > 0, "the idle worker should have polled at least once"
    intervals = (long_seconds - short_seconds) / POLL_INTERVAL
    # One claim per queue per poll interval, and the process's reaper once per its own
    # interval; one more pass of each for the rounding of the two runs' lengths.
    bound = len(QUEUES) * (intervals + 1) + (long_seconds - short_seconds) / REAPER_INTERVAL + 1
    extra = long - short
    assert extra >= len(QUEUES) * (intervals - 2), (
        f"{extra} statements in {intervals:.1f} more poll intervals: the worker did not poll"
    )
    assert extra <= bound, (
        f"idling {long_seconds - short_seconds:.1f}s longer ({intervals:.1f} poll intervals "
        f"of {POLL_INTERVAL}s, {len(QUEUES)} queues) cost {extra} statements ({short} for "
        f"the short run, {long} for the long one); the bound is {bound:.0f}: one per queue "
        "per poll interval, and the reaper's"
    )
