"""Partition maintenance against real PostgreSQL (migration 0013): it never stalls the hot
path, never deadlocks with it, keeps the DEFAULT partitions empty, and runs each step on
its own (issue 30, items 4-6)."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import threading
import time
import uuid

import psycopg
import pytest

from dramatiq_pg_broker.jobs import Attempt, JobStore, NewJob
from dramatiq_pg_broker.retention import RetentionPolicy, create_partitions, prune

from ..rows import emptied_store

pytestmark = pytest.mark.timeout(180)

#: The most a send, claim or outcome may wait for maintenance here: generous (the machine
#: is shared), far below the 2 s lock timeouts (times the parents) of the creation before
#: 0013.
HOT_PATH_BOUND = 1.0


@pytest.fixture
def store(pg_url, schema):
    with emptied_store(pg_url, schema) as store:
        with store.pool.connection() as conn:
            conn.execute(f"TRUNCATE {schema}.job_events")
            # Days before today start without partitions (an earlier test made some).
            for (name,) in conn.execute(
                f"SELECT partition FROM {schema}.history_partitions"
                " WHERE NOT is_default AND range_end <= date_trunc('day', now(), 'UTC')"
                f" UNION ALL SELECT partition FROM {schema}.history_partitions_pending"
            ).fetchall():
                conn.execute(f"DROP TABLE {schema}.{name}")
        yield store


def server_now(store: JobStore) -> dt.datetime:
    with store.pool.connection() as conn:
        return conn.execute("SELECT now()").fetchone()[0]


def day(moment: dt.datetime) -> str:
    return moment.astimezone(dt.timezone.utc).strftime("%Y%m%d")


def finish(store: JobStore, when: dt.datetime, *, key: str | None = None, queue="q") -> str:
    """A job sent and succeeded at ``when`` (injected clock), optionally keyed."""
    job_id = str(uuid.uuid4())
    store.enqueue(
        NewJob(job_id, queue, "act", message={"x": 1}, max_attempts=3, idempotency_key=key),
        now=when,
    )
    (claimed,) = [c for c in store.claim(queue, 100, "w", 30, now=when) if c.id == job_id]
    assert store.complete([Attempt(job_id, "w", claimed.attempts)], now=when) == {job_id}
    return job_id


def sql_one(store: JobStore, text: str, params=None):
    with store.pool.connection() as conn:
        return conn.execute(text.format(s=store.schema), params).fetchone()


def remove_partitions(store: JobStore, days: list[dt.datetime]) -> None:
    """Detach and drop every parent's partition of ``days`` (maintenance then has to make
    them again)."""
    with store.pool.connection() as conn:
        for moment in days:
            for parent in (
                "jobs_history_succeeded",
                "jobs_history_failed",
                "jobs_history_cancelled",
                "job_events",
            ):
                conn.execute(f"DROP TABLE IF EXISTS {store.schema}.{parent}_{day(moment)}")


def hot_path_round(store: JobStore, queue: str) -> float:
    """One send, claim and outcome; returns the slowest of the three (seconds)."""
    job_id = str(uuid.uuid4())
    slowest = 0.0
    started = time.monotonic()
    store.enqueue(NewJob(job_id, queue, "act", message={"x": 1}, max_attempts=3))
    slowest = max(slowest, time.monotonic() - started)
    started = time.monotonic()
    claimed = [c for c in store.claim(queue, 10, "w", 30) if c.id == job_id]
    slowest = max(slowest, time.monotonic() - started)
    started = time.monotonic()
    assert store.complete([Attempt(job_id, "w", claimed[0].attempts)]) == {job_id}
    return max(slowest, time.monotonic() - started)


def test_a_long_reader_of_history_stalls_neither_the_hot_path_nor_maintenance(store, pg_url):
    """With a reader holding ACCESS SHARE on jobs_history (a pg_dump, a slow admin query),
    maintenance that has partitions to make and a day to drop leaves them to the next run
    and says so, while sends, claims and outcomes go on without waiting for it."""
    now = server_now(store)
    with store.pool.connection() as conn:
        create_partitions(conn, store.schema, now - dt.timedelta(days=10), 0)
    finish(store, now - dt.timedelta(days=10))
    remove_partitions(store, [now + dt.timedelta(days=d) for d in (3, 4, 5)])

    with psycopg.connect(pg_url) as reader:
        reader.execute(f"SELECT count(*) FROM {store.schema}.jobs_history")
        reports = []
        runner = threading.Thread(
            target=lambda: reports.append(
                prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
            )
        )
        started = time.monotonic()
        runner.start()
        slowest = 0.0
        rounds = 0
        while runner.is_alive() or rounds < 5:
            slowest = max(slowest, hot_path_round(store, "hot"))
            rounds += 1
            assert time.monotonic() - started < 60, "maintenance hung behind the reader"
        runner.join()
        took = time.monotonic() - started
        reader.rollback()

    (report,) = reports
    assert slowest < HOT_PATH_BOUND, f"a send, claim or outcome waited {slowest:.2f}s"
    assert took < 30, f"maintenance took {took:.1f}s"
    # History's parents were held: their days are skipped and named; events' went ahead.
    assert report.steps["create"].state == "skipped", report.steps["create"]
    assert f"jobs_history_succeeded_{day(now + dt.timedelta(days=3))}" in (
        report.steps["create"].detail
    )
    assert f"job_events_{day(now + dt.timedelta(days=3))}" not in report.steps["create"].detail
    assert report.steps["drop"].state == "skipped", report.steps["drop"]
    assert not report.failed and not report.complete

    after = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
    assert not after.failed and after.complete, after.steps
    assert after.steps["create"].state == after.steps["drop"].state == "ok"
    assert f"jobs_history_succeeded_{day(now - dt.timedelta(days=10))}" in after.dropped


@pytest.mark.parametrize("at_once", [10_000, 5], ids=["one transaction", "batches"])
def test_rows_in_default_partitions_move_into_their_days(store, monkeypatch, at_once):
    """Rows of days that had no partition (maintenance off, an upgrade) move out of the
    DEFAULT partitions into their day's partition, made for them (a small day in the
    attach's own transaction, a big one in batches first); rows past their age are
    deleted; nothing is lost; a keyed send still finds its key's job."""
    from dramatiq_pg_broker.history import partitions

    monkeypatch.setattr(partitions, "MOVE_AT_ONCE_ROWS", at_once)
    now = server_now(store)
    kept_day, old_day = now - dt.timedelta(days=3), now - dt.timedelta(days=9)
    kept = [finish(store, kept_day + dt.timedelta(minutes=i)) for i in range(25)]
    keyed = finish(store, kept_day, key="moved-key")
    expired = [finish(store, old_day) for _ in range(3)]
    default_rows = sql_one(
        store,
        "SELECT (SELECT count(*) FROM {s}.jobs_history_succeeded_default),"
        " (SELECT count(*) FROM {s}.job_events_default)",
    )
    assert default_rows == (29, 29)  # 29 jobs, each with its `created` event of that day

    report = prune(store.pool, store.schema, RetentionPolicy(), batch=10, rest=False, now=now)

    assert not report.failed and report.complete, report.steps
    assert report.moved == {"jobs_history_succeeded_default": 26, "job_events_default": 26}
    assert report.jobs["succeeded"] == 3
    assert sql_one(
        store,
        "SELECT (SELECT count(*) FROM {s}.jobs_history_succeeded_default),"
        " (SELECT count(*) FROM {s}.job_events_default)",
    ) == (0, 0)
    partition = sql_one(
        store, "SELECT tableoid::regclass::text FROM {s}.jobs_history WHERE id = %s", (kept[0],)
    )[0]
    assert partition.endswith(f"jobs_history_succeeded_{day(kept_day)}")
    assert sql_one(
        store, "SELECT count(*) FROM {s}.all_jobs WHERE id = ANY(%s::uuid[])", (kept + [keyed],)
    ) == (26,)
    assert sql_one(
        store, "SELECT count(*) FROM {s}.all_jobs WHERE id = ANY(%s::uuid[])", (expired,)
    ) == (0,)
    # The events' day partition holds the `created` events; a timeline is whole.
    assert sql_one(
        store,
        "SELECT count(*) FROM {s}.job_events WHERE job_id = %s AND tableoid = %s::regclass",
        (kept[0], f"{store.schema}.job_events_{day(kept_day)}"),
    ) == (1,)
    again = store.enqueue(
        NewJob(
            str(uuid.uuid4()), "q", "act", message={}, max_attempts=3, idempotency_key="moved-key"
        )
    )
    assert str(again.id) == keyed and not again.created


