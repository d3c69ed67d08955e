"""``current_job().complete_in(conn)``: the job's success commits in the actor's own
transaction, on every kind of connection, with in-process workers and real PostgreSQL.

The broker's tables are in the module's schema while the application's connections keep
the default search_path: the block must address the broker's tables by its schema.
"""

from __future__ import annotations

import threading
import time

import dramatiq
import psycopg
import pytest
import sqlalchemy as sa
from dramatiq.middleware import AsyncIO
from dramatiq.results import Results
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from dramatiq_pg_broker import LostOwnership, TransactionError, current_job
from dramatiq_pg_broker.results import PostgresBackend

from ..helpers import wait_for
from .harness import of_type


def sa_url(pg_url: str, driver: str = "psycopg") -> str:
    return f"postgresql+{driver}://" + pg_url.split("://", 1)[1]


class Effects:
    """The application's table (job_id, attempt), in the module's schema: ``insert`` for
    psycopg (two parameters), ``text`` for SQLAlchemy (``:a``, ``:b``); calling it returns
    its rows."""

    def __init__(self, conn, schema: str) -> None:
        self.conn = conn
        self.table = sql.Identifier(schema, "cin_effects")
        self.insert = sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(self.table).as_string(conn)
        self.text = sa.text(self.insert.replace("%s", ":a", 1).replace("%s", ":b", 1))

    def __call__(self) -> list[tuple]:
        return self.conn.execute(
            sql.SQL("SELECT job_id::text, attempt FROM {} ORDER BY attempt").format(self.table)
        ).fetchall()


def empty_effects(conn, schema: str) -> Effects:
    """The application's table, created if need be and emptied (see :class:`Effects`)."""
    found = Effects(conn, schema)
    conn.execute(
        sql.SQL("CREATE TABLE IF NOT EXISTS {} (job_id uuid, attempt int)").format(found.table)
    )
    conn.execute(sql.SQL("TRUNCATE {}").format(found.table))
    return found


@pytest.fixture
def effects(conn, schema):
    """The application's table, emptied (see :class:`Effects`)."""
    return empty_effects(conn, schema)


def job_row(conn, schema: str, job_id: str) -> tuple:
    """(status, attempts, locked_by) of a job, wherever it is."""
    return conn.execute(
        f'SELECT status, attempts, locked_by FROM "{schema}".all_jobs WHERE id = %s', (job_id,)
    ).fetchone()


def wait_status(store, conn, schema, job_id: str, status: str, timeout: float = 20) -> tuple:
    return wait_for(
        lambda: (row := job_row(conn, schema, job_id)) and row[0] == status and row,
        timeout,
        f"job {job_id} to be {status}",
        on_timeout=lambda: f"row: {job_row(conn, schema, job_id)}",
    )


def succeeded_once(store, job_id: str) -> list[dict]:
    events = store.events_of(job_id)
    succeeded = of_type(events, "succeeded")
    assert len(succeeded) == 1, [e["type"] for e in events]
    return succeeded


# -- beginning a transaction, joining one: each kind of connection --------------------------


def _sync_psycopg(pg_url, insert, joined):
    with psycopg.connect(pg_url) as conn:
        job = current_job()
        if joined:
            with conn.transaction():
                conn.execute(insert, (job.id, 0))  # before the block, same transaction
                with job.complete_in(conn):
                    conn.execute(insert, (job.id, job.attempt))
        else:
            with job.complete_in(conn):
                conn.execute(insert, (job.id, job.attempt))


def _sa_session(engine, statement, joined):
    job = current_job()
    with Session(engine) as session:
        if joined:
            with session.begin():
                session.execute(statement, {"a": job.id, "b": 0})
                with job.complete_in(session):
                    session.execute(statement, {"a": job.id, "b": job.attempt})
        else:
            with job.complete_in(session):
                session.execute(statement, {"a": job.id, "b": job.attempt})


