"""What an idle worker costs the server: statements per queue per poll interval.

Every statement the broker sends goes through a psycopg cursor's ``execute``; the test
counts those calls (made by any thread of this process while the worker runs). The
server's own per-database transaction counter (``pg_stat_database``) was tried first, but
it varied by a third between identical runs whose server logs held the same statements.

A worker's start costs a fixed number of statements (the schema check, the schedules),
however long it then idles. So the worker is run twice, idling a short and a long while,
and the bound applies to the difference: what the extra idle time cost, per poll interval.

The reaper sends nothing while the idle claims report that no lease can have expired; the
last tests check that it stays quiet, and that it still runs once a lease has expired.
"""

from __future__ import annotations

import datetime as dt
import math
import time
import uuid

import dramatiq
import pytest
from dramatiq import Worker

from dramatiq_pg_broker import JobStore, PostgresBroker, Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.jobs import NewJob
from dramatiq_pg_broker.migrate import migrate

from ..helpers import StatementCounter

pytestmark = pytest.mark.timeout(120)

QUEUES = ("idle_a", "idle_b", "idle_c")
POLL_INTERVAL = 0.5
REAPER_INTERVAL = 2.0
SHORT_IDLE, LONG_IDLE = 1.0, 7.0


def _idle_run(pg_url: str, schema: str, monkeypatch, seconds: float) -> tuple[int, float]:
    """Run a worker that idles ``seconds``; returns (statements it issued, seconds run)."""
    with StatementCounter(monkeypatch) as counter:
        # Retention is off: it runs once per retention interval (every 5 minutes by the
        # clock), a cost of its own that a run crossing such a minute would add here.
        broker = PostgresBroker(url=pg_url, schema=schema, poll_interval=POLL_INTERVAL,
                                reaper_interval=REAPER_INTERVAL,
                                retention=False)  # fmt: skip
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
    # One claim per queue per poll interval (the reaper sends nothing: no lease exists);
    # each run's count of passes rounds its length either way, so the difference may hold
    # up to two passes more than the difference of lengths says (seen on a loaded machine
    # running the suite in parallel: 36 statements against a bound of 35 with one).
    bound = len(QUEUES) * (intervals + 2) + 1
    extra = long - short
    assert extra >= len(QUEUES) * (intervals - 2), (
        f"{extra} statements in {intervals:.1f} more poll intervals: the worker did not poll"
    )
    assert extra <= bound, (
        f"idling {long_seconds - short_seconds:.1f}s longer ({intervals:.1f} poll intervals "
        f"of {POLL_INTERVAL}s, {len(QUEUES)} queues) cost {extra} statements ({short} for "
        f"the short run, {long} for the long one); the bound is {bound:.0f}: one per queue "
        "per poll interval"
    )


def test_an_idle_claim_reports_when_the_earliest_lease_expires(pg_url, empty_schema):
    migrate(pg_url, empty_schema)
    store = JobStore(ProcessPool(Settings(url=pg_url, schema=empty_schema)), empty_schema)
    try:
        assert store.claim_or_wait("idle_q", 5, "B", 30).lease_seconds_left == math.inf
        job_id = str(uuid.uuid4())
        store.enqueue(
            NewJob(id=job_id, queue_name="busy_q", actor_name="a", message={}, max_attempts=21)
        )
        (claimed,) = store.claim("busy_q", 1, "A", 30)
        leased_until = store.get(job_id)["locked_until"]
        # Any queue's idle claim sees every running job's lease.
        for seconds in (10, 31):
            at = leased_until - dt.timedelta(seconds=30 - seconds)
            report = store.claim_or_wait("idle_q", 5, "B", 30, now=at)
            assert report.jobs == []
            assert report.lease_seconds_left == pytest.approx(30 - seconds)
        # A claim that finds work reports nothing.
        store.enqueue(NewJob(id=str(uuid.uuid4()), queue_name="idle_q", actor_name="a",
                             message={}, max_attempts=21))  # fmt: skip
        assert store.claim_or_wait("idle_q", 5, "B", 30).lease_seconds_left is None
    finally:
        store.pool.close()


def test_an_idle_worker_reaps_only_once_a_lease_has_expired(pg_url, schema, monkeypatch):
    """Idle, the reaper sends nothing however often it is due; once a lease has expired
    (another worker claimed a job and died), the next idle claim says so and the reaper
    gives the job back."""
    with StatementCounter(monkeypatch) as counter:
        broker = PostgresBroker(url=pg_url, schema=schema, poll_interval=0.2,
                                reaper_interval=0.2, lease_seconds=30)  # fmt: skip
        reap_text = broker.store.queries["reap_expired"]
        dramatiq.actor(lambda: None, actor_name="idle_one", queue_name="idle_one",
                       broker=broker)  # fmt: skip
        worker = Worker(broker, worker_threads=1)
        worker.start()
        try:
            time.sleep(2.0)  # the idle period being measured: ten reaper intervals
            assert counter.of.get(reap_text, 0) == 0, (
                f"the idle reaper ran {counter.of[reap_text]} times with no lease in the table"
            )
            # A worker of another queue claimed a job and died: its lease of a tenth of a
            # second has run out by the server's clock soon after.
            job_id = str(uuid.uuid4())
            broker.store.enqueue(NewJob(id=job_id, queue_name="elsewhere", actor_name="a",
                                        message={}, max_attempts=21))  # fmt: skip
            assert broker.store.claim("elsewhere", 1, "dead-worker", 0.1), "nothing claimed"
            deadline = time.monotonic() + 10
            while broker.store.get(job_id)["status"] != "queued":
                assert time.monotonic() < deadline, "the expired lease was never reaped"
                time.sleep(0.05)
            assert counter.of.get(reap_text, 0) >= 1
            assert [e["type"] for e in broker.store.events_of(job_id)][-1] == "released"
        finally:
            worker.stop()
            broker.close()