@pytest.mark.parametrize("at_once", [10_000, 5], ids=["one transaction", "batches"])
def test_rows_of_default_stay_in_sight_when_their_day_cannot_be_attached(
    store, pg_url, monkeypatch, at_once
):
    """A long reader of history holds the DEFAULT partition the attach needs: the day's
    rows stay in DEFAULT, where readers see them (not moved out of sight for as long as
    the reader reads), and the step says skipped; the next run moves them."""
    from dramatiq_pg_broker.history import partitions

    monkeypatch.setattr(partitions, "MOVE_AT_ONCE_ROWS", at_once)
    now = server_now(store)
    jobs = [finish(store, now - dt.timedelta(days=3)) for _ in range(12)]
    visible = "SELECT count(*) FROM {s}.jobs_history WHERE id = ANY(%s::uuid[])"
    with psycopg.connect(pg_url) as reader:
        reader.execute(f"SELECT count(*) FROM {store.schema}.jobs_history_succeeded")
        report = prune(store.pool, store.schema, RetentionPolicy(), batch=5, rest=False, now=now)
        reader.rollback()
    assert report.steps["default"].state == "skipped", report.steps["default"]
    assert f"jobs_history_succeeded_{day(now - dt.timedelta(days=3))}" in (
        report.steps["default"].detail
    )
    assert report.moved.get("jobs_history_succeeded_default", 0) == 0
    assert sql_one(store, visible, (jobs,)) == (12,)
    assert sql_one(store, "SELECT count(*) FROM {s}.jobs_history_succeeded_default") == (12,)

    after = prune(store.pool, store.schema, RetentionPolicy(), batch=5, rest=False, now=now)
    assert after.steps["default"].state == "ok", after.steps["default"]
    assert after.moved["jobs_history_succeeded_default"] == 12
    assert sql_one(store, visible, (jobs,)) == (12,)


