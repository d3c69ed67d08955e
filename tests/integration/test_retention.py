"""Retention against real PostgreSQL: finished jobs (and their events) older than their
status's age go, in bounded batches; waiting and running jobs never do."""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import pytest

from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.jobs import JobStore, NewJob
from dramatiq_pg_broker.retention import RetentionPolicy, prune

from ..rows import emptied_store

NOW = dt.datetime(2030, 6, 1, 12, 0, tzinfo=dt.timezone.utc)


@pytest.fixture
def store(pg_url, schema):
    with emptied_store(pg_url, schema) as store:
        yield store


def make_job(store: JobStore, status: str, *, days_ago: float, queue: str = "q") -> str:
    """A job that reached ``status`` ``days_ago`` days before NOW, through the real
    transitions with an injected clock."""
    when = NOW - dt.timedelta(days=days_ago)
    job_id = str(uuid.uuid4())
    store.enqueue(NewJob(job_id, queue, "act", message={"x": 1}, max_attempts=21), now=when)
    if status == "queued":
        return job_id
    if status == "cancelled":
        store.cancel(job_id, by="test", now=when)
        return job_id
    (claimed,) = [c for c in store.claim(queue, 100, "w", 30, now=when) if c.id == job_id]
    from dramatiq_pg_broker.jobs import Attempt

    attempt = Attempt(job_id, "w", claimed.attempts)
    if status == "succeeded":
        assert store.complete([attempt], now=when) == {job_id}
    elif status == "failed":
        assert store.fail([attempt], ["boom"], now=when) == {job_id}
    return job_id


def count(store: JobStore, table: str, job_ids) -> int:
    """Jobs (unfinished or in history) or events of ``job_ids``."""
    column = "id" if table == "jobs" else "job_id"
    table = "all_jobs" if table == "jobs" else table
    with store.pool.connection() as conn:
        return conn.execute(
            f"SELECT count(*) FROM {store.schema}.{table} WHERE {column} = ANY(%s::uuid[])",
            (list(job_ids),),
        ).fetchone()[0]


def test_each_status_has_its_own_age_and_events_go_with_their_job(store):
    """Rows of days that had no partition (2030 here: the DEFAULT partitions) go in
    batches, each job with its events, as every finished row did before partitions."""
    old_ok = [make_job(store, "succeeded", days_ago=8) for _ in range(3)]
    new_ok = make_job(store, "succeeded", days_ago=6)
    mid_failed = make_job(store, "failed", days_ago=8)  # kept: failed live 30 days
    old_failed = make_job(store, "failed", days_ago=31)
    old_cancelled = make_job(store, "cancelled", days_ago=8)
    ancient_queued = make_job(store, "queued", days_ago=400)
    ancient_running = make_job(store, "running", days_ago=400)
    assert count(store, "job_events", old_ok) == 9  # created, claimed, succeeded

    report = prune(store.pool, store.schema, RetentionPolicy(), batch=2, now=NOW)

    assert report.jobs == {"succeeded": 3, "failed": 1, "cancelled": 1}
    # The events stamped at the injected time (2030) go with their jobs; those stamped by
    # the server's clock (claimed, succeeded, failed: today) went with their day's
    # partition, expired by 2030 (the drop step runs first).
    assert report.events == {"succeeded": 3, "failed": 1, "cancelled": 1}
    assert report.steps["drop"].state == "ok" and report.steps["default"].state == "ok"
    assert report.complete
    gone = [*old_ok, old_failed, old_cancelled]
    kept = [new_ok, mid_failed, ancient_queued, ancient_running]
    assert count(store, "jobs", gone) == 0
    assert count(store, "job_events", gone) == 0
    assert count(store, "jobs", kept) == len(kept)
    # batch=2: succeeded took 2 batches (2 + 1), failed 1, cancelled 1.
    assert report.batches == 4


def test_dry_run_counts_and_deletes_nothing(store):
    jobs = [make_job(store, "succeeded", days_ago=10) for _ in range(4)]
    report = prune(store.pool, store.schema, RetentionPolicy(), dry_run=True, now=NOW)
    assert report.dry_run
    assert report.jobs["succeeded"] == 4
    assert report.events["succeeded"] == 12
    assert count(store, "jobs", jobs) == 4


def test_a_status_kept_forever_is_never_pruned(store):
    failed = make_job(store, "failed", days_ago=3650)
    policy = RetentionPolicy.from_settings(Settings(retain_failed_days=0))
    assert "failed" not in policy.ages()
    report = prune(store.pool, store.schema, policy, now=NOW)
    assert report.total_jobs == 0
    assert count(store, "jobs", [failed]) == 1


