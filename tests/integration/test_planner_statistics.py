"""The job tables are not planned as empty when they are not: those that never held a row
are left unanalyzed (migration 0019), and a busy worker analyzes those whose statistics
fell far behind them (jobs/statistics.py).

An ANALYZE of an empty table records it as known to be empty, and PostgreSQL then plans
every lookup in it as a sequential scan: the send's probe of today's history partitions,
the claim, the outcome. Prepared on the workers' connections, such plans outlive the
table's growth until its next ANALYZE (for good on a server without autovacuum), so each
send read the whole of today's history and each transition the whole hot table. A table
never analyzed is planned as holding a few pages, which keeps the index lookups.

The counts are read from ``pg_stat_xact_user_tables``: the scans of the test's own open
transaction, exact and not yet flushed to the shared statistics.
"""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest

from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.jobs import Attempt, JobStore, NewJob
from dramatiq_pg_broker.jobs.statistics import MIN_ROWS
from dramatiq_pg_broker.migrate import migrate

from ..helpers import wait_for

#: Jobs sent, claimed and finished in the test's transaction: enough for psycopg to
#: prepare the statements (after 5 executions) and the server to make its generic plans.
JOBS = 30


@pytest.fixture
def fresh(pg_url, empty_schema):
    migrate(pg_url, empty_schema)
    store = JobStore(ProcessPool(Settings(url=pg_url, schema=empty_schema)), empty_schema)
    yield empty_schema, store
    store.pool.close()


def test_no_empty_table_of_a_fresh_schema_is_analyzed(pg_url, fresh):
    schema, _ = fresh
    with psycopg.connect(pg_url, autocommit=True) as c:
        analyzed = c.execute(
            "SELECT relname FROM pg_class"
            " WHERE relnamespace = %s::regnamespace AND relkind = 'r' AND reltuples >= 0",
            (schema,),
        ).fetchall()
    assert analyzed == []


def _new_job(now_ms: int) -> NewJob:
    # The history probe names today's partitions only when the message says when it was
    # built; a real send always does.
    return NewJob(
        id=str(uuid.uuid4()),
        queue_name="q",
        actor_name="a",
        message_bytes=b"{}",
        max_attempts=1,
        sent_at_ms=now_ms,
    )


def _life(store: JobStore, conn: psycopg.Connection, jobs: int) -> None:
    """``jobs`` jobs sent, claimed and finished on ``conn``, one by one."""
    now_ms = int(time.time() * 1000)
    for _ in range(jobs):
        assert store.enqueue(_new_job(now_ms), conn=conn).created
        (claimed,) = store.claim_or_wait("q", 1, "w", 30, conn=conn).jobs
        assert store.complete([Attempt(claimed.id, "w", claimed.attempts)], conn=conn)


def _backlog(store: JobStore, conn: psycopg.Connection, jobs: int) -> None:
    """A backlog of ``jobs`` jobs sent at once, then drained."""
    now_ms = int(time.time() * 1000)
    store.enqueue_many([_new_job(now_ms) for _ in range(jobs)], conn=conn)
    while claimed := store.claim("q", 500, "w", 30, conn=conn):
        store.complete([Attempt(j.id, "w", j.attempts) for j in claimed], conn=conn)


def _rows_read(conn: psycopg.Connection, schema: str) -> int:
    """The rows of jobs (its lanes, 0028) read in ``conn``'s open transaction, by any scan."""
    return conn.execute(
        "SELECT coalesce(sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)), 0)"
        " FROM pg_stat_xact_user_tables WHERE schemaname = %s AND relname LIKE 'jobs\\_lane\\_%%'",
        (schema,),
    ).fetchone()[0]


def _reltuples(conn: psycopg.Connection, table: str) -> float:
    return conn.execute(
        "SELECT reltuples FROM pg_class WHERE oid = %s::regclass", (table,)
    ).fetchone()[0]


def _flush_counts(conn: psycopg.Connection) -> None:
    """Have this session's counts of inserted and deleted rows reach the server's shared
    statistics now: PostgreSQL 15 and later hold them back for a second or more, and a
    count of deletes that lands after a VACUUM or ANALYZE set the table's live rows is
    taken off the new figure."""
    if conn.info.server_version >= 150000:
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT 1")


