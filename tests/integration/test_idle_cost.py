"""What an idle worker costs the server: statements per queue per poll interval.

The worker runs in a database of its own, created for this test, so that the server's
per-database transaction counters (``pg_stat_database``) count nothing but this worker.
Every statement the broker sends is its own transaction (autocommit), so the counters
count statements. A backend reports its counters when it exits, so the count is read after
the worker has stopped and all its connections are closed.
"""

from __future__ import annotations

import math
import time
import uuid

import dramatiq
import psycopg
import pytest
from dramatiq import Worker
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.migrate import migrate

pytestmark = pytest.mark.timeout(120)

QUEUES = ("idle_a", "idle_b", "idle_c")
POLL_INTERVAL = 0.5
IDLE_SECONDS = 6.0
#: Allowed beyond one statement per queue per poll interval: the first poll interval's
#: statements (LISTEN, the first claim) and the last one cut short by the stop.
SLACK_INTERVALS = 2


@pytest.fixture
def own_database(pg_url):
    """A fresh database (dropped afterwards) and its URL, with the broker's tables."""
    name = f"idle_{uuid.uuid4().hex[:10]}"
    ident = sql.Identifier(name)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(ident))
    url = make_conninfo(pg_url, dbname=name)
    try:
        migrate(url, "idle")
        yield name, url
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))


def _transactions(conn: psycopg.Connection, database: str) -> tuple[int, int]:
    """(committed + rolled back transactions, live backends) of ``database``."""
    row = conn.execute(
        "SELECT xact_commit + xact_rollback, numbackends FROM pg_stat_database WHERE datname = %s",
        (database,),
    ).fetchone()
    return int(row[0]), int(row[1])


def _settled_count(conn: psycopg.Connection, database: str, timeout: float = 30) -> int:
    """The database's transaction count once no backend is connected to it (a backend's
    counters reach the server's statistics when it exits)."""
    deadline = time.monotonic() + timeout
    while True:
        count, backends = _transactions(conn, database)
        if backends == 0:
            return count
        if time.monotonic() > deadline:
            pytest.fail(f"{backends} connection(s) to {database} still open after {timeout}s")
        time.sleep(0.05)


@pytest.mark.xfail(
    reason="measured 89 statements in 7.0 s against a bound of 51 (3 queues, 0.5 s poll "
    "interval): an idle consumer now passes once per poll interval, but each pass runs two "
    "statements per queue, an empty claim and a next-due-time query; one statement that "
    "claims and reports the next due time would meet the bound",
    strict=False,
)
def test_idle_worker_issues_at_most_one_statement_per_queue_per_poll_interval(pg_url, own_database):
    database, url = own_database
    monitor_url = make_conninfo(pg_url)
    assert conninfo_to_dict(monitor_url).get("dbname") != database
    with psycopg.connect(monitor_url, autocommit=True) as monitor:
        before = _settled_count(monitor, database)

        broker = PostgresBroker(url=url, schema="idle", poll_interval=POLL_INTERVAL)
        for queue_name in QUEUES:
            dramatiq.actor(lambda: None, actor_name=f"noop_{queue_name}", queue_name=queue_name,
                           broker=broker)  # fmt: skip
        worker = Worker(broker, worker_threads=1)
        started = time.monotonic()
        worker.start()
        try:
            time.sleep(IDLE_SECONDS)  # the idle period being measured, not a wait for a result
        finally:
            worker.stop()
            broker.close()
        elapsed = time.monotonic() - started

        issued = _settled_count(monitor, database) - before

    intervals = math.ceil(elapsed / POLL_INTERVAL)
    bound = len(QUEUES) * (intervals + SLACK_INTERVALS)
    assert issued > 0, "the idle worker should have polled at least once"
    assert issued <= bound, (
        f"an idle worker with {len(QUEUES)} queues issued {issued} statements in "
        f"{elapsed:.1f}s ({intervals} poll intervals of {POLL_INTERVAL}s); the bound is "
        f"{bound}, one per queue per poll interval"
    )