def _sa_connection(engine, statement, joined):
    job = current_job()
    with engine.connect() as connection:
        if joined:
            with connection.begin():
                connection.execute(statement, {"a": job.id, "b": 0})
                with job.complete_in(connection):
                    connection.execute(statement, {"a": job.id, "b": job.attempt})
        else:
            with job.complete_in(connection):
                connection.execute(statement, {"a": job.id, "b": job.attempt})


SYNC_KINDS = {
    "psycopg": lambda ctx, joined: _sync_psycopg(ctx["url"], ctx["insert"], joined),
    "sa-session": lambda ctx, joined: _sa_session(ctx["engine"], ctx["text"], joined),
    "sa-connection": lambda ctx, joined: _sa_connection(ctx["engine"], ctx["text"], joined),
}


@pytest.mark.parametrize("joined", [False, True], ids=["begins", "joins"])
@pytest.mark.parametrize("kind", sorted(SYNC_KINDS))
def test_a_synchronous_block_commits_the_success_with_the_actor_s_writes(
    h, conn, schema, store, effects, pg_url, kind, joined
):
    engine = sa.create_engine(sa_url(pg_url))
    ctx = {"url": pg_url, "insert": effects.insert, "text": effects.text, "engine": engine}
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"sync_{h.queue}")
    def work():
        SYNC_KINDS[kind](ctx, joined)

    message = work.send()
    h.start(broker)
    try:
        row = wait_status(store, conn, schema, message.message_id, "succeeded")
    finally:
        engine.dispose()
    assert row[1] == 1
    expected = (
        [(message.message_id, 0), (message.message_id, 1)] if joined else [(message.message_id, 1)]
    )
    assert effects() == expected
    [event] = succeeded_once(store, message.message_id)
    assert event["data"] == {"in_transaction": True}, "the success must be the block's"


async def _async_psycopg(url, insert, joined):
    job = current_job()
    async with await psycopg.AsyncConnection.connect(url) as conn:
        if joined:
            async with conn.transaction():
                await conn.execute(insert, (job.id, 0))
                async with job.complete_in(conn):
                    await conn.execute(insert, (job.id, job.attempt))
        else:
            async with job.complete_in(conn):
                await conn.execute(insert, (job.id, job.attempt))


async def _async_sa(engine, statement, joined, session_kind):
    job = current_job()
    if session_kind == "session":
        async with AsyncSession(engine) as session:
            if joined:
                async with session.begin():
                    await session.execute(statement, {"a": job.id, "b": 0})
                    async with job.complete_in(session):
                        await session.execute(statement, {"a": job.id, "b": job.attempt})
            else:
                async with job.complete_in(session):
                    await session.execute(statement, {"a": job.id, "b": job.attempt})
        return
    async with engine.connect() as connection:
        if joined:
            async with connection.begin():
                await connection.execute(statement, {"a": job.id, "b": 0})
                async with job.complete_in(connection):
                    await connection.execute(statement, {"a": job.id, "b": job.attempt})
        else:
            async with job.complete_in(connection):
                await connection.execute(statement, {"a": job.id, "b": job.attempt})


@pytest.mark.parametrize("joined", [False, True], ids=["begins", "joins"])
@pytest.mark.parametrize("kind", ["psycopg", "sa-session", "sa-connection"])
def test_an_async_block_commits_the_success_with_the_actor_s_writes(
    h, conn, schema, store, effects, pg_url, kind, joined
):
    broker = h.broker()
    broker.add_middleware(AsyncIO())
    insert = effects.insert

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"async_{h.queue}")
    async def work():
        if kind == "psycopg":
            await _async_psycopg(pg_url, insert, joined)
            return
        engine = create_async_engine(sa_url(pg_url))
        try:
            await _async_sa(engine, effects.text, joined, kind.removeprefix("sa-"))
        finally:
            await engine.dispose()

    message = work.send()
    h.start(broker)
    row = wait_status(store, conn, schema, message.message_id, "succeeded")
    assert row[1] == 1
    expected = (
        [(message.message_id, 0), (message.message_id, 1)] if joined else [(message.message_id, 1)]
    )
    assert effects() == expected
    [event] = succeeded_once(store, message.message_id)
    assert event["data"] == {"in_transaction": True}