def test_one_failing_step_leaves_the_others_running_and_prune_exits_1(store, run, schema):
    """A step that raises (here the partition creation, as a statement timeout while it
    scanned a big DEFAULT partition did) is reported with its error; the drop, the DEFAULT
    rows and the reclaimers still run; ``prune`` exits 1 naming the step."""
    now = server_now(store)
    remove_partitions(store, [now + dt.timedelta(days=5)])
    with store.pool.connection() as conn:
        create_partitions(conn, store.schema, now - dt.timedelta(days=10), 0)
    dropped_day = finish(store, now - dt.timedelta(days=10))
    default_row = finish(store, now - dt.timedelta(days=9))  # no partition: DEFAULT
    with store.pool.connection() as conn:
        conn.execute(
            f"INSERT INTO {schema}.workers (id, host, pid, expires_at)"
            " VALUES ('gone', 'h', 1, now() - interval '1 minute')"
        )
        original = conn.execute(
            "SELECT pg_get_functiondef(%s::regprocedure)",
            (f"{schema}.prepare_history_partition(text, date)",),
        ).fetchone()[0]
        conn.execute(
            f"CREATE OR REPLACE FUNCTION {schema}.prepare_history_partition(parent text, day date)"
            " RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION"
            " 'canceling statement due to statement timeout' USING ERRCODE = 'query_canceled';"
            " END $$"
        )
    try:
        code, out, err = run("prune")
    finally:
        with store.pool.connection() as conn:
            conn.execute(original)
    assert code == 1, (out, err)
    assert "create" in err and "statement timeout" in err, err
    assert "cannot connect" not in err
    lines = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.split()}
    assert lines["create"] == "failed"
    for step in ("drop", "default", "results", "rate_limits", "workers", "abort"):
        assert lines[step] == "ok", out
    assert sql_one(
        store,
        "SELECT count(*) FROM {s}.all_jobs WHERE id = ANY(%s::uuid[])",
        ([dropped_day, default_row],),
    ) == (0,)
    assert sql_one(store, "SELECT count(*) FROM {s}.workers WHERE id = 'gone'") == (0,)

    code, out, err = run("prune")
    assert code == 0, (out, err)
    code, out, err = run("status")
    assert "history partitions: 7 day(s) ahead" in out, out
    assert "jobs_history_succeeded_default 0" in out, out


