"""broker.transaction(conn): a job commits or rolls back with the application's writes."""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import sql
from psycopg.conninfo import make_conninfo
from sqlalchemy.orm import Session

from dramatiq_pg_broker import TransactionError
from dramatiq_pg_broker.jobs import channel_name

from ..rows import event_types


@pytest.fixture
def invoices(app_table):
    """The application's own table, next to the broker's: its INSERT statement."""
    return app_table("invoices")


def jobs_of(conn, schema, queue) -> list[str]:
    rows = conn.execute(
        sql.SQL("SELECT id FROM {} WHERE queue_name = %s").format(
            sql.Identifier(schema, "all_jobs")
        ),
        (queue,),
    ).fetchall()
    return [str(r[0]) for r in rows]


def count_invoices(conn, schema) -> int:
    return conn.execute(
        sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "invoices"))
    ).fetchone()[0]


@pytest.fixture
def listener(pg_url, schema, queue):
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(schema, queue))))
        yield lambda timeout: [n.channel for n in c.notifies(timeout=timeout, stop_after=1)]


@pytest.mark.parametrize("autocommit", [False, True])
def test_the_job_commits_with_the_application_and_is_notified_only_then(
    broker, task, queue, schema, pg_url, conn, invoices, listener, autocommit
):
    with psycopg.connect(pg_url, autocommit=autocommit) as app:
        with broker.transaction(app):
            app.execute(invoices, (42,))
            message = task.send(42)
            # Not visible, not notified before the commit.
            assert jobs_of(conn, schema, queue) == []
            assert listener(0.3) == []
        assert jobs_of(conn, schema, queue) == [message.message_id]
        assert count_invoices(conn, schema) == 1
        assert listener(10) == [channel_name(schema, queue)]
        assert event_types(broker.store, message.message_id) == ["created"]


@pytest.mark.parametrize("autocommit", [False, True])
def test_a_rollback_leaves_no_job_and_no_event(
    broker, task, queue, schema, pg_url, conn, invoices, listener, autocommit
):
    with psycopg.connect(pg_url, autocommit=autocommit) as app:
        with pytest.raises(RuntimeError):
            with broker.transaction(app):
                app.execute(invoices, (1,))
                message = task.send(1)
                raise RuntimeError("the application changed its mind")
    assert jobs_of(conn, schema, queue) == []
    assert event_types(broker.store, message.message_id) == []
    assert count_invoices(conn, schema) == 0
    assert listener(0.3) == []


def test_inside_an_open_transaction_the_block_is_a_savepoint(
    broker, task, queue, schema, pg_url, conn, invoices
):
    with psycopg.connect(pg_url) as app:
        app.execute(invoices, (7,))  # the application's transaction is open
        with broker.transaction(app):
            task.send(7)
        assert jobs_of(conn, schema, queue) == [], "committed before the application did"
        app.rollback()
    assert jobs_of(conn, schema, queue) == []
    assert count_invoices(conn, schema) == 0


def sa_url(pg_url: str) -> str:
    return pg_url.replace("postgresql://", "postgresql+psycopg://", 1)


def test_a_sqlalchemy_session_commits_or_rolls_back_the_job(
    broker, task, queue, schema, pg_url, conn, invoices
):
    engine = sa.create_engine(sa_url(pg_url))
    insert = sa.text(f'INSERT INTO "{schema}".invoices VALUES (:n)')
    try:
        with Session(engine) as session, session.begin(), broker.transaction(session):
            session.execute(insert, {"n": 1})
            committed = task.send(1)
        with Session(engine) as session:
            with broker.transaction(session):
                session.execute(insert, {"n": 2})
                rolled_back = task.send(2)
            assert jobs_of(conn, schema, queue) == [committed.message_id]
            session.rollback()
    finally:
        engine.dispose()
    assert jobs_of(conn, schema, queue) == [committed.message_id]
    assert event_types(broker.store, rolled_back.message_id) == []
    assert count_invoices(conn, schema) == 1


def test_a_sqlalchemy_connection_commits_or_rolls_back_the_job(
    broker, task, queue, schema, pg_url, conn
):
    engine = sa.create_engine(sa_url(pg_url))
    try:
        with engine.connect() as sa_conn:
            with broker.transaction(sa_conn):
                first = task.send(1)
            sa_conn.commit()
            with broker.transaction(sa_conn):
                task.send(2)
            sa_conn.rollback()
    finally:
        engine.dispose()
    assert jobs_of(conn, schema, queue) == [first.message_id]


