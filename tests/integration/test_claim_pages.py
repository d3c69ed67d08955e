"""A claim writes its job's new row version on the row's own page (migration 0020).

PostgreSQL logs only the changed bytes of an UPDATE whose new version lands on the old
version's page (the message and the other leading and trailing columns are left out of
the WAL record); a version that moves to another page is logged whole. The jobs table is
filled to 45 % by inserts, so a page of rows sent together has room for a claimed version
of each. Read here from the rows' physical places (``ctid``) before and after the claims,
on the real server: a claim that moved a row shows another page.
"""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.jobs import JobStore, NewJob
from dramatiq_pg_broker.migrate import migrate

#: Enough rows to fill several pages at the benchmark's message size.
JOBS = 400
#: Rows a claim takes at once: more than a page holds, as a busy worker's batches do.
BATCH = 50
#: A worker's lease owner id as workers make them (host, pid, random, schema level): the
#: claim writes it into the row, so the new version is larger than the old one.
OWNER = "worker-host-0123.example.internal:123456:1a2b3c4d:L0022"
#: The size of an encoded no-op message of the benchmarks (about 190 bytes) and some.
MESSAGE = (
    b'{"queue_name":"q","actor_name":"a","args":[],"kwargs":{},"options":{},"pad":"'
    + (b"x" * 160)
    + b'"}'
)


@pytest.fixture
def store(pg_url, empty_schema):
    migrate(pg_url, empty_schema)
    store = JobStore(ProcessPool(Settings(url=pg_url, schema=empty_schema)), empty_schema)
    yield store
    store.pool.close()


def _pages(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    rows = conn.execute(
        sql.SQL("SELECT id::text, (ctid::text::point)[0]::bigint FROM {}.jobs").format(
            sql.Identifier(schema)
        )
    ).fetchall()
    return dict(rows)


def test_claims_keep_their_rows_on_their_pages(pg_url, store):
    now_ms = int(time.time() * 1000)
    jobs = [
        NewJob(
            id=str(uuid.uuid4()),
            queue_name="q",
            actor_name="a",
            message_bytes=MESSAGE,
            max_attempts=1,
            sent_at_ms=now_ms,
        )
        for _ in range(JOBS)
    ]
    # One by one, as single sends are written: each insert finds its page by free space.
    for job in jobs:
        assert store.enqueue(job).created
    with psycopg.connect(pg_url, autocommit=True) as conn:
        before = _pages(conn, store.schema)
        assert len(set(before.values())) >= 4  # several pages, each filled by the inserts
        claimed = 0
        while claimed < JOBS:
            # A busy worker's claims: batches of tens of rows (half its claim window), in
            # claim order (the order sent), so one statement claims most rows of a page.
            batch = store.claim_or_wait("q", BATCH, OWNER, 30).jobs
            assert batch
            claimed += len(batch)
        after = _pages(conn, store.schema)
    assert after.keys() == before.keys()
    moved = sorted(job_id for job_id in before if after[job_id] != before[job_id])
    assert moved == [], f"{len(moved)} of {JOBS} claims moved their row to another page"
