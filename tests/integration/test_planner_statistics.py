"""Tables that never held a row are not planned as known to be empty (migration 0019).

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
from dramatiq_pg_broker.migrate import migrate

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


def _sequential_scans(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    """The sequential scans of jobs and of history's partitions in ``conn``'s open
    transaction."""
    return dict(
        conn.execute(
            "SELECT relname, seq_scan FROM pg_stat_xact_user_tables"
            " WHERE schemaname = %s AND seq_scan > 0"
            "   AND (relname = 'jobs' OR relname LIKE 'jobs\\_history\\_%%')",
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
