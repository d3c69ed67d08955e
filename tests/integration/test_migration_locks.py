"""Migrations on a live database: no send or claim queues behind a migration's lock
request, whatever reader holds the table; the migration waits its turn, saying whom it
waits for, and runs once the reader lets go (issue 44, item 10). Real PostgreSQL, a real
reader's transaction, the job store's own sends and claims."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from dramatiq_pg_broker.errors import LiveWorkFound
from dramatiq_pg_broker.jobs import Attempt, NewJob
from dramatiq_pg_broker.migrate import migrate

from ..helpers import migrations_ahead, wait_for
from ..rows import emptied_store

pytestmark = pytest.mark.timeout(120)

#: The most a send or a claim may take beside a migration waiting for its lock: the lock
#: timeout (50 ms) with room for a machine shared with other tests. Before migrations had a
#: lock timeout, they waited as long as the reader kept its transaction.
HOT_PATH_BOUND = 0.25

#: How long the test keeps sending and claiming beside the waiting migration: longer than
#: the longest pause between two of its tries (RETRY_EVERY_SECONDS, 2 s), so that tries
#: happen meanwhile.
BESIDE_SECONDS = 3.0


@pytest.fixture
def migrated(pg_url, empty_schema):
    """``empty_schema`` migrated by this code."""
    migrate(pg_url, empty_schema)
    return empty_schema


@contextlib.contextmanager
def reader(url: str, schema: str) -> Iterator[psycopg.Connection]:
    """An application's transaction that read ``jobs`` and stays open (it holds ACCESS
    SHARE on the table, and its snapshot, until the test ends it)."""
    with psycopg.connect(url) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute(f"SELECT count(*) FROM {schema}.jobs").fetchone()
        yield conn


def hot_path_beside(store, hot: psycopg.Connection, seconds: float) -> list[float]:
    """Sends and claims (each followed by its outcome) for ``seconds``, on ``hot``; the
    time each send and each claim took."""
    took = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        job_id = str(uuid.uuid4())
        started = time.monotonic()
        store.enqueue(NewJob(job_id, "q", "act", message={"x": 1}, max_attempts=3), conn=hot)
        took.append(time.monotonic() - started)
        started = time.monotonic()
        claimed = [c for c in store.claim("q", 10, "w", 30, conn=hot) if c.id == job_id]
        took.append(time.monotonic() - started)
        assert claimed, "the job just sent was not claimed"
        store.complete([Attempt(job_id, "w", claimed[0].attempts)], conn=hot)
        time.sleep(0.02)
    return took


def run_migrate(url: str, schema: str, folder) -> tuple[threading.Thread, dict]:
    """``migrate`` with ``folder`` in a thread; its result (or error) lands in the dict."""
    outcome: dict = {}

    def target():
        try:
            outcome["applied"] = migrate(url, schema, directory=folder)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def lock_requests_on_jobs(conn: psycopg.Connection, schema: str) -> int:
    """How many sessions wait for a lock on ``jobs`` now."""
    return conn.execute(
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass(%s)",
        (f"{schema}.jobs",),
    ).fetchone()[0]


def waiting_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "dramatiq_pg_broker.migrate" and "wait" in r.getMessage()
    ]


def test_sends_and_claims_never_queue_behind_a_migration_a_reader_holds_up(
    pg_url, migrated, tmp_path, caplog
):
    """The shape of 0017 and 0021 (ALTER TABLE jobs: ACCESS EXCLUSIVE for an instant),
    after a first statement that succeeds, with an application's transaction holding
    ``jobs``: the migration's transaction times out on its lock, rolls back whole (the
    table its first statement made goes with it) and is tried again once the reader lets
    go; meanwhile every send and claim takes well under the bound (before: each queued
    behind the migration's lock request for as long as the reader kept its transaction,
    5 s for a claim in the issue); the migration says whom it waits for, then that it got
    its locks."""
    caplog.set_level(logging.INFO, logger="dramatiq_pg_broker.migrate")
    folder, name = migrations_ahead(
        tmp_path,
        "compatible",
        "CREATE TABLE lock_probe (id integer);\n"
        "ALTER TABLE jobs ADD CONSTRAINT jobs_lock_probe CHECK (priority > -2147483648) "
        "NOT VALID;\n"
        "ALTER TABLE jobs DROP CONSTRAINT jobs_lock_probe;\n",
    )
    with (
        emptied_store(pg_url, migrated) as store,
        psycopg.connect(pg_url, autocommit=True) as hot,
        reader(pg_url, migrated) as held,
    ):
        # Never wait for good: a send or claim stuck behind the migration fails the test.
        hot.execute("SET lock_timeout = '5s'")
        hot_path_beside(store, hot, 0.2)  # statements prepared, plans made
        reader_pid = held.info.backend_pid
        thread, outcome = run_migrate(pg_url, migrated, folder)
        wait_for(
            lambda: waiting_lines(caplog) or lock_requests_on_jobs(hot, migrated),
            10,
            "the migration to ask for its lock on jobs",
        )
        took = hot_path_beside(store, hot, BESIDE_SECONDS)
        assert thread.is_alive(), f"the migration did not wait for the reader: {outcome}"
        held.rollback()
        thread.join(30)
        assert not thread.is_alive(), "the migration did not finish once the reader let go"
    assert "error" not in outcome, outcome.get("error")
    assert [m.filename for m in outcome["applied"]] == [f"{name}.sql"]
    assert max(took) < HOT_PATH_BOUND, (
        f"a send or claim took {max(took):.3f} s beside the migration "
        f"(median {sorted(took)[len(took) // 2]:.3f} s, {len(took)} statements)"
    )
    lines = waiting_lines(caplog)
    assert f"migration {name}.sql waits for a lock" in lines[0], lines
    assert f"server process {reader_pid} (idle in transaction" in lines[0], lines
    assert "holding AccessShareLock on jobs" in lines[0], lines
    assert f"migration {name}.sql got its locks after waiting" in lines[-1], lines
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = %s AND tablename = 'lock_probe'",
            (migrated,),
        ).fetchone() == (1,)
        assert conn.execute(
            f"SELECT count(*) FROM {migrated}.schema_migrations WHERE name = %s",
            (name.split("_", 1)[1],),
        ).fetchone() == (1,)


def test_an_index_built_outside_a_transaction_waits_for_the_reader_and_holds_up_nothing(
    pg_url, migrated, tmp_path, caplog
):
    """A migration outside a transaction (``-- transaction: none``: CREATE INDEX
    CONCURRENTLY) waits for the reader's snapshot as PostgreSQL makes it wait, saying whom
    it waits for; sends and claims go on meanwhile (its lock is SHARE UPDATE EXCLUSIVE);
    once the reader lets go, the index is built, valid, and the migration recorded."""
    caplog.set_level(logging.INFO, logger="dramatiq_pg_broker.migrate")
    folder, name = migrations_ahead(
        tmp_path,
        "compatible",
        # On a lane: an index of jobs, partitioned since 0028, is built lane by lane.
        "CREATE INDEX CONCURRENTLY jobs_probe_idx ON jobs_lane_long (queue_name, priority);\n",
        transaction="none",
    )
    with (
        emptied_store(pg_url, migrated) as store,
        psycopg.connect(pg_url, autocommit=True) as hot,
        reader(pg_url, migrated) as held,
    ):
        hot.execute("SET lock_timeout = '5s'")
        hot_path_beside(store, hot, 0.2)
        reader_pid = held.info.backend_pid
        thread, outcome = run_migrate(pg_url, migrated, folder)
        wait_for(lambda: waiting_lines(caplog), 15, "the migration to say that it waits")
        took = hot_path_beside(store, hot, 1.0)
        assert thread.is_alive(), f"the index was built beside the reader's snapshot: {outcome}"
        held.rollback()
        thread.join(30)
        assert not thread.is_alive(), "the migration did not finish once the reader let go"
    assert "error" not in outcome, outcome.get("error")
    assert [m.filename for m in outcome["applied"]] == [f"{name}.sql"]
    assert max(took) < HOT_PATH_BOUND, f"a send or claim took {max(took):.3f} s"
    lines = waiting_lines(caplog)
    assert f"migration {name}.sql waits" in lines[0] and f"server process {reader_pid}" in lines[0]
    assert "outside a transaction" in lines[0], lines
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute(
            "SELECT i.indisvalid FROM pg_index AS i WHERE i.indexrelid = to_regclass(%s)",
            (f"{migrated}.jobs_probe_idx",),
        ).fetchone() == (True,)


def test_an_index_build_that_failed_is_dropped_and_the_next_run_builds_it(
    pg_url, migrated, tmp_path
):
    """A CREATE INDEX CONCURRENTLY that fails (here a unique index the rows break) leaves
    an invalid index behind: the runner drops it, raises, records nothing; once the rows
    allow it, the next run builds it."""
    from dramatiq_pg_broker.errors import MigrationError

    folder, name = migrations_ahead(
        tmp_path,
        "compatible",
        "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS jobs_probe_unique"
        " ON jobs_lane_long (actor_name);\n",
        transaction="none",
    )
    with emptied_store(pg_url, migrated) as store:
        for _ in range(2):
            store.enqueue(NewJob(str(uuid.uuid4()), "q", "act", message={}, max_attempts=1))
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"UPDATE {migrated}.jobs SET lane = 3")  # into the long lane
        with pytest.raises(MigrationError, match=name):
            migrate(pg_url, migrated, directory=folder)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            assert conn.execute(
                "SELECT to_regclass(%s)", (f"{migrated}.jobs_probe_unique",)
            ).fetchone() == (None,)
            conn.execute(f"DELETE FROM {migrated}.jobs")
        assert [m.filename for m in migrate(pg_url, migrated, directory=folder)] == [f"{name}.sql"]


def test_the_cli_says_that_a_migration_waits_and_then_applies_it(
    pg_url, migrated, tmp_path, monkeypatch, capsys
):
    """``dramatiq-pg-broker migrate`` prints the wait on a line of its own, then the
    migration's line again once it is applied."""
    from dramatiq_pg_broker.cli import main

    folder, name = migrations_ahead(
        tmp_path, "compatible", "ALTER TABLE jobs ALTER COLUMN last_error SET STORAGE EXTENDED;\n"
    )
    monkeypatch.setenv("DRAMATIQ_PG_MIGRATIONS_DIR", str(folder))
    with reader(pg_url, migrated) as held:
        done: dict = {}
        thread = threading.Thread(
            target=lambda: done.update(
                code=main(["--url", pg_url, "--schema", migrated, "migrate"])
            ),
            daemon=True,
        )
        thread.start()
        out: list[str] = []

        def said_it_waits() -> bool:
            out.append(capsys.readouterr().out)
            return "waits for a lock" in "".join(out) or not thread.is_alive()

        wait_for(said_it_waits, 10, "the migration to say that it waits for its lock")
        held.rollback()
        thread.join(30)
    assert done.get("code") == 0
    out.append(capsys.readouterr().out)
    lines = "".join(out).splitlines()
    assert lines[0] == f"applying {name} ... waiting", lines
    assert lines[1].startswith(f"migration {name}.sql waits for a lock"), lines
    assert any(re.fullmatch(rf"applying {name} \.\.\. done in \d+\.\d s", x) for x in lines)
    assert f"migration {name}.sql got its locks after waiting" in lines[-2] + lines[-1], lines