def test_keyed_sends_reusing_keys_of_an_expiring_day_never_deadlock_with_its_drop(store):
    """Keyed sends of messages stamped on a day being dropped (their probe reads that day,
    their key is one of its jobs') race with the drop: no DeadlockDetected on either side,
    and every key ends with exactly one live job or its old one."""
    now = server_now(store)
    old = now - dt.timedelta(days=10)
    rounds, keys_per_round = 4, 20
    deadlocks: list[BaseException] = []
    errors: list[BaseException] = []
    for r in range(rounds):
        with store.pool.connection() as conn:
            create_partitions(conn, store.schema, old, 0)
        keys = [f"k{r}-{i}" for i in range(keys_per_round)]
        for key in keys:
            finish(store, old, key=key)
        barrier = threading.Barrier(3)
        reports = []

        def send(keys=keys, barrier=barrier):
            barrier.wait(timeout=30)
            for key in keys:
                try:
                    store.enqueue(
                        NewJob(
                            str(uuid.uuid4()),
                            "q",
                            "act",
                            message={},
                            max_attempts=3,
                            idempotency_key=key,
                            sent_at_ms=int(old.timestamp() * 1000),
                        )
                    )
                except psycopg.errors.DeadlockDetected as e:
                    deadlocks.append(e)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

        def maintain(barrier=barrier, reports=reports):
            barrier.wait(timeout=30)
            reports.append(
                prune(store.pool, store.schema, RetentionPolicy(), batch=5, rest=False, now=now)
            )

        threads = [threading.Thread(target=send), threading.Thread(target=send)]
        threads.append(threading.Thread(target=maintain))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not deadlocks, f"round {r}: {deadlocks[0]}"
        assert not errors, f"round {r}: {errors[0]!r}"
        (report,) = reports
        assert report.steps["drop"].state in ("ok", "skipped"), report.steps["drop"]
        assert not report.failed, report.steps
        # Drop what a skipped round left, for the next round.
        prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
        # A key is either free (its old job dropped after the sends) or held by one job.
        (most,) = sql_one(
            store,
            "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM {s}.jobs"
            " WHERE idempotency_key = ANY(%s) GROUP BY idempotency_key) AS c",
            (keys,),
        )
        assert most <= 1