def _counted(conn: psycopg.Connection, table: str, rows: int) -> None:
    """Wait until the server's running count of the live rows of ``table`` (what
    refresh_statistics reads) reaches ``rows``."""
    _flush_counts(conn)

    def live() -> bool:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        count = conn.execute("SELECT pg_stat_get_live_tuples(%s::regclass)", (table,))
        return count.fetchone()[0] >= rows

    def seen() -> str:
        stats = conn.execute(
            "SELECT n_live_tup, n_tup_ins, n_tup_del, last_vacuum, last_analyze"
            " FROM pg_stat_user_tables WHERE relid = %s::regclass",
            (table,),
        ).fetchone()
        return f"; pg_stat_user_tables: {stats}"

    wait_for(live, 30, f"the live rows of {table} counted", on_timeout=seen)


def _sequential_scans(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    """The sequential scans of jobs and of history's partitions in ``conn``'s open
    transaction."""
    return dict(
        conn.execute(
            "SELECT relname, seq_scan FROM pg_stat_xact_user_tables"
            " WHERE schemaname = %s AND seq_scan > 0"
            "   AND (relname LIKE 'jobs\\_lane\\_%%' OR relname LIKE 'jobs\\_history\\_%%')",
            (schema,),
        ).fetchall()
    )


def test_a_jobs_life_on_a_fresh_schema_reads_by_index(pg_url, fresh):
    schema, store = fresh
    with psycopg.connect(pg_url) as c:
        _life(store, c, JOBS)
        scans = _sequential_scans(c, schema)
        finished = c.execute(
            f'SELECT count(*) FROM "{schema}".jobs_history WHERE status = %s', ("succeeded",)
        ).fetchone()[0]
    assert finished == JOBS
    assert scans == {}


def test_a_burst_after_a_drain_is_analyzed_and_then_read_by_key(pg_url, fresh):
    """After a backlog drained, VACUUM and the ANALYZE after it counted the table empty,
    and the plans a worker's connection prepared then were reads of the whole table: the
    next burst was read whole at every statement. A busy worker's heartbeat has the table
    analyzed once it holds far more rows than counted, which makes those plans anew."""
    schema, store = fresh
    jobs = f'"{schema}".jobs'
    burst = 12_000
    with psycopg.connect(pg_url, autocommit=True) as c, psycopg.connect(pg_url) as worker:
        _backlog(store, c, 5000)
        _flush_counts(c)
        c.execute(f"VACUUM {jobs}")
        c.execute(f"ANALYZE {jobs}")
        assert {
            _reltuples(c, f'"{schema}".jobs_lane_{lane}') for lane in ("0", "1", "2", "long")
        } == {0}
        # The worker's connection prepares its statements while the table is empty.
        _life(store, worker, JOBS)
        worker.commit()
        assert store.refresh_statistics(conn=c) == [], "an empty table was analyzed"
        # The burst lands in the lane of its period (0028): start it well within one.
        left = c.execute("SELECT 10 - extract(epoch FROM clock_timestamp())::numeric % 10")
        left = float(left.fetchone()[0])
        if left < 5:
            time.sleep(left + 0.05)
        lane = c.execute(f'SELECT "{schema}".job_lane(clock_timestamp())').fetchone()[0]
        table = f'"{schema}".jobs_lane_{lane}'
        store.enqueue_many([_new_job(int(time.time() * 1000)) for _ in range(burst)], conn=c)
        _counted(c, table, MIN_ROWS)
        with psycopg.connect(pg_url) as other:
            other.execute(
                "SELECT pg_advisory_xact_lock(hashtext(%s))",
                (f"dramatiq_pg_broker.statistics.{schema}",),
            )
            assert store.refresh_statistics(conn=c) == [], "two processes analyzed at once"
        analyzed = store.refresh_statistics(conn=c)
        assert [name.rsplit(".", 1)[-1] for name in analyzed] == [f"jobs_lane_{lane}"]
        assert _reltuples(c, table) >= 0.9 * burst
        assert store.refresh_statistics(conn=c) == [], "fresh statistics were refreshed"
        _life(store, worker, JOBS)
        read = _rows_read(worker, schema)
    # By key: a few rows per statement; the plans made for an empty table read the whole
    # backlog at each.
    assert read < 10 * 3 * JOBS, read