def test_a_breaking_migration_looks_for_live_work_again_once_it_holds_its_tables(
    pg_url, migrated, tmp_path, caplog
):
    """A breaking migration finds no live work, then waits for its lock (a reader holds
    ``jobs``); meanwhile a job is sent (by an earlier release, as far as ``migrate`` can
    tell). Once the reader lets go, the migration's transaction holds its tables, looks
    again, and refuses: nothing is applied (before: it was, the one look having come
    before the wait)."""
    caplog.set_level(logging.INFO, logger="dramatiq_pg_broker.migrate")
    folder, name = migrations_ahead(
        tmp_path, "breaking", "ALTER TABLE jobs ADD COLUMN future_probe integer;\n"
    )
    with (
        emptied_store(pg_url, migrated) as store,
        psycopg.connect(pg_url, autocommit=True) as hot,
        reader(pg_url, migrated) as held,
    ):
        thread, outcome = run_migrate(pg_url, migrated, folder)
        wait_for(lambda: waiting_lines(caplog), 10, "the migration to wait for its lock")
        store.enqueue(NewJob(str(uuid.uuid4()), "q", "act", message={}, max_attempts=1), conn=hot)
        held.rollback()
        thread.join(30)
        assert not thread.is_alive(), "the migration did not end once the reader let go"
    assert isinstance(outcome.get("error"), LiveWorkFound), outcome
    assert f"migration {name}.sql is breaking" in str(outcome["error"])
    assert "1 send(s) in the last" in str(outcome["error"]), outcome["error"]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute(
            "SELECT count(*) FROM information_schema.columns "
            "WHERE table_schema = %s AND table_name = 'jobs' AND column_name = 'future_probe'",
            (migrated,),
        ).fetchone() == (0,)