@pytest.mark.parametrize("parent", ["jobs_history_failed", "job_events"])
def test_a_day_ahead_attaches_without_scanning_a_default_partition_that_holds_rows(
    store, pg_url, parent
):
    """While a DEFAULT partition holds rows, a day ahead is attached after a validated
    CHECK constraint proves the partition holds none of that day (its scan runs under
    SHARE UPDATE EXCLUSIVE): PostgreSQL then skips scanning it under the attach's ACCESS
    EXCLUSIVE lock. The constraint goes afterwards."""
    from dramatiq_pg_broker import retention
    from dramatiq_pg_broker.history import ddl

    now = server_now(store)
    with store.pool.connection() as conn:
        conn.execute(
            f"INSERT INTO {store.schema}.jobs_history (id, queue_name, actor_name, message,"
            " status, attempts, max_attempts, created_at, updated_at, finished_at)"
            " SELECT gen_random_uuid(), 'q', 'a', '{}', 'failed', 1, 1, t, t, t"
            " FROM generate_series(1, 50) AS n,"
            " LATERAL (SELECT now() - interval '3 days' AS t) AS x"
        )
        conn.execute(
            f"INSERT INTO {store.schema}.job_events (job_id, type, created_at)"
            " SELECT gen_random_uuid(), 'created', now() - interval '3 days'"
            " FROM generate_series(1, 50)"
        )
    ahead = (now + dt.timedelta(days=20)).date()
    run = retention._Run(
        store.pool,
        store.schema,
        RetentionPolicy(),
        batch=100,
        dry_run=False,
        budget_seconds=None,
        stop=None,
        rest=False,
        partitions_ahead=7,
    )
    run.clock = now
    with store.pool.connection() as conn:
        conn.execute(
            "SELECT {s}.prepare_history_partition(%s, %s)".replace("{s}", store.schema),
            (parent, ahead),
        )
    names = run.exclude_from_default(parent, ahead)
    assert names == {
        "partition": f"{parent}_default",
        "constraint": f"{parent}_default_not_{ahead:%Y%m%d}",
    }
    notices: list[str] = []
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        conn.execute("SET client_min_messages = debug1")
        conn.execute(f"SELECT {store.schema}.attach_history_partition(%s, %s)", (parent, ahead))
    assert any(
        "default partition" in n and "implied by existing constraints" in n for n in notices
    ), notices
    assert not any(n.startswith("verifying table") for n in notices), notices
    run.ddl(ddl._named(run.queries["drop_exclusion"], **names))

    # The create step does the same for its days ahead, and leaves no constraint behind.
    remove_partitions(store, [now + dt.timedelta(days=d) for d in (4, 5)])
    report = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
    assert report.steps["create"].state == "ok", report.steps["create"]
    assert report.created == 8
    assert sql_one(
        store,
        "SELECT count(*) FROM pg_constraint WHERE conname LIKE '%%default_not_%%'"
        " AND connamespace = %s::regnamespace",
        (store.schema,),
    ) == (0,)


def test_outcomes_racing_the_creation_of_many_days_never_deadlock(store):
    """Outcomes (a job moved to history and its event written, in one statement) race with
    the creation of a week of partitions while the events' DEFAULT partition holds rows:
    the attach takes SHARE UPDATE EXCLUSIVE on each parent, which outcomes never wait
    for, so neither side deadlocks or stalls (before 0013 each CREATE ... PARTITION OF
    took ACCESS EXCLUSIVE on a parent and scanned DEFAULT under it: DeadlockDetected
    between jobs_history_succeeded and job_events)."""
    now = server_now(store)
    with store.pool.connection() as conn:
        conn.execute(
            f"INSERT INTO {store.schema}.job_events (job_id, type, created_at)"
            " SELECT gen_random_uuid(), 'created', now() - interval '3 days'"
            " FROM generate_series(1, 20000)"
        )
    failures: list[BaseException] = []
    slowest = [0.0]
    for round_ in range(3):
        remove_partitions(store, [now + dt.timedelta(days=d) for d in range(1, 8)])
        stop = threading.Event()

        def outcomes(n: int, stop=stop) -> None:
            while not stop.is_set():
                try:
                    slowest[0] = max(slowest[0], hot_path_round(store, f"race{n}"))
                except Exception as e:  # noqa: BLE001 - reported below
                    failures.append(e)
                    return

        threads = [threading.Thread(target=outcomes, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        try:
            report = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not failures, f"round {round_}: {failures[0]!r}"
        assert not report.failed, report.steps
        assert report.created >= 7 * 4 - 4, report.steps["create"]
    assert slowest[0] < HOT_PATH_BOUND, f"an outcome waited {slowest[0]:.2f}s"


class LockWaits:
    """Every lock request on a relation of the database seen waiting (not granted) while
    it runs: polled from pg_locks every millisecond on a connection of its own."""

    def __init__(self, pg_url: str) -> None:
        self.pg_url = pg_url
        self.seen: list[tuple] = []
        self.polls = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poll)

    def poll(self) -> None:
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            while not self.stop.is_set():
                self.seen += conn.execute(
                    "SELECT l.relation::regclass::text, l.mode, a.query"
                    " FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid"
                    " WHERE NOT l.granted AND l.locktype = 'relation'"
                    " AND l.database = (SELECT oid FROM pg_database"
                    "                   WHERE datname = current_database())"
                ).fetchall()
                self.polls += 1
                time.sleep(0.001)

    def __enter__(self) -> LockWaits:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)


