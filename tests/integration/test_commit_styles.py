"""Every way an application ends the transaction around ``broker.transaction(conn)``: the
job is committed exactly when the application's transaction commits (seen from another
connection), no connection is ever left idle in a transaction nobody commits, and what
cannot be honoured raises :class:`~dramatiq_pg_broker.TransactionError` instead of losing
the job silently.

Commit styles: ``session.begin()`` around the block, a commit inside the block (how most
FastAPI code commits), a commit after it, a rollback or close inside it, savepoints inside
it and around it; for SQLAlchemy's ``AsyncSession`` and ``AsyncConnection``, psycopg's
``AsyncConnection``, and SQLAlchemy's synchronous ``Session`` and ``Connection``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from dramatiq_pg_broker import JobAlreadyFinished, TransactionError
from tests.helpers import idle_in_transaction
from tests.rows import status_of


@pytest.fixture
def app_name() -> str:
    """The ``application_name`` of the test's own connections (in pg_stat_activity)."""
    return f"commit_styles_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def orders(app_table, schema):
    """The application's table: its name, qualified."""
    app_table("orders")
    return f'"{schema}".orders'


def sa_url(pg_url: str) -> str:
    return "postgresql+psycopg://" + pg_url.split("://", 1)[1]


def committed(broker, message) -> bool:
    """Whether the job is committed (read through the broker's pool: another connection)."""
    return status_of(broker.store, message.message_id) is not None


def count(conn: psycopg.Connection, table: str) -> int:
    return conn.execute(sql.SQL(f"SELECT count(*) FROM {table}")).fetchone()[0]


@contextlib.asynccontextmanager
async def async_engine(pg_url, app_name):
    engine = create_async_engine(
        sa_url(pg_url), connect_args={"application_name": app_name}, pool_size=1
    )
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
def in_engine(pg_url, conn, app_name):
    """``in_engine(main)``: run ``main(engine)`` with an async engine of the test's own;
    return what it returns once the test's connections were seen outside any transaction
    (the pool still holds them)."""

    async def wrapper(main):
        async with async_engine(pg_url, app_name) as engine:
            result = await main(engine)
            # A connection left in a transaction stays so (the pool holds it); one the
            # client dropped leaves within moments, later on a busy machine.
            deadline = time.monotonic() + 10
            while idle_in_transaction(conn, app_name) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert idle_in_transaction(conn, app_name) == [], (
                "a connection was left idle in transaction"
            )
            return result

    return lambda main: asyncio.run(wrapper(main))


# -- AsyncSession and AsyncConnection -----------------------------------------------------


@contextlib.asynccontextmanager
async def app_of(engine, kind):
    """What the application holds: ``(app, commit, rollback, insert)``."""
    if kind == "asyncsession":
        async with AsyncSession(engine) as session:

            async def insert(table, n):
                await session.execute(sa.text(f"INSERT INTO {table} VALUES (:n)"), {"n": n})

            yield session, session.commit, session.rollback, insert
    else:
        async with engine.connect() as conn:

            async def insert(table, n):
                await conn.execute(sa.text(f"INSERT INTO {table} VALUES (:n)"), {"n": n})

            yield conn, conn.commit, conn.rollback, insert


@pytest.fixture(params=["asyncsession", "asyncconnection"])
def in_app(request, in_engine):
    """``in_app(main)``: :func:`in_engine` for ``main(app, commit, rollback, insert)``, on what
    the application holds (:func:`app_of`): the test runs once with each kind."""

    async def with_app(engine, main):
        async with app_of(engine, request.param) as held:
            return await main(*held)

    return lambda main: in_engine(lambda engine: with_app(engine, main))


def test_a_commit_inside_the_block_commits_the_jobs_sent_before_it(
    broker, task, conn, orders, in_app
):
    async def main(app, commit, _, insert):
        async with broker.transaction(app):
            await insert(orders, 1)
            message = task.send(1)
            assert not committed(broker, message)
            await commit()
            # Written on the application's connection just before its COMMIT.
            assert committed(broker, message), "the commit did not take the job"
            assert count(conn, orders) == 1
        return message

    message = in_app(main)
    assert committed(broker, message)


def test_a_send_after_a_commit_inside_the_block_is_refused(broker, task, conn, orders, in_app):
    async def main(app, commit, _, insert):
        async with broker.transaction(app):
            first = task.send(1)
            await commit()
            with pytest.raises(TransactionError, match="was committed inside the block"):
                task.send(2)
            with pytest.raises(TransactionError, match="was committed"):
                await broker.enqueue_async(task.message(3))
            # Nothing is pending: write_pending_sends() has nothing to write.
            assert await broker.write_pending_sends() == []
        # A new block joins the session's next transaction.
        async with broker.transaction(app):
            await insert(orders, 4)
            second = task.send(4)
        assert not committed(broker, second)
        await commit()
        return first, second

    first, second = in_app(main)
    assert committed(broker, first) and committed(broker, second)
    assert count(conn, orders) == 1