# -- ownership lost before the commit -------------------------------------------------------


def test_a_lease_taken_by_another_worker_raises_lost_ownership_and_rolls_back(
    h, conn, schema, store, effects, pg_url
):
    broker = h.broker()
    seen: list[BaseException] = []
    stolen = threading.Event()

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, actor_name=f"stolen_{h.queue}", max_retries=0
    )
    def work():
        job = current_job()
        with psycopg.connect(pg_url) as app:
            try:
                with job.complete_in(app):
                    app.execute(effects.insert, (job.id, job.attempt))
                    # Another worker takes the job: its lease expired, the reaper requeued
                    # it and another worker claimed it (attempt 2).
                    conn.execute(
                        f'UPDATE "{schema}".jobs SET locked_by = %s, attempts = attempts + 1, '
                        "max_attempts = max_attempts + 1 WHERE id = %s",
                        ("another-worker", job.id),
                    )
                    stolen.set()
            except LostOwnership as e:
                seen.append(e)
                raise

    message = work.send()
    h.start(broker)
    wait_for(lambda: seen, 20, "the block to raise LostOwnership")
    # Nothing of this attempt's was written: the row is the other worker's.
    assert job_row(conn, schema, message.message_id) == ("running", 2, "another-worker")
    assert isinstance(seen[0], LostOwnership)
    assert effects() == [], "the actor's writes must roll back with the block"
    assert not of_type(store.events_of(message.message_id), "succeeded")


def test_an_abort_requested_before_the_commit_raises_lost_ownership(
    h, conn, schema, store, effects, pg_url
):
    broker = h.broker()
    seen: list[BaseException] = []

    @dramatiq.actor(
        broker=broker,
        queue_name=h.queue,
        actor_name=f"aborted_{h.queue}",
        interrupt_on_abort=False,
        max_retries=0,
    )
    def work():
        job = current_job()
        with psycopg.connect(pg_url) as app:
            try:
                with job.complete_in(app):
                    app.execute(effects.insert, (job.id, job.attempt))
                    store.abort(job.id, by="operator")
            except LostOwnership as e:
                seen.append(e)
                raise

    message = work.send()
    h.start(broker)
    wait_status(store, conn, schema, message.message_id, "cancelled")
    assert len(seen) == 1
    assert effects() == []
    types = [e["type"] for e in store.events_of(message.message_id)]
    assert "succeeded" not in types and types[-1] == "aborted", types


# -- rollback: the usual outcome path -------------------------------------------------------


def test_a_block_that_raises_rolls_back_and_the_job_is_retried_on_the_same_row(
    h, conn, schema, store, effects, pg_url
):
    broker = h.broker()

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, actor_name=f"retried_{h.queue}", min_backoff=10
    )
    def work():
        job = current_job()
        with psycopg.connect(pg_url) as app, job.complete_in(app):
            app.execute(effects.insert, (job.id, job.attempt))
            if job.attempt == 1:
                raise RuntimeError("first attempt fails")

    message = work.send()
    h.start(broker)
    row = wait_status(store, conn, schema, message.message_id, "succeeded")
    assert row[1] == 2, "the same row, second attempt"
    assert effects() == [(message.message_id, 2)]
    types = [e["type"] for e in store.events_of(message.message_id)]
    assert types.count("retry_scheduled") == 1 and types.count("succeeded") == 1, types
    assert conn.execute(
        f'SELECT count(*) FROM "{schema}".all_jobs WHERE id = %s', (message.message_id,)
    ).fetchone() == (1,)


def test_an_application_rollback_after_a_joined_block_leaves_the_usual_outcome(
    h, conn, schema, store, effects, pg_url
):
    broker = h.broker()

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, actor_name=f"undone_{h.queue}", min_backoff=10
    )
    def work():
        job = current_job()
        with psycopg.connect(pg_url) as app, app.transaction():
            with job.complete_in(app):
                app.execute(effects.insert, (job.id, job.attempt))
            if job.attempt == 1:
                raise RuntimeError("the application's transaction fails after the block")

    message = work.send()
    h.start(broker)
    row = wait_status(store, conn, schema, message.message_id, "succeeded")
    assert row[1] == 2
    assert effects() == [(message.message_id, 2)]
    types = [e["type"] for e in store.events_of(message.message_id)]
    assert types.count("retry_scheduled") == 1 and types.count("succeeded") == 1, types