def test_migrations_applied_together_take_their_locks_before_they_change_anything(
    pg_url, migrated, tmp_path, caplog
):
    """Two migrations applied in one transaction (a breaking one on ``jobs``, then one on
    ``job_events``), a reader holding ``job_events``: the transaction waits for its locks
    at its start, before the first migration runs, and each migration runs once (before:
    the first one ran, the second's lock timed out, and the whole transaction, the first
    one's work with it, was thrown away and run again at each try)."""
    from dramatiq_pg_broker.db.handshake import this_code

    caplog.set_level(logging.INFO, logger="dramatiq_pg_broker.migrate")
    folder, first = migrations_ahead(
        tmp_path, "breaking", "ALTER TABLE jobs ADD COLUMN future_a integer;\n"
    )
    second = f"{this_code().level + 2:04d}_future_events"
    (folder / f"{second}.sql").write_text(
        "-- compatibility: compatible\n-- A later release's change, made up by the test.\n"
        "ALTER TABLE job_events ADD COLUMN future_b integer;\n"
    )
    started: list[str] = []
    outcome: dict = {}

    def target():
        try:
            outcome["applied"] = migrate(
                pg_url,
                migrated,
                directory=folder,
                report=lambda m, took: took is None and started.append(m.filename),
            )
        except BaseException as e:  # noqa: BLE001 - reported by the test
            outcome["error"] = e

    with psycopg.connect(pg_url) as held:
        held.execute(f"SELECT count(*) FROM {migrated}.job_events").fetchone()
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        wait_for(lambda: waiting_lines(caplog), 10, "the migration to wait for its lock")
        held.rollback()
        thread.join(30)
        assert not thread.is_alive(), "the migrations did not end once the reader let go"
    assert "error" not in outcome, outcome.get("error")
    assert [m.filename for m in outcome["applied"]] == [f"{first}.sql", f"{second}.sql"]
    assert started == [f"{first}.sql", f"{second}.sql"], f"migrations run more than once: {started}"
