"""``async with broker.transaction(conn)`` and ``send_async``: asyncio applications send
without blocking the event loop, and their jobs commit or roll back with their own
transaction (psycopg's ``AsyncConnection``, SQLAlchemy's ``AsyncSession`` and
``AsyncConnection``).

A real worker running such jobs is in ``tests/e2e/test_async_e2e.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from dramatiq_pg_broker import (
    JobAlreadyFinished,
    TransactionError,
    send_async,
    send_with_options_async,
)
from tests.rows import event_types, status_of

#: The event loop's worst tolerated delay beside the sends, and at the 90th percentile
#: (milliseconds). On a loaded two-core machine a loop that never blocks still sees ticks
#: late by up to 55 ms at worst and 8 ms at the 90th percentile (the operating system's
#: scheduling, the sends' own Python on the loop's thread); a loop blocked by the sends
#: ticks about ten times a second and is late by hundreds of milliseconds at the 90th
#: percentile (measured with sends through synchronous connections in coroutines).
WORST_TICK_MS = 100
P90_TICK_MS = 20


@pytest.fixture
def orders(app_table):
    """The application's own table, next to the broker's: its INSERT statement."""
    return app_table("orders")


def sqlalchemy_url(pg_url: str) -> str:
    return "postgresql+psycopg://" + pg_url.split("://", 1)[1]


@contextlib.asynccontextmanager
async def app_connection(pg_url, kind):
    """What an asyncio application holds, and how it makes its transaction: yields
    ``(conn, execute, transaction)`` where ``transaction()`` is the application's own
    transaction around the block (for psycopg, the broker's block makes it)."""
    if kind == "psycopg":
        async with await psycopg.AsyncConnection.connect(pg_url) as aconn:
            yield aconn, aconn.execute, contextlib.nullcontext
        return
    engine = create_async_engine(sqlalchemy_url(pg_url))
    try:
        if kind == "asyncsession":
            async with AsyncSession(engine) as session:

                async def execute(statement, params=None):
                    raw = await session.connection()
                    return await raw.exec_driver_sql(statement.as_string(None), params)

                yield session, execute, session.begin
        else:
            async with engine.connect() as sa_conn:

                async def execute(statement, params=None):
                    return await sa_conn.exec_driver_sql(statement.as_string(None), params)

                yield sa_conn, execute, sa_conn.begin
    finally:
        await engine.dispose()


KINDS = ["psycopg", "asyncsession", "asyncconnection"]


def count_orders(conn, schema) -> int:
    table = sql.Identifier(schema, "orders")
    return conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0]


@pytest.fixture(params=KINDS)
def in_block(request, pg_url, broker):
    """``in_block(body)``: run ``await body(app, execute)`` in the application's own
    transaction with the broker's block around it, on what the application holds (see
    :func:`app_connection`: the test runs once with each kind); return what it returns."""

    async def main(body):
        async with app_connection(pg_url, request.param) as (app, execute, transaction):
            async with transaction(), broker.transaction(app):
                return await body(app, execute)

    return lambda body: asyncio.run(main(body))


def savepoint(app):
    """The application's savepoint on ``app``."""
    if isinstance(app, psycopg.AsyncConnection):
        return app.transaction()
    return app.begin_nested()


def test_a_rolled_back_block_leaves_no_job_and_no_event(
    broker, task, conn, schema, orders, in_block
):
    sent = []

    async def body(app, execute):
        await execute(orders, (1,))
        sent.append(task.send(1))
        await broker.write_pending_sends()  # written, then rolled back
        raise RuntimeError("the application changed its mind")

    with pytest.raises(RuntimeError, match="changed its mind"):
        in_block(body)
    [message] = sent
    assert status_of(broker.store, message.message_id) is None
    assert event_types(broker.store, message.message_id) == []
    assert count_orders(conn, schema) == 0