def test_maintenance_never_queues_a_lock_request_behind_a_long_reader(store, pg_url, monkeypatch):
    """Before each DDL statement maintenance asks pg_locks who holds the locks it needs: a
    reader of history in a long transaction holds them, so each try gives up without
    queueing (a waiting ACCESS EXCLUSIVE request would make every later send reading
    history queue behind it). While the reader reads, no lock request of maintenance is
    ever seen waiting; the attaches, the drop and the move of history are left to the
    next run and named; the events' go ahead. The DEFAULT partitions are taken as too big
    to scan, so the constraint that spares the scan is made too, and none is left."""
    from dramatiq_pg_broker.history import partitions

    monkeypatch.setattr(partitions, "SCAN_AT_ONCE_BYTES", 0)
    now = server_now(store)
    with store.pool.connection() as conn:
        create_partitions(conn, store.schema, now - dt.timedelta(days=10), 0)
    finish(store, now - dt.timedelta(days=10))  # a day to drop
    moved = [finish(store, now - dt.timedelta(days=3)) for _ in range(3)]  # in DEFAULT
    remove_partitions(store, [now + dt.timedelta(days=d) for d in (3, 4, 5)])

    with psycopg.connect(pg_url) as reader:
        reader.execute(f"SELECT count(*) FROM {store.schema}.jobs_history")
        with LockWaits(pg_url) as waits:
            report = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
        reader.rollback()

    assert waits.polls > 10, "the sampler did not run"
    assert not waits.seen, f"lock requests waited: {waits.seen[:5]}"
    assert not report.failed and not report.complete, report.steps
    for step in ("create", "drop", "default"):
        assert report.steps[step].state == "skipped", report.steps[step]
    assert f"jobs_history_succeeded_{day(now + dt.timedelta(days=3))}" in (
        report.steps["create"].detail
    )
    assert f"jobs_history_succeeded_{day(now - dt.timedelta(days=10))}" in (
        report.steps["drop"].detail
    )
    assert f"jobs_history_succeeded_{day(now - dt.timedelta(days=3))}" in (
        report.steps["default"].detail
    )
    # The events' DEFAULT partition was not read: its day moved and was attached.
    assert report.moved == {"job_events_default": 3}, report.moved
    assert sql_one(
        store,
        "SELECT count(*) FROM {s}.jobs_history_succeeded_default WHERE id = ANY(%s)",
        (moved,),
    ) == (3,)

    after = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
    assert not after.failed and after.complete, after.steps
    assert after.moved == {"jobs_history_succeeded_default": 3}, after.moved
    assert f"jobs_history_succeeded_{day(now - dt.timedelta(days=10))}" in after.dropped
    assert sql_one(
        store,
        "SELECT count(*) FROM pg_constraint WHERE conname LIKE '%%default_not_%%'"
        " AND connamespace = %s::regnamespace",
        (store.schema,),
    ) == (0,)


def test_a_session_idle_in_its_transaction_is_not_waited_for_but_a_brief_statement_is(
    store, pg_url
):
    """A session idle in a transaction that touched the events' DEFAULT partition may hold
    its lock for as long as its client likes: the attach that needs it gives up at once,
    without queueing. Once that session ends, the attach queues behind nothing and runs."""
    now = server_now(store)
    ahead = now + dt.timedelta(days=4)
    remove_partitions(store, [ahead])
    with psycopg.connect(pg_url) as idle:
        idle.execute(f"SELECT count(*) FROM {store.schema}.job_events_default")
        with LockWaits(pg_url) as waits:
            report = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
        idle.rollback()
    assert not waits.seen, f"lock requests waited: {waits.seen[:5]}"
    assert report.steps["create"].state == "skipped", report.steps["create"]
    assert f"job_events_{day(ahead)}" in report.steps["create"].detail
    assert f"jobs_history_succeeded_{day(ahead)}" not in report.steps["create"].detail

    after = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
    assert after.steps["create"].state == "ok", after.steps["create"]
    assert sql_one(
        store,
        "SELECT count(*) FROM {s}.history_partitions WHERE partition = %s",
        (f"job_events_{day(ahead)}",),
    ) == (1,)