def test_a_commit_after_the_block_commits_its_jobs_only_then(broker, task, conn, orders, in_app):
    async def main(app, commit, _, insert):
        async with broker.transaction(app):
            await insert(orders, 1)
            message = task.send(1)
        assert not committed(broker, message), "visible before the application's commit"
        await commit()
        assert committed(broker, message)
        return message

    in_app(main)


def test_session_begin_around_the_block_commits_at_its_end(broker, task, orders, in_engine):
    async def main(engine):
        async with AsyncSession(engine) as session:
            async with session.begin(), broker.transaction(session):
                message = task.send(1)
            assert committed(broker, message)
        async with engine.begin() as aconn:
            async with broker.transaction(aconn):
                other = task.send(2)
            assert not committed(broker, other)
        return message, other

    message, other = in_engine(main)
    assert committed(broker, message) and committed(broker, other)


@pytest.mark.parametrize("ending", ["rollback", "close"])
def test_a_rollback_inside_the_block_drops_its_jobs_and_refuses_later_sends(
    broker, task, conn, orders, in_app, ending
):
    async def main(app, _, rollback, insert):
        async with broker.transaction(app):
            await insert(orders, 1)
            written = task.send(1)
            await broker.write_pending_sends()
            collected = task.send(2)
            await (rollback() if ending == "rollback" else app.close())
            with pytest.raises(TransactionError, match="rolled back"):
                task.send(3)
        return written, collected

    written, collected = in_app(main)
    assert not committed(broker, written) and not committed(broker, collected)
    assert count(conn, orders) == 0


def test_savepoints_inside_the_block_take_their_sends_with_them(broker, task, orders, in_engine):
    async def main(engine):
        async with AsyncSession(engine) as session:
            async with broker.transaction(session):
                kept = task.send(1)
                savepoint = await session.begin_nested()
                dropped = task.send(2)
                inner = await session.begin_nested()
                dropped_inner = task.send(3)
                await inner.commit()
                await savepoint.rollback()
                released = await session.begin_nested()
                await broker.write_pending_sends()
                in_released = task.send(4)
                await released.commit()
                rolled = await session.begin_nested()
                written_then_rolled = task.send(5)
                await broker.write_pending_sends()
                await rolled.rollback()
                after = task.send(6)
                await session.commit()
            return kept, [dropped, dropped_inner, written_then_rolled], [in_released, after]

    kept, dropped, also_kept = in_engine(main)
    assert [committed(broker, m) for m in [kept, *also_kept]] == [True] * 3
    assert [committed(broker, m) for m in dropped] == [False] * 3


def test_a_savepoint_block_that_raises_and_nested_broker_blocks(broker, task, orders, in_engine):
    async def main(engine):
        async with AsyncSession(engine) as session:
            async with broker.transaction(session):
                outer = task.send(1)
                with contextlib.suppress(RuntimeError):
                    async with session.begin_nested():
                        dropped = task.send(2)
                        raise RuntimeError("out of stock")
                async with broker.transaction(session):
                    inner = task.send(3)
                    # Commits what both blocks collected.
                    await session.commit()
                    assert committed(broker, outer) and committed(broker, inner)
                with pytest.raises(TransactionError, match="was committed"):
                    task.send(4)
            return dropped

    dropped = in_engine(main)
    assert not committed(broker, dropped)


def test_a_block_inside_a_savepoint_rolled_back_inside_it_drops_its_jobs(
    broker, task, orders, in_engine
):
    async def main(engine):
        async with AsyncSession(engine) as session:
            async with session.begin():
                outside = task.send(0)  # no block: through the pool, committed at once
                savepoint = await session.begin_nested()
                async with broker.transaction(session):
                    dropped = task.send(1)
                    await savepoint.rollback()
                    with pytest.raises(TransactionError, match="savepoint begun before"):
                        task.send(2)
                async with broker.transaction(session):
                    kept = task.send(3)
            return outside, dropped, kept

    outside, dropped, kept = in_engine(main)
    assert committed(broker, outside) and committed(broker, kept)
    assert not committed(broker, dropped)