def test_a_committed_block_leaves_one_job_invisible_until_the_commit(
    broker, task, conn, schema, orders, in_block
):
    async def body(app, execute):
        await execute(orders, (2,))
        message = task.send(2)
        # Collected, not written: no I/O inside the synchronous send.
        assert status_of(broker.store, message.message_id) is None
        await broker.write_pending_sends()
        # Written on the application's connection: still invisible to others.
        assert status_of(broker.store, message.message_id) is None, (
            "the job was visible to another connection before the commit"
        )
        return message

    message = in_block(body)
    assert status_of(broker.store, message.message_id) == "queued"
    assert event_types(broker.store, message.message_id) == ["created"]
    assert count_orders(conn, schema) == 1


def test_a_savepoint_rolled_back_drops_only_its_own_sends(broker, task, in_block):
    async def body(app, execute):
        kept = task.send(1)
        with pytest.raises(RuntimeError):
            # The application's savepoint, with its own block inside: the block's sends
            # are written in the savepoint, and go with its rollback.
            async with savepoint(app), broker.transaction(app):
                dropped = task.send(2)
                await broker.write_pending_sends()  # written in the savepoint
                raise RuntimeError("this part is undone")
        also_kept = task.send(3)
        return kept, dropped, also_kept

    kept, dropped, also_kept = in_block(body)
    assert status_of(broker.store, kept.message_id) == "queued"
    assert status_of(broker.store, also_kept.message_id) == "queued"
    assert status_of(broker.store, dropped.message_id) is None
    assert event_types(broker.store, dropped.message_id) == []


def test_an_open_psycopg_transaction_is_joined_and_decides(broker, task, pg_url, orders):
    async def main():
        async with await psycopg.AsyncConnection.connect(pg_url) as app:
            await app.execute(orders, (3,))  # the application's transaction is open
            async with broker.transaction(app):
                message = task.send(3)
            assert status_of(broker.store, message.message_id) is None
            await app.rollback()
            return message

    message = asyncio.run(main())
    assert status_of(broker.store, message.message_id) is None


def test_a_psycopg_block_on_an_idle_connection_begins_and_commits(broker, task, pg_url):
    async def main():
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as app:
            async with broker.transaction(app) as written_on:
                assert written_on is app
                message = task.send(4)
            return message

    message = asyncio.run(main())
    assert status_of(broker.store, message.message_id) == "queued"


def test_write_pending_sends_tells_an_idempotency_key_s_existing_job(broker, task, pg_url):
    async def main():
        first = await send_with_options_async(task, args=(1,), idempotency_key="order-1")
        async with await psycopg.AsyncConnection.connect(pg_url) as app:
            async with broker.transaction(app):
                again = task.send_with_options(args=(1,), idempotency_key="order-1")
                # At the send, only the block knows about it: its own message comes back.
                assert again.message_id != first.message_id
                (stored,) = await broker.write_pending_sends()
                assert await broker.write_pending_sends() == []
        return first, again, stored

    first, again, stored = asyncio.run(main())
    assert stored.message_id == first.message_id
    assert status_of(broker.store, again.message_id) is None


def test_a_refused_write_raises_at_the_end_of_the_block_and_rolls_it_back(
    broker, task, pg_url, orders, conn, schema
):
    finished = task.send(5)
    broker.store.cancel(finished.message_id)

    async def main():
        async with await psycopg.AsyncConnection.connect(pg_url) as app:
            with pytest.raises(JobAlreadyFinished):
                async with broker.transaction(app):
                    await app.execute(orders, (5,))
                    broker.enqueue(finished.copy())  # the id of a finished job
                    ok = task.send(6)
            return ok

    ok = asyncio.run(main())
    assert status_of(broker.store, ok.message_id) is None
    assert count_orders(conn, schema) == 0


def test_batches_and_nested_blocks_inside_an_async_block(broker, task, pg_url):
    async def main():
        async with await psycopg.AsyncConnection.connect(pg_url) as app:
            async with broker.transaction(app):
                with broker.batch():
                    batched = [task.send(n) for n in range(3)]
                async with broker.transaction(app):
                    nested = task.send(9)
                # Many messages: the store's bulk (COPY) path, on the async connection.
                many = broker.enqueue_many([task.message(n) for n in range(250)])
        return batched + [nested] + many

    sent = asyncio.run(main())
    assert {status_of(broker.store, m.message_id) for m in sent} == {"queued"}