def test_other_drivers_and_objects_are_a_clear_error(broker, task, pg_url):
    sqlite = sa.create_engine("sqlite://")
    with sqlite.connect() as other, pytest.raises(TransactionError, match="postgresql\\+psycopg"):
        with broker.transaction(other):
            pass
    autocommit = sa.create_engine(sa_url(pg_url), isolation_level="AUTOCOMMIT")
    try:
        with autocommit.connect() as other, pytest.raises(TransactionError, match="AUTOCOMMIT"):
            with broker.transaction(other):
                pass
    finally:
        autocommit.dispose()
    with pytest.raises(TransactionError, match="psycopg 3 Connection"):
        with broker.transaction(object()):
            pass


@pytest.fixture
def other_database(pg_url, conn):
    """A database of its own on the same server, dropped after the test: whichever server
    the tests run on (the embedded one's only database is ``postgres``), it is not the
    broker's."""
    name = f"dpb_other_{uuid.uuid4().hex[:12]}"
    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def test_a_connection_to_another_database_is_refused(
    broker, task, queue, schema, pg_url, conn, other_database
):
    other_url = make_conninfo(pg_url, dbname=other_database)
    with psycopg.connect(other_url) as other:
        with pytest.raises(TransactionError, match=f"reaches database '{other_database}'"):
            with broker.transaction(other):
                task.send(1)
    assert jobs_of(conn, schema, queue) == []


def test_nested_blocks_on_one_connection_are_savepoints(broker, task, queue, schema, pg_url, conn):
    with psycopg.connect(pg_url) as app:
        with broker.transaction(app):
            kept = task.send(1)
            with pytest.raises(RuntimeError):
                with broker.transaction(app):
                    task.send(2)
                    raise RuntimeError("inner block fails")
            assert jobs_of(conn, schema, queue) == []
    assert jobs_of(conn, schema, queue) == [kept.message_id]


def test_nested_blocks_on_two_connections_write_on_the_innermost(
    broker, task, queue, schema, pg_url, conn
):
    with psycopg.connect(pg_url) as outer, psycopg.connect(pg_url) as inner:
        with pytest.raises(RuntimeError):
            with broker.transaction(outer):
                with broker.transaction(inner):
                    on_inner = task.send(1)
                assert jobs_of(conn, schema, queue) == [on_inner.message_id]
                task.send(2)
                raise RuntimeError("the outer block rolls back")
    assert jobs_of(conn, schema, queue) == [on_inner.message_id]


def test_a_block_belongs_to_its_thread(broker, task, queue, schema, pg_url, conn):
    sent_elsewhere = []
    with psycopg.connect(pg_url) as app:
        with pytest.raises(RuntimeError):
            with broker.transaction(app):
                mine = task.send(1)
                thread = threading.Thread(target=lambda: sent_elsewhere.append(task.send(2)))
                thread.start()
                thread.join(timeout=30)
                # The other thread's send went through the pool: committed already.
                assert jobs_of(conn, schema, queue) == [sent_elsewhere[0].message_id]
                raise RuntimeError("roll back this thread's block")
    assert mine.message_id not in jobs_of(conn, schema, queue)
    assert jobs_of(conn, schema, queue) == [sent_elsewhere[0].message_id]


def test_threads_with_their_own_transactions_commit_independently(
    broker, task, queue, schema, pg_url, conn
):
    barrier = threading.Barrier(4, timeout=30)
    sent: dict[int, str] = {}
    errors = []

    def worker(n: int) -> None:
        try:
            with psycopg.connect(pg_url) as app:
                try:
                    with broker.transaction(app):
                        sent[n] = task.send(n).message_id
                        barrier.wait()  # every thread holds an open transaction here
                        if n % 2:
                            raise RuntimeError("odd threads roll back")
                except RuntimeError:
                    pass
        except Exception as e:  # reported below, with its thread
            errors.append((n, e))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert sorted(jobs_of(conn, schema, queue)) == sorted([sent[0], sent[2]])


def test_an_idempotency_key_inside_a_transaction_returns_the_first_job(
    broker, task, queue, schema, pg_url, conn
):
    with psycopg.connect(pg_url) as app, broker.transaction(app):
        first = task.send_with_options(args=(1,), idempotency_key="inv-1")
        second = task.send_with_options(args=(2,), idempotency_key="inv-1")
    assert second.message_id == first.message_id and second.args == (1,)
    assert jobs_of(conn, schema, queue) == [first.message_id]