def test_a_transaction_ended_behind_the_block_s_back_raises_at_its_end(
    broker, task, orders, in_engine
):
    async def main(engine):
        async with AsyncSession(engine) as session:
            with pytest.raises(TransactionError, match="2 send.s. collected by the block"):
                async with broker.transaction(session):
                    first, second = task.send(1), task.send(2)
                    await (await session.connection()).invalidate()
            return first, second

    first, second = in_engine(main)
    assert not committed(broker, first) and not committed(broker, second)


def test_a_job_refused_at_the_commit_fails_the_commit(broker, task, conn, orders, in_app):
    finished = task.send(5)
    broker.store.cancel(finished.message_id)

    async def main(app, commit, rollback, insert):
        async with broker.transaction(app):
            await insert(orders, 1)
            ok = task.send(1)
            broker.enqueue(finished.copy())  # the id of a job that finished
            with pytest.raises(JobAlreadyFinished):
                await commit()
            await rollback()
        return ok

    ok = in_app(main)
    assert not committed(broker, ok)
    assert count(conn, orders) == 0, "the application's row was committed without its job"


# -- psycopg's AsyncConnection ---------------------------------------------------------------


@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_a_psycopg_connection_commits_at_the_block_s_end_and_refuses_a_commit_inside(
    broker, task, pg_url, conn, app_name, orders, ending
):
    async def main():
        async with await psycopg.AsyncConnection.connect(pg_url, application_name=app_name) as app:
            async with broker.transaction(app):
                await app.execute(f"INSERT INTO {orders} VALUES (1)")
                message = task.send(1)
            assert committed(broker, message)
            with pytest.raises(psycopg.ProgrammingError):
                async with broker.transaction(app):
                    await app.execute(f"INSERT INTO {orders} VALUES (2)")
                    refused = task.send(2)
                    await (app.commit() if ending == "commit" else app.rollback())
            # Inside the application's own transaction the block is a savepoint.
            async with app.transaction():
                async with broker.transaction(app):
                    inner = task.send(3)
                assert not committed(broker, inner)
            assert idle_in_transaction(conn, app_name) == []
            return message, refused, inner

    message, refused, inner = asyncio.run(main())
    assert committed(broker, message) and committed(broker, inner)
    assert not committed(broker, refused)
    assert count(conn, orders) == 1


# -- SQLAlchemy's synchronous Session and Connection ----------------------------------------


@contextlib.contextmanager
def sync_app(pg_url, app_name, kind):
    engine = sa.create_engine(
        sa_url(pg_url), connect_args={"application_name": app_name}, pool_size=1
    )
    try:
        if kind == "session":
            with Session(engine) as session:
                yield session
        else:
            with engine.connect() as connection:
                yield connection
    finally:
        engine.dispose()


SYNC_KINDS = ["session", "connection"]


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_a_synchronous_commit_inside_the_block_refuses_later_sends(
    broker, task, pg_url, conn, app_name, orders, kind
):
    with sync_app(pg_url, app_name, kind) as app:
        with broker.transaction(app):
            app.execute(sa.text(f"INSERT INTO {orders} VALUES (1)"))
            first = task.send(1)
            assert not committed(broker, first)
            app.commit()
            assert committed(broker, first)
            with pytest.raises(TransactionError, match="was committed inside the block"):
                task.send(2)
            with pytest.raises(TransactionError, match="was committed"), broker.batch():
                task.send(3)
            assert idle_in_transaction(conn, app_name) == []
        with broker.transaction(app):
            second = task.send(4)
        assert not committed(broker, second)
        app.commit()
        assert idle_in_transaction(conn, app_name) == []
    assert committed(broker, second)
    assert count(conn, orders) == 1


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_a_synchronous_rollback_inside_the_block_refuses_later_sends(
    broker, task, pg_url, conn, app_name, orders, kind
):
    with sync_app(pg_url, app_name, kind) as app:
        with broker.transaction(app):
            first = task.send(1)
            app.rollback()
            with pytest.raises(TransactionError, match="was rolled back"):
                task.send(2)
            assert idle_in_transaction(conn, app_name) == []
    assert not committed(broker, first)


def test_synchronous_begin_and_savepoints_around_and_inside_the_block(
    broker, task, pg_url, conn, app_name, orders
):
    with sync_app(pg_url, app_name, "session") as session:
        with session.begin(), broker.transaction(session):
            kept = task.send(1)
            savepoint = session.begin_nested()
            dropped = task.send(2)
            savepoint.rollback()
            after = task.send(3)
        assert idle_in_transaction(conn, app_name) == []
    assert committed(broker, kept) and committed(broker, after)
    assert not committed(broker, dropped)