def test_a_budget_stops_between_batches_and_the_next_run_goes_on(store):
    jobs = [make_job(store, "succeeded", days_ago=10) for _ in range(5)]
    first = prune(store.pool, store.schema, RetentionPolicy(), batch=2, budget_seconds=0, now=NOW)
    assert not first.complete and first.total_jobs == 0
    second = prune(store.pool, store.schema, RetentionPolicy(), batch=2, now=NOW)
    assert second.complete and second.jobs["succeeded"] == 5
    assert count(store, "jobs", jobs) == 0


def test_concurrent_runs_take_different_rows(store):
    jobs = [make_job(store, "succeeded", days_ago=10) for _ in range(60)]
    barrier = threading.Barrier(3)
    reports = []

    def run():
        barrier.wait(timeout=30)
        reports.append(
            prune(store.pool, store.schema, RetentionPolicy(), batch=5, rest=False, now=NOW)
        )

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(reports) == 3, "a pruner did not finish"
    assert sum(r.jobs["succeeded"] for r in reports) == 60
    assert count(store, "jobs", jobs) == 0


def test_settings_reject_a_negative_age():
    from dramatiq_pg_broker.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="retain_failed_days"):
        Settings(retain_failed_days=-1)


def test_reclaimers_of_optional_modules_run_after_the_jobs(store, monkeypatch):
    """The extension point for expired results and rate-limit keys: a module of the package
    named in RECLAIMERS with prune_expired(conn, schema, *, limit) is called in batches until
    a short one; a missing module or table is skipped."""
    import sys
    import types

    from dramatiq_pg_broker import retention

    calls = []

    def prune_expired(conn, schema, *, limit):
        calls.append((schema, limit))
        conn.execute("SELECT 1")
        return limit if len(calls) < 3 else 1

    def no_table(conn, schema, *, limit):
        conn.execute(f"SELECT * FROM {schema}.no_such_table_here")
        return 0

    for name, fn in (("fake_results", prune_expired), ("fake_limits", no_table)):
        module = types.ModuleType(f"dramatiq_pg_broker.{name}")
        module.prune_expired = fn
        monkeypatch.setitem(sys.modules, f"dramatiq_pg_broker.{name}", module)
    monkeypatch.setattr(
        retention, "RECLAIMERS", ("fake_results", "fake_limits", "not_installed_module")
    )

    report = prune(store.pool, store.schema, RetentionPolicy(), batch=10, now=NOW)
    assert report.reclaimed == {"fake_results": 21, "fake_limits": 0}
    assert calls == [(store.schema, 10)] * 3
    # fake_limits' missing table was skipped, not raised, and the run completed.
    assert report.complete


class BrokenModuleFinder:
    """Finds ``dramatiq_pg_broker.<name>``: a module that exists, but whose import fails
    the way a bug or a missing dependency makes it fail."""

    def __init__(self, name: str, error: ImportError) -> None:
        self.fullname = f"dramatiq_pg_broker.{name}"
        self.error = error

    def find_spec(self, fullname, path=None, target=None):
        import importlib.util

        if fullname != self.fullname:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        ImportError("cannot import name 'gone' from 'dramatiq_pg_broker.jobs'"),
        ModuleNotFoundError("No module named 'some_dependency'", name="some_dependency"),
    ],
    ids=["broken import", "missing dependency"],
)
def test_an_import_error_inside_a_reclaimer_module_is_not_taken_for_a_missing_module(
    store, monkeypatch, error
):
    """A reclaimer module that exists but cannot be imported fails its step with its error,
    instead of silently ending the pruning of its table; the other steps still run."""
    import sys

    from dramatiq_pg_broker import retention

    monkeypatch.setattr(retention, "RECLAIMERS", ("broken_reclaimer", "not_installed_module"))
    monkeypatch.setattr(
        sys, "meta_path", [BrokenModuleFinder("broken_reclaimer", error)] + sys.meta_path
    )
    old = make_job(store, "succeeded", days_ago=30)
    report = prune(store.pool, store.schema, RetentionPolicy(), batch=10, now=NOW, rest=False)
    assert report.failed == ["broken_reclaimer"]
    assert report.steps["broken_reclaimer"].error == str(error)
    assert report.steps["not_installed_module"].state == "skipped"
    assert not report.complete
    assert count(store, "jobs", [old]) == 0, "the jobs were pruned before the reclaimers ran"