def test_a_task_that_outlives_its_block_cannot_send_into_it(broker, task, pg_url):
    async def main():
        release = asyncio.Event()

        async def late():
            await release.wait()
            return task.send(1)

        async with await psycopg.AsyncConnection.connect(pg_url) as app:
            async with broker.transaction(app):
                pending = asyncio.create_task(late())
            release.set()
            with pytest.raises(TransactionError, match="has ended"):
                await pending

    asyncio.run(main())


def test_an_application_s_row_factory_and_json_loader_do_not_reach_the_store(broker, task, pg_url):
    async def main():
        first = await send_with_options_async(task, args=(2,), idempotency_key="order-2")
        async with await psycopg.AsyncConnection.connect(pg_url, row_factory=dict_row) as app:
            app.adapters.register_loader("jsonb", psycopg.types.string.TextLoader)
            async with broker.transaction(app):
                task.send_with_options(args=(2,), idempotency_key="order-2")
                (stored,) = await broker.write_pending_sends()
        return first, stored

    first, stored = asyncio.run(main())
    assert stored.message_id == first.message_id
    assert stored.args == (2,)


def test_the_wrong_kind_of_block_or_connection_is_a_clear_error(broker, task, pg_url):
    async def main():
        with psycopg.connect(pg_url) as sync_conn:
            with pytest.raises(TransactionError, match="`with broker.transaction"):
                async with broker.transaction(sync_conn):
                    pass
        async with await psycopg.AsyncConnection.connect(pg_url) as app:
            with pytest.raises(TransactionError, match="`async with broker.transaction"):
                with broker.transaction(app):
                    pass
        with pytest.raises(TransactionError, match="inside of an `async with"):
            await broker.write_pending_sends()
        with pytest.raises(TransactionError, match="takes a psycopg 3 AsyncConnection"):
            async with broker.transaction(object()):
                pass

    asyncio.run(main())


def test_a_connection_to_another_database_is_refused(broker, task, pg_url, conn):
    name = f"other_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        other = psycopg.conninfo.make_conninfo(pg_url, dbname=name)

        async def main():
            async with await psycopg.AsyncConnection.connect(other) as app:
                with pytest.raises(TransactionError, match="cannot span two databases"):
                    async with broker.transaction(app):
                        task.send(1)

        asyncio.run(main())
    finally:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def test_send_async_commits_at_once_through_the_pool(broker, task):
    async def main():
        return await asyncio.gather(*(send_async(task, n) for n in range(5)))

    sent = asyncio.run(main())
    assert {status_of(broker.store, m.message_id) for m in sent} == {"queued"}


def test_a_task_cancelled_while_its_sends_are_written_rolls_back_after_the_write(
    broker, task, pg_url
):
    async def main():
        async with await psycopg.AsyncConnection.connect(pg_url) as app:
            written = asyncio.Event()

            async def body():
                async with broker.transaction(app):
                    sent = [task.send(n) for n in range(300)]  # the COPY path, several steps
                    writing = asyncio.ensure_future(broker.write_pending_sends())
                    written.set()
                    await writing
                    return sent

            running = asyncio.create_task(body())
            await written.wait()
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            # Every thread's work is over once the executor has shut down: what a write
            # left running after the rollback would have done (commit the jobs), it did.
            await asyncio.get_running_loop().shutdown_default_executor()
            # The write ended before the rollback: the connection is idle and usable.
            assert app.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert (await (await app.execute("SELECT 1")).fetchone()) == (1,)
            return broker.store.count_unfinished(task.queue_name)

    assert asyncio.run(main()) == 0


# -- the event loop is never blocked -------------------------------------------------------