def test_what_the_actor_raises_after_a_committed_block_does_not_unsucceed_the_job(
    h, conn, schema, store, effects, pg_url, caplog
):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"after_{h.queue}")
    def work():
        job = current_job()
        with psycopg.connect(pg_url) as app:
            with job.complete_in(app):
                app.execute(effects.insert, (job.id, job.attempt))
            raise RuntimeError("after the block")

    message = work.send()
    h.start(broker)
    row = wait_status(store, conn, schema, message.message_id, "succeeded")
    assert row[1] == 1
    assert effects() == [(message.message_id, 1)]
    types = [e["type"] for e in store.events_of(message.message_id)]
    assert types == ["created", "claimed", "succeeded"], types
    assert "Lost job" not in caplog.text


# -- the results backend, the heartbeat ------------------------------------------------------


def test_the_results_backend_stores_the_return_value(h, conn, schema, store, effects, pg_url):
    broker = h.broker()
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend))

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, actor_name=f"result_{h.queue}", store_results=True
    )
    def work(n):
        job = current_job()
        with psycopg.connect(pg_url) as app, job.complete_in(app):
            app.execute(effects.insert, (job.id, job.attempt))
        return n * 2

    message = work.send(21)
    h.start(broker)
    try:
        assert backend.get_result(message, block=True, timeout=20_000) == 42
        wait_status(store, conn, schema, message.message_id, "succeeded")
    finally:
        backend.close()
    assert effects() == [(message.message_id, 1)]


def test_an_open_application_transaction_does_not_stall_the_heartbeat(
    h, conn, schema, store, effects, pg_url, caplog
):
    """A joined block's transaction holds the job row's lock until the application
    commits: here for more than two leases, while another job of the same process needs
    its lease renewed all along (the heartbeat renews both in one statement, and would wait
    for the lock)."""
    broker = h.broker(lease_seconds=1)
    joined = threading.Event()
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"holder_{h.queue}")
    def holder():
        job = current_job()
        with psycopg.connect(pg_url) as app, app.transaction():
            with job.complete_in(app):
                app.execute(effects.insert, (job.id, job.attempt))
            joined.set()
            release.wait(20)  # the row stays locked by this transaction meanwhile

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"sleeper_{h.queue}")
    def sleeper():
        release.wait(20)

    other = sleeper.send()
    held = holder.send()
    h.start(broker, threads=2)
    wait_for(joined.is_set, 20, "the holder's block to end inside its transaction")
    # For 2.5 leases, the other job's lease never runs out.
    expired = []
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        left = conn.execute(
            f'SELECT extract(epoch FROM locked_until - now()) FROM "{schema}".jobs WHERE id = %s',
            (other.message_id,),
        ).fetchone()[0]
        if left <= 0:
            expired.append(left)
        time.sleep(0.1)
    release.set()
    wait_status(store, conn, schema, held.message_id, "succeeded")
    row = wait_status(store, conn, schema, other.message_id, "succeeded")
    assert not expired, f"the other job's lease ran out while the heartbeat waited: {expired}"
    assert row[1] == 1
    assert effects() == [(held.message_id, 1)]
    succeeded_once(store, held.message_id)
    assert "Lost job" not in caplog.text, caplog.text


def test_a_connection_to_another_database_is_refused(h, conn, schema, store, pg_url):
    broker = h.broker()
    seen: list[BaseException] = []
    database = conninfo_to_dict(pg_url)["dbname"]
    url = make_conninfo(pg_url, dbname="template1" if database == "postgres" else "postgres")

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, actor_name=f"elsewhere_{h.queue}", max_retries=0
    )
    def work():
        with psycopg.connect(url) as app:
            try:
                with current_job().complete_in(app):
                    pass
            except Exception as e:
                seen.append(e)
                raise

    message = work.send()
    h.start(broker)
    wait_status(store, conn, schema, message.message_id, "failed")
    assert isinstance(seen[0], TransactionError), seen
    assert "a transaction cannot span two databases" in str(seen[0])