def test_a_run_reclaims_expired_results_and_rate_limit_keys(store):
    """With the real results and rate-limit backends installed, one retention run deletes
    their expired rows and leaves the live ones; the same for the registrations of worker
    processes that stopped refreshing, and for dramatiq-abort's events."""
    from dramatiq_pg_broker.rate_limits import PostgresRateLimiterBackend
    from dramatiq_pg_broker.results import PostgresBackend

    url, schema = store.pool.url, store.schema
    # Rows live a minute when written (a backend reclaims on its own at its first write),
    # then are aged on the server's clock, so only the retention run can delete them.
    results = PostgresBackend(url=url, schema=schema, listen=False, prune_interval=3600)
    limits = PostgresRateLimiterBackend(url=url, schema=schema, prune_interval=3600)
    try:
        # _store: the write Dramatiq's ResultBackend contract has backends implement.
        results._store("expired-result", "old", 60_000)
        results._store("live-result", "new", 3_600_000)
        assert limits.add("expired-key", 1, 60_000)
        assert limits.add("live-key", 1, 3_600_000)
        with store.pool.connection() as conn:
            conn.execute(
                f"UPDATE {schema}.results SET expires_at = now() - interval '1 minute'"
                " WHERE key = 'expired-result'"
            )
            conn.execute(
                f"UPDATE {schema}.rate_limits SET expires_at = now() - interval '1 minute'"
                " WHERE key = 'expired-key'"
            )
            for name, expires in (
                ("gone", "- interval '1 minute'"),
                ("live", "+ interval '1 hour'"),
            ):
                conn.execute(
                    f"INSERT INTO {schema}.workers (id, host, pid, expires_at)"
                    f" VALUES (%s, 'h', 1, now() {expires})",
                    (name,),
                )
                conn.execute(
                    f"INSERT INTO {schema}.abort_events (key, expires_at)"
                    f" VALUES (%s, now() {expires})",
                    (name,),
                )
        report = prune(store.pool, schema, RetentionPolicy(), rest=False)
        assert report.reclaimed == {"results": 1, "rate_limits": 1, "workers": 1, "abort": 1}
        with store.pool.connection() as conn:
            assert [r[0] for r in conn.execute(f"SELECT id FROM {schema}.workers")] == ["live"]
            assert [r[0] for r in conn.execute(f"SELECT key FROM {schema}.abort_events")] == [
                "live"
            ]
        with store.pool.connection() as conn:
            assert [r[0] for r in conn.execute(f"SELECT key FROM {schema}.results")] == [
                "live-result"
            ]
            assert [r[0] for r in conn.execute(f"SELECT key FROM {schema}.rate_limits")] == [
                "live-key"
            ]
    finally:
        results.close()
        limits.close()


# -- partitions (migration 0012) ------------------------------------------------------------


def _server_now(store: JobStore) -> dt.datetime:
    with store.pool.connection() as conn:
        return conn.execute("SELECT now()").fetchone()[0]


def _partition_of(store: JobStore, job_id: str) -> str:
    with store.pool.connection() as conn:
        return conn.execute(
            f"SELECT tableoid::regclass::text FROM {store.schema}.jobs_history WHERE id = %s",
            (job_id,),
        ).fetchone()[0]


def _partitions(store: JobStore, parent: str) -> set[str]:
    with store.pool.connection() as conn:
        rows = conn.execute(
            f"SELECT partition FROM {store.schema}.history_partitions WHERE parent = %s",
            (parent,),
        ).fetchall()
    return {r[0] for r in rows}


def _day(moment: dt.datetime) -> str:
    return moment.astimezone(dt.timezone.utc).strftime("%Y%m%d")


def test_whole_days_of_history_are_dropped_with_their_owners(store):
    from dramatiq_pg_broker.retention import create_partitions

    now = _server_now(store)
    with store.pool.connection() as conn:
        create_partitions(conn, store.schema, now - dt.timedelta(days=12), 12)

    def job_at(status: str, days_ago: float) -> str:
        global NOW
        saved, NOW = NOW, now
        try:
            return make_job(store, status, days_ago=days_ago)
        finally:
            NOW = saved

    old = [job_at("succeeded", 9) for _ in range(3)]
    recent = job_at("succeeded", 5)
    failed = job_at("failed", 9)  # failed jobs live 30 days
    assert _partition_of(store, old[0]).endswith(f"_succeeded_{_day(now - dt.timedelta(days=9))}")
    with store.pool.connection() as conn:
        conn.execute(
            f"INSERT INTO {store.schema}.users (email, password_hash, role) "
            "VALUES (%s, '$2b$x', 'member') RETURNING id",
            (f"{uuid.uuid4().hex}@example.com",),
        )
        conn.execute(
            f"INSERT INTO {store.schema}.job_owners (job_id, user_id, created_at) "
            f"SELECT %s, max(id), now() FROM {store.schema}.users",
            (old[0],),
        )

    report = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)

    assert report.complete
    assert f"jobs_history_succeeded_{_day(now - dt.timedelta(days=9))}" in report.dropped
    assert f"jobs_history_succeeded_{_day(now - dt.timedelta(days=5))}" not in report.dropped
    assert report.jobs["succeeded"] == 3 and report.jobs["failed"] == 0
    assert report.batches == 0, "a day with a partition is dropped, never deleted by rows"
    assert count(store, "jobs", old) == 0
    assert count(store, "jobs", [recent, failed]) == 2
    # Events outlive their jobs up to the longest age (30 days): a timeline stays whole.
    assert count(store, "job_events", old) == 9
    with store.pool.connection() as conn:
        owners = conn.execute(
            f"SELECT count(*) FROM {store.schema}.job_owners WHERE job_id = %s", (old[0],)
        ).fetchone()[0]
    assert owners == 0
    # Created ahead: today's partitions and the week after exist for every table.
    for parent in ("jobs_history_succeeded", "jobs_history_failed", "job_events"):
        names = _partitions(store, parent)
        for ahead in range(8):
            assert f"{parent}_{_day(now + dt.timedelta(days=ahead))}" in names

    second = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
    assert second.total_jobs == 0 and not second.dropped and second.created == 0