def test_a_constraint_left_on_a_default_partition_is_dropped_by_the_next_run(store):
    """A run that stopped between adding a constraint excluding days from a DEFAULT
    partition and dropping it left it there: once those days are today's, it would refuse
    their rows (were their partition missing). The next run's create step drops it."""
    from dramatiq_pg_broker import retention

    now = server_now(store)
    run = retention._Run(
        store.pool,
        store.schema,
        RetentionPolicy(),
        batch=100,
        dry_run=False,
        budget_seconds=None,
        stop=None,
        rest=False,
        partitions_ahead=7,
    )
    run.clock = now
    first, last = (now + dt.timedelta(days=20)).date(), (now + dt.timedelta(days=22)).date()
    names = run.exclude_from_default("jobs_history_failed", first, last)
    assert names["constraint"] == f"jobs_history_failed_default_not_{first:%Y%m%d}_{last:%Y%m%d}"
    constraints = (
        "SELECT count(*) FROM pg_constraint WHERE conname LIKE '%%default_not_%%'"
        " AND connamespace = %s::regnamespace"
    )
    assert sql_one(store, constraints, (store.schema,)) == (1,)
    report = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
    assert report.steps["create"].state == "ok", report.steps["create"]
    assert sql_one(store, constraints, (store.schema,)) == (0,)


def prune_processes(pg_url: str, schema: str, count: int) -> list[subprocess.Popen]:
    """``count`` real ``dramatiq-pg-broker prune`` processes, started at once."""
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dramatiq_pg_broker",
                "--url",
                pg_url,
                "--schema",
                schema,
                "prune",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]


def give_every_step_work(store: JobStore, now: dt.datetime) -> dict[str, list[str]]:
    """Work for each partition step of a run: expired days in partitions of their own
    (drop: history's and, at 40 days, the events'), recent days in DEFAULT (default: moved
    into their days) and an expired day there (default: deleted), the days ahead missing
    (create). Returns the jobs that must go and those that must stay."""
    gone, kept = [], []
    expired_days = [10, 11, 12, 13, 40]
    with store.pool.connection() as conn:
        for days in expired_days:
            create_partitions(conn, store.schema, now - dt.timedelta(days=days), 0)
    for days in expired_days:
        gone += [finish(store, now - dt.timedelta(days=days), key=f"k{uuid.uuid4()}")]
        gone += [finish(store, now - dt.timedelta(days=days))]
    for days in (2, 3):  # no partition: DEFAULT, moved into their days
        kept += [finish(store, now - dt.timedelta(days=days)) for _ in range(3)]
    gone += [finish(store, now - dt.timedelta(days=9))]  # no partition, expired: deleted
    remove_partitions(store, [now + dt.timedelta(days=n) for n in range(1, 8)])
    return {"gone": gone, "kept": kept}


