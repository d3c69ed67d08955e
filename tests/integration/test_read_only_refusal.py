"""A pooled connection that meets a server refusing to write (SQLSTATE 25006, what a standby
says; here a session made read-only, no standby needed) has the pool replace every
connection opened before that refusal: the idle ones, the ones in use, and the ones still
being opened then, none handed out again. The process tells that refusal once: a refusal
on a connection opened before it, after the database answered again, is no new outage."""

from __future__ import annotations

import contextlib
import logging
import threading

import dramatiq
import psycopg
import pytest

from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool, outage
from dramatiq_pg_broker.db import core as db

from ..helpers import wait_for

pytestmark = pytest.mark.timeout(60)

OUTAGE_STARTS = "The database is unreachable"
OUTAGE_ENDS = "The database is reachable again"


@pytest.fixture
def told(monkeypatch, caplog):
    """The outage lines the process logs during the test (a tracker of the test's own)."""
    monkeypatch.setattr(outage, "tracker", outage.Outage())
    caplog.set_level(logging.WARNING, logger=outage.logger.name)
    return lambda: [r.getMessage() for r in caplog.records if r.name == outage.logger.name]


def open_pool(pg_url: str, schema: str, size: int, **kwargs) -> ProcessPool:
    settings = Settings.load(url=pg_url, schema=schema, pool_min_size=size, pool_max_size=size)
    pool = ProcessPool(settings, **kwargs)
    pool.check_schema()
    wait_for(
        lambda: pool.get().get_stats().get("pool_available", 0) == size,
        10,
        f"the pool to hold {size} idle connections",
    )
    return pool


def refuse_a_write(conn: psycopg.Connection) -> None:
    conn.execute("SET default_transaction_read_only = on")
    conn.execute("CREATE TEMPORARY TABLE refused (n int)")


def backend_pids(pool: ProcessPool, n: int) -> set[int]:
    """The server processes of ``n`` connections taken from the pool at once."""
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(pool.connection()) for _ in range(n)]
        return {c.execute("SELECT pg_backend_pid()").fetchone()[0] for c in conns}


def alive(conn: psycopg.Connection, pids: set[int]) -> set[int]:
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", (sorted(pids),)
    ).fetchall()
    return {pid for (pid,) in rows}


def test_a_refusal_to_write_replaces_the_connections_idle_in_use_and_being_opened(
    pg_url, schema, conn, told
):
    # A connection whose opening is under way at the refusal: held in the pool's configure
    # step (after it connected, before it joins the pool) until the refusal is over.
    holding, held, release = threading.Event(), threading.Event(), threading.Event()
    opening: list[int] = []

    def configure(c: psycopg.Connection) -> None:
        if holding.is_set() and not opening:
            opening.append(c.info.backend_pid)
            held.set()
            release.wait(10)

    pool = open_pool(pg_url, schema, 3, configure=configure)
    try:
        before = backend_pids(pool, 3)
        holding.set()
        pool.get().resize(min_size=4, max_size=4)
        wait_for(held.is_set, 10, "a fourth connection to be opening")
        with pool.connection() as in_use:
            with pytest.raises(dramatiq.errors.ConnectionClosed) as refused:
                with pool.connection() as c:
                    refuse_a_write(c)
            assert isinstance(refused.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)
            in_use.execute("SELECT 1")
        release.set()
        stale = before | set(opening)
        after = backend_pids(pool, 4)
        assert not after & stale, "a connection opened before the refusal was handed out"
        wait_for(lambda: not alive(conn, stale), 10, "the replaced connections to be closed")
    finally:
        release.set()
        pool.close()
    assert len(told()) == 2, told()
    assert told()[0].startswith(OUTAGE_STARTS) and "read-only" in told()[0], told()
    assert told()[1].startswith(OUTAGE_ENDS), told()


def test_a_refusal_on_a_connection_taken_before_an_earlier_one_is_no_new_outage(
    pg_url, schema, told
):
    pool = open_pool(pg_url, schema, 2)
    try:
        with pytest.raises(dramatiq.errors.ConnectionClosed):
            with pool.connection() as taken_before:
                with pytest.raises(dramatiq.errors.ConnectionClosed):
                    with pool.connection() as c:
                        refuse_a_write(c)
                # The database answers on a connection that replaced the refused one.
                with pool.connection() as c:
                    c.execute("SELECT 1")
                assert len(told()) == 2, told()
                # The connection taken before the refusal now refuses too (it was led to
                # the same server): the same episode, told already.
                refuse_a_write(taken_before)
        assert len(told()) == 2, told()
        # A refusal on a connection opened after it is a new outage.
        with pytest.raises(dramatiq.errors.ConnectionClosed):
            with pool.connection() as c:
                refuse_a_write(c)
    finally:
        pool.close()
    assert len(told()) == 3, told()
    assert [m.startswith(OUTAGE_STARTS) for m in told()] == [True, False, True], told()


def test_during_an_outage_a_hot_standbys_answer_ends_nothing(pg_url, schema, told, monkeypatch):
    pool = open_pool(pg_url, schema, 2)
    try:
        with pool.connection() as c:
            assert not db.in_hot_standby(c), "the test server reports itself a standby"
        closed = psycopg.connect(pg_url)
        closed.close()
        assert not db.in_hot_standby(closed)
        with pytest.raises(dramatiq.errors.ConnectionClosed):
            with pool.connection() as c:
                refuse_a_write(c)
        # What a standby reports of itself (in_hot_standby = on), which a primary cannot be
        # made to say: a read it answers leaves the outage on.
        reported = db.in_hot_standby
        monkeypatch.setattr(db, "in_hot_standby", lambda c: True)
        with pool.connection() as c:
            c.execute("SELECT 1")
        assert len(told()) == 1 and outage.tracker.unreachable, told()
        monkeypatch.setattr(db, "in_hot_standby", reported)
        with pool.connection() as c:
            c.execute("SELECT 1")
    finally:
        pool.close()
    assert len(told()) == 2 and told()[1].startswith(OUTAGE_ENDS), told()