def test_events_go_by_day_past_the_longest_age(store):
    from dramatiq_pg_broker.retention import create_partitions

    now = _server_now(store)
    with store.pool.connection() as conn:
        create_partitions(conn, store.schema, now - dt.timedelta(days=6), 6)
    global NOW
    saved, NOW = NOW, now
    try:
        old = make_job(store, "succeeded", days_ago=4)
        new = make_job(store, "succeeded", days_ago=1)
    finally:
        NOW = saved
    short = RetentionPolicy(
        succeeded=dt.timedelta(days=1), failed=dt.timedelta(days=2), cancelled=dt.timedelta(days=1)
    )
    dry = prune(store.pool, store.schema, short, dry_run=True, now=now)
    # The old job's `created` event at least (its day is past the longest age, 2 days);
    # more where earlier tests of this module left events in such days.
    assert dry.expired_events >= 1 and count(store, "job_events", [old]) == 3

    report = prune(store.pool, store.schema, short, rest=False, now=now)
    assert f"job_events_{_day(now - dt.timedelta(days=4))}" in report.dropped
    # Its `created` event was written at the injected time, four days ago, and went with
    # its day; the claim and outcome events are stamped by the server's clock (today).
    assert count(store, "job_events", [old]) == 2
    assert count(store, "job_events", [new]) == 3
    # The dry run counted exactly what the run then removed.
    assert report.expired_events == dry.expired_events

    # A status kept forever keeps every event.
    forever = RetentionPolicy(succeeded=dt.timedelta(days=1), failed=None)
    kept = prune(store.pool, store.schema, forever, rest=False, now=now + dt.timedelta(days=5))
    assert not any(name.startswith("job_events") for name in kept.dropped)
    assert count(store, "job_events", [new]) == 3


def test_a_partition_in_use_is_left_to_the_next_run(store, pg_url):
    """Detaching never queues behind a long reader of its parent (maintenance sees it in
    pg_locks and gives the try up), so the reader delays the drop instead of queueing
    every outcome behind it: the step reports the partition skipped."""
    import psycopg

    from dramatiq_pg_broker.retention import create_partitions

    now = _server_now(store)
    with store.pool.connection() as conn:
        create_partitions(conn, store.schema, now - dt.timedelta(days=10), 1)
    global NOW
    saved, NOW = NOW, now
    try:
        old = make_job(store, "succeeded", days_ago=10)
    finally:
        NOW = saved
    with psycopg.connect(pg_url) as reader:
        reader.execute(f"SELECT count(*) FROM {store.schema}.jobs_history_succeeded")
        started = dt.datetime.now()
        blocked = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
        waited = (dt.datetime.now() - started).total_seconds()
        reader.rollback()
    assert not blocked.complete
    assert not [name for name in blocked.dropped if name.startswith("jobs_history_succeeded")]
    assert blocked.steps["drop"].state == "skipped"
    assert f"jobs_history_succeeded_{_day(now - dt.timedelta(days=10))}" in (
        blocked.steps["drop"].detail
    )
    assert waited < 20, f"the blocked run waited {waited:.1f}s"
    assert count(store, "jobs", [old]) == 1
    after = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
    assert after.complete and count(store, "jobs", [old]) == 0


def test_concurrent_creators_make_each_partition_once(store):
    from dramatiq_pg_broker.retention import create_partitions

    start = _server_now(store) + dt.timedelta(days=40)
    barrier = threading.Barrier(3)
    created = []

    def run():
        with store.pool.connection() as conn:
            barrier.wait(timeout=30)
            created.append(create_partitions(conn, store.schema, start, 4))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(created) == [0, 0, 5 * 4], created  # 5 days x 4 tables, made once