@pytest.mark.slow
def test_any_number_of_prune_processes_at_once_each_exit_0_and_leave_nothing_behind(
    store, pg_url, schema
):
    """Several real ``prune`` processes started together (a cron beside the workers'
    scheduled run, an operator's run beside both), with every partition step having work:
    each exits 0, one of them does each step's work, the others skip the partition steps
    saying who has them, and nothing is left half-done: no table prepared or detached and
    not attached or dropped, no constraint left on a DEFAULT partition, every day ahead
    attached, every expired day gone, every row of a kept day in its partition. Before the
    partition steps took turns, runs dropped each other's tables and constraints half-way
    (``relation ... does not exist``, ``... is not a partition of ...``, exit 1)."""
    now = server_now(store)
    for round_ in range(3):
        jobs = give_every_step_work(store, now)
        processes = prune_processes(pg_url, schema, 4)
        results = [(p.wait(timeout=120), *p.communicate()) for p in processes]
        for code, out, err in results:
            assert code == 0, f"round {round_}: a prune exited {code}:\n{out}\n{err}"
            steps = {line.split()[0]: line for line in out.splitlines() if line.split()}
            for name in ("create", "drop", "default"):
                assert steps[name].split()[1] == "ok" or "turn" in steps[name], (
                    f"round {round_}: step {name}: {steps[name]}"
                )
        assert sql_one(store, "SELECT count(*) FROM {s}.history_partitions_pending") == (0,)
        assert sql_one(
            store,
            "SELECT count(*) FROM pg_constraint WHERE conname LIKE '%%default_not_%%'"
            " AND connamespace = %s::regnamespace",
            (schema,),
        ) == (0,)
        with store.pool.connection() as conn:
            attached = {
                name
                for (name,) in conn.execute(f"SELECT partition FROM {schema}.history_partitions")
            }
            for offset in range(0, 8):
                for parent in ("jobs_history_succeeded", "job_events"):
                    name = f"{parent}_{day(now + dt.timedelta(days=offset))}"
                    assert name in attached, f"round {round_}: {name} is not attached"
            for days in (10, 40):
                name = f"jobs_history_succeeded_{day(now - dt.timedelta(days=days))}"
                assert name not in attached, f"round {round_}: {name} is still there"
            assert f"job_events_{day(now - dt.timedelta(days=40))}" not in attached
            assert conn.execute(
                f"SELECT count(*) FROM {schema}.jobs_history_succeeded_default"
            ).fetchone() == (0,)
            assert conn.execute(
                f"SELECT count(*) FROM {schema}.all_jobs WHERE id = ANY(%s::uuid[])",
                (jobs["gone"],),
            ).fetchone() == (0,)
            assert conn.execute(
                f"SELECT count(*) FROM {schema}.jobs_history_succeeded WHERE id = ANY(%s::uuid[])",
                (jobs["kept"],),
            ).fetchone() == (len(jobs["kept"]),)


def test_a_run_started_while_another_has_the_turn_skips_the_partition_steps(store):
    """A run that finds the partition steps' turn taken skips them at once, saying which
    server process has it, and still runs the reclaimers."""
    from dramatiq_pg_broker.db.queries import Queries
    from dramatiq_pg_broker.history.ddl import Turn

    now = server_now(store)
    remove_partitions(store, [now + dt.timedelta(days=6)])
    query = Queries(store.schema, "retention.sql")["take_turn"]
    with Turn.take(store.pool.url, store.schema, query) as held:
        assert held.ours
        started = time.monotonic()
        report = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
        assert time.monotonic() - started < HOT_PATH_BOUND * 10
    for name in ("create", "drop", "default"):
        step = report.steps[name]
        assert step.state == "skipped", (name, step)
        assert "turn" in step.detail and "server process" in step.detail, step.detail
    for name in ("results", "rate_limits", "workers", "abort"):
        assert report.steps[name].state == "ok", (name, report.steps[name])
    after = prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now)
    assert after.steps["create"].state == "ok", after.steps["create"]
    assert after.created == 4


def test_a_run_whose_turn_ends_leaves_the_rest_of_the_partition_work_to_the_next(store):
    """The server ends the session holding the turn (a restart, an
    idle_in_transaction_session_timeout): the run notices before its next DDL statement,
    reports the step skipped and the later partition steps too, and runs the reclaimers."""
    from dramatiq_pg_broker.history import ddl, retention

    now = server_now(store)
    remove_partitions(store, [now + dt.timedelta(days=n) for n in (5, 6)])
    run = retention._Run(
        store.pool,
        store.schema,
        RetentionPolicy(),
        batch=100,
        dry_run=False,
        budget_seconds=None,
        stop=None,
        rest=False,
        partitions_ahead=7,
    )
    create = run.create

    def create_after_the_turn_ended():
        with store.pool.connection() as conn:
            # This database's turn of this schema only (pg_locks shows the whole server's).
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " AND classid::bigint = %s AND objid::bigint = hashtext(%s)::bigint & 4294967295"
                " AND pid <> pg_backend_pid()",
                (ddl.TURN_NAMESPACE, store.schema),
            )
        return create()

    run.create = create_after_the_turn_ended
    report = run.run(now)
    assert report.steps["create"].state == "skipped", report.steps["create"]
    assert "turn was lost" in report.steps["create"].detail
    assert report.steps["drop"].state == report.steps["default"].state == "skipped"
    assert report.steps["results"].state == "ok"
    assert not report.complete
    assert prune(store.pool, store.schema, RetentionPolicy(), rest=False, now=now).created == 8