def test_an_actor_that_returns_with_the_transaction_open_leaves_the_job_to_it(
    h, conn, schema, store, effects, pg_url, caplog
):
    """The worker cannot wait for a transaction the actor left open: it says so, writes no
    outcome and stops renewing; the application's commit then succeeds the job."""
    broker = h.broker()
    app = psycopg.connect(pg_url)  # not in autocommit mode: its first statement begins

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"open_{h.queue}")
    def work():
        job = current_job()
        app.execute("SELECT 1")  # the application's transaction is open
        with job.complete_in(app):  # a savepoint in it
            app.execute(effects.insert, (job.id, job.attempt))

    message = work.send()
    h.start(broker)
    try:
        wait_for(
            lambda: "is still open after its actor returned" in caplog.text,
            20,
            "the worker to notice the open transaction",
        )
        assert job_row(conn, schema, message.message_id)[0] == "running"
        assert effects() == [], "nothing is committed yet"
        app.commit()
    finally:
        app.close()
    row = wait_status(store, conn, schema, message.message_id, "succeeded", timeout=5)
    assert row[1] == 1
    assert effects() == [(message.message_id, 1)]
    succeeded_once(store, message.message_id)


def test_a_commit_that_fails_leaves_the_usual_outcome(h, conn, schema, store, pg_url):
    """The block's own COMMIT fails (a deferred constraint): nothing was committed, and the
    exception retries the job as any other."""
    table = sql.Identifier(schema, "cin_deferred")
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (k int UNIQUE DEFERRABLE INITIALLY DEFERRED)"
        ).format(table)
    )
    conn.execute(sql.SQL("TRUNCATE {}").format(table))
    conn.execute(sql.SQL("INSERT INTO {} VALUES (1)").format(table))
    insert = sql.SQL("INSERT INTO {} VALUES (%s)").format(table)
    broker = h.broker()
    raised: list[BaseException] = []

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, actor_name=f"deferred_{h.queue}", min_backoff=10
    )
    def work():
        job = current_job()
        with psycopg.connect(pg_url) as app:
            try:
                with job.complete_in(app):
                    app.execute(insert, (job.attempt,))  # 1 collides at COMMIT
            except psycopg.errors.UniqueViolation as e:
                raised.append(e)
                raise

    message = work.send()
    h.start(broker)
    row = wait_status(store, conn, schema, message.message_id, "succeeded")
    assert len(raised) == 1 and row[1] == 2
    rows = conn.execute(sql.SQL("SELECT k FROM {} ORDER BY k").format(table)).fetchall()
    assert rows == [(1,), (2,)]
    types = [e["type"] for e in store.events_of(message.message_id)]
    assert types.count("retry_scheduled") == 1 and types.count("succeeded") == 1, types


def test_a_savepoint_rolled_back_around_the_block_leaves_the_usual_outcome(
    h, conn, schema, store, effects, pg_url
):
    """The application rolls back a savepoint the block ran in and commits the rest: its
    transaction committed, but without the job's success, which the worker then writes as
    usual."""
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"savepoint_{h.queue}")
    def work():
        job = current_job()
        with psycopg.connect(pg_url) as app, app.transaction():
            app.execute(effects.insert, (job.id, 0))
            try:
                with app.transaction():
                    with job.complete_in(app):
                        app.execute(effects.insert, (job.id, job.attempt))
                    raise LookupError("undo the savepoint")
            except LookupError:
                pass

    message = work.send()
    h.start(broker)
    row = wait_status(store, conn, schema, message.message_id, "succeeded")
    assert row[1] == 1
    assert effects() == [(message.message_id, 0)]
    [event] = succeeded_once(store, message.message_id)
    assert not (event["data"] or {}).get("in_transaction"), "the worker's own success"