async def ticker_delays(work) -> tuple[list[float], float]:
    """Run ``work()`` beside a ticker that sleeps 1 ms at a time; returns how late each tick
    woke (milliseconds) and how long the work took (seconds)."""
    delays: list[float] = []
    done = False

    async def tick():
        while not done:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            delays.append((time.perf_counter() - start - 0.001) * 1000)

    ticking = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    await work()
    took = time.perf_counter() - started
    done = True
    await ticking
    return delays, took


def assert_never_late(delays: list[float], took: float, what: str) -> None:
    ordered = sorted(delays)
    worst, p90 = ordered[-1], ordered[int(len(ordered) * 0.9)]
    summary = (
        f"{what}: {len(delays)} ticks over {took:.2f}s, worst {worst:.1f} ms, "
        f"90th percentile {p90:.1f} ms"
    )
    assert len(delays) >= took * 100, f"the ticker hardly ran: {summary}"
    assert worst <= WORST_TICK_MS, f"the event loop was blocked: {summary}"
    assert p90 <= P90_TICK_MS, f"the event loop was often late: {summary}"


# The loop's lateness is timed to the millisecond: not beside other tests' load (make test
# runs it last, alone).
@pytest.mark.alone
@pytest.mark.loop_timing
def test_a_ticker_beside_1000_send_async_is_never_late(broker, task):
    async def work():
        async def client(k):
            for n in range(50):
                await send_async(task, k, n)

        await asyncio.gather(*(client(k) for k in range(20)))

    async def main():
        await send_async(task, -1)  # the pool is open and the schema checked
        return await ticker_delays(work)

    delays, took = asyncio.run(main())
    assert_never_late(delays, took, "1,000 send_async from 20 tasks")
    assert broker.store.count_unfinished(task.queue_name) == 1001


# The loop's lateness is timed to the millisecond: not beside other tests' load (make test
# runs it last, alone).
@pytest.mark.alone
@pytest.mark.loop_timing
def test_a_ticker_beside_1000_sends_in_async_transactions_is_never_late(broker, task, pg_url):
    async def work():
        async def client(app):
            for _ in range(10):
                async with broker.transaction(app):
                    for n in range(10):
                        task.send(n)
                    await asyncio.sleep(0)

        apps = [await psycopg.AsyncConnection.connect(pg_url) for _ in range(10)]
        try:
            await asyncio.gather(*(client(app) for app in apps))
        finally:
            for app in apps:
                await app.close()

    async def main():
        await send_async(task, -1)
        return await ticker_delays(work)

    delays, took = asyncio.run(main())
    assert_never_late(delays, took, "1,000 sends in 100 async transaction blocks")
    assert broker.store.count_unfinished(task.queue_name) == 1001


def test_the_bounds_fail_a_loop_blocked_by_synchronous_transactions(broker, task, pg_url):
    """The control of the bounds: the same 100 transaction blocks through synchronous
    connections, each commit blocking the loop, fail ``assert_never_late``."""

    async def work():
        async def client(app):
            for _ in range(10):
                with broker.transaction(app):
                    for n in range(10):
                        task.send(n)
                await asyncio.sleep(0)

        apps = [psycopg.connect(pg_url) for _ in range(10)]
        try:
            await asyncio.gather(*(client(app) for app in apps))
        finally:
            for app in apps:
                app.close()

    delays, took = asyncio.run(ticker_delays(work))
    with pytest.raises(AssertionError):
        assert_never_late(delays, took, "1,000 blocking sends in 100 transaction blocks")
    assert broker.store.count_unfinished(task.queue_name) == 1000


def test_the_ticker_sees_a_loop_blocked_by_synchronous_sends(broker, task):
    """The control: the same ticker beside synchronous sends made in a coroutine."""

    async def work():
        for n in range(200):
            task.send(n)  # a database round trip each, on the loop's thread

    async def main():
        await send_async(task, -1)
        return await ticker_delays(work)

    delays, took = asyncio.run(main())
    assert max(delays) >= took * 1000 * 0.5, (
        f"200 blocking sends took {took:.2f}s but the ticker was at worst "
        f"{max(delays):.1f} ms late: it cannot see a blocked loop"
    )
