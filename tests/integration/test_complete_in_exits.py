"""Every way a ``complete_in()`` block ends tells the worker what it left: nothing written
(the body or the commit raised), the success committed, or the success written in a
transaction that goes on. The attempt then goes on as any other: its lease renewed, a
block tried again in the same attempt written, no second worker running the job meanwhile.
And ``renew()`` and ``progress()`` inside a block whose transaction holds the job's row
answer at once. In-process workers, real PostgreSQL.
"""

from __future__ import annotations

import threading
import time

import dramatiq
import psycopg
import pytest
import sqlalchemy as sa
from dramatiq.middleware import AsyncIO
from psycopg import IsolationLevel, sql
from sqlalchemy.orm import Session

from dramatiq_pg_broker import current_job
from dramatiq_pg_broker.errors import JobBusy

from ..helpers import wait_for
from .harness import of_type
from .test_complete_in import empty_effects, sa_url, succeeded_once, wait_status

#: The application name of the actors' connections: a test that fails by hanging ends
#: them (:func:`end_app_sessions`), so that no worker thread stays stuck after it.
APP = "complete-in-exits"

STRICT = ["repeatable read", "serializable"]


@pytest.fixture
def effects(conn, schema):
    return empty_effects(conn, schema)


@pytest.fixture
def app_sessions(conn):
    """Ends the actors' connections after the test (see :data:`APP`)."""
    yield
    end_app_sessions(conn)


def end_app_sessions(conn) -> None:
    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE application_name = %s AND datname = current_database()",
        (APP,),
    )


def level_of(name: str) -> IsolationLevel:
    return IsolationLevel[name.upper().replace(" ", "_")]


@pytest.fixture
def counter(conn, schema):
    """A one-row table of the application's (n), set to 0: a REPEATABLE READ or
    SERIALIZABLE transaction that read it fails to update it once another transaction
    changed it since (a serialization failure, raised by PostgreSQL itself)."""
    table = sql.Identifier(schema, "cin_counter")
    conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (n int)").format(table))
    conn.execute(sql.SQL("TRUNCATE {}").format(table))
    conn.execute(sql.SQL("INSERT INTO {} VALUES (0)").format(table))
    return table


# -- a block tried again inside one attempt ----------------------------------------------------


@pytest.mark.parametrize("kind", ["psycopg", "sa-session"])
@pytest.mark.parametrize("level", STRICT)
def test_a_block_that_met_a_serialization_failure_is_tried_again_in_the_same_attempt(
    h, conn, schema, store, effects, counter, pg_url, app_sessions, level, kind
):
    """The application's usual retry loop: the block's transaction fails with a real
    serialization failure (another transaction changed a row it read), the actor catches
    it and runs the block again, which commits: one effect, one attempt."""
    broker = h.broker()
    engine = sa.create_engine(sa_url(pg_url), connect_args={"application_name": APP})
    seen: list[str] = []
    read = sql.SQL("SELECT n FROM {}").format(counter).as_string(conn)
    bump = sql.SQL("UPDATE {} SET n = n + 1").format(counter).as_string(conn)

    def once(job, first: bool) -> None:
        if kind == "psycopg":
            with psycopg.connect(pg_url, application_name=APP) as app:
                app.isolation_level = level_of(level)
                with job.complete_in(app):
                    app.execute(read)
                    if first:
                        conn.execute(bump)  # another transaction, committed meanwhile
                    app.execute(bump)
                    app.execute(effects.insert, (job.id, job.attempt))
            return
        with Session(engine.execution_options(isolation_level=level.upper())) as session:
            with job.complete_in(session):
                session.execute(sa.text(read))
                if first:
                    conn.execute(bump)
                session.execute(sa.text(bump))
                session.execute(effects.text, {"a": job.id, "b": job.attempt})

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"again_{h.queue}", max_retries=0)
    def work():
        job = current_job()
        for round_ in range(3):
            try:
                once(job, first=round_ == 0)
            except (psycopg.errors.SerializationFailure, sa.exc.OperationalError) as e:
                seen.append(type(e).__name__)
                continue
            except BaseException as e:
                seen.append(repr(e))
                raise
            seen.append("committed")
            return

    message = work.send()
    h.start(broker)
    try:
        row = wait_status(store, conn, schema, message.message_id, "succeeded")
        # The job's success commits with the block, a moment before the actor says so.
        wait_for(lambda: seen and seen[-1] != "SerializationFailure", 10, "the actor's word")
    finally:
        engine.dispose()
    assert seen[-1] == "committed" and len(seen) == 2, seen
    assert row[1] == 1, f"one attempt, not {row[1]}"
    assert effects() == [(message.message_id, 1)]
    [event] = succeeded_once(store, message.message_id)
    assert event["data"] == {"in_transaction": True}


def test_a_block_whose_commit_failed_is_tried_again_in_the_same_attempt(
    h, conn, schema, store, pg_url, app_sessions
):
    """READ COMMITTED: the block's own COMMIT fails (a deferred unique constraint) after
    the success was written in it; the actor tries again with other data, in the same
    attempt, and that block commits."""
    table = sql.Identifier(schema, "cin_deferred_again")
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (k int UNIQUE DEFERRABLE INITIALLY DEFERRED)"
        ).format(table)
    )
    conn.execute(sql.SQL("TRUNCATE {}").format(table))
    conn.execute(sql.SQL("INSERT INTO {} VALUES (1)").format(table))
    insert = sql.SQL("INSERT INTO {} VALUES (%s)").format(table)
    broker = h.broker()
    seen: list[str] = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"dfr_{h.queue}", max_retries=0)
    def work():
        job = current_job()
        with psycopg.connect(pg_url, application_name=APP) as app:
            for k in (1, 2):  # 1 collides at COMMIT
                try:
                    with job.complete_in(app):
                        app.execute(insert, (k,))
                except psycopg.errors.UniqueViolation:
                    seen.append("collided")
                    continue
                except BaseException as e:
                    seen.append(repr(e))
                    raise
                seen.append("committed")
                return

    message = work.send()
    h.start(broker)
    row = wait_status(store, conn, schema, message.message_id, "succeeded")
    # The job's success commits with the block, a moment before the actor says so.
    wait_for(lambda: len(seen) >= 2, 10, "the actor's word after its block")
    assert seen == ["collided", "committed"], seen
    assert row[1] == 1
    rows = conn.execute(sql.SQL("SELECT k FROM {} ORDER BY k").format(table)).fetchall()
    assert rows == [(1,), (2,)]
    [event] = succeeded_once(store, message.message_id)
    assert event["data"] == {"in_transaction": True}


@pytest.mark.parametrize("level", STRICT)
def test_an_exception_right_after_the_pin_leaves_the_attempt_unmarked(
    h, conn, schema, store, effects, pg_url, app_sessions, monkeypatch, level
):
    """An exception raised in the actor's thread just as the block pinned the job's row
    (an abort, a time limit: raised at any instruction), before the block's first
    statement: the block ends without a success, and the block tried again writes it."""
    broker = h.broker()
    pin = broker.ledger.pin_completion
    interrupted: list[int] = []

    def pin_then_interrupted(*args, **kwargs):
        pinned = pin(*args, **kwargs)
        if not interrupted:
            interrupted.append(1)
            raise RuntimeError("raised in the thread right after the pin")
        return pinned

    monkeypatch.setattr(broker.ledger, "pin_completion", pin_then_interrupted)
    seen: list[str] = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"pin_{h.queue}", max_retries=0)
    def work():
        job = current_job()
        with psycopg.connect(pg_url, application_name=APP) as app:
            app.isolation_level = level_of(level)
            for _ in range(2):
                try:
                    with job.complete_in(app):
                        app.execute(effects.insert, (job.id, job.attempt))
                except RuntimeError:
                    seen.append("interrupted")
                    continue
                except BaseException as e:
                    seen.append(repr(e))
                    raise
                seen.append("committed")
                return

    message = work.send()
    h.start(broker)
    row = wait_status(store, conn, schema, message.message_id, "succeeded")
    # The job's success commits with the block, a moment before the actor says so.
    wait_for(lambda: len(seen) >= 2, 10, "the actor's word after its block")
    assert seen == ["interrupted", "committed"], seen
    assert row[1] == 1 and effects() == [(message.message_id, 1)]


@pytest.mark.parametrize("level", STRICT)
def test_a_stale_snapshot_refused_by_the_row_s_lock_itself_is_named_as_such(
    h, conn, schema, store, effects, pg_url, app_sessions, monkeypatch, level
):
    """A transaction that read before the block: the lock of the job's row may raise the
    serialization failure itself, rather than say the snapshot misses the pinned version
    (as it did on a loaded machine, a lease renewal in flight when the snapshot was
    taken). The block is refused with the TransactionError that names the level, as when
    the lock answers, and writes nothing."""
    broker = h.broker()

    def lock_refused(*args, **kwargs):
        raise psycopg.errors.SerializationFailure(
            "could not serialize access due to concurrent update"
        )

    monkeypatch.setattr(broker.store, "lock_for_completion", lock_refused)

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"lock_{h.queue}", max_retries=0)
    def work():
        job = current_job()
        with psycopg.connect(pg_url, application_name=APP) as app:
            app.isolation_level = level_of(level)
            with app.transaction():
                app.execute("SELECT 1")
                with job.complete_in(app):
                    app.execute(effects.insert, (job.id, job.attempt))

    message = work.send()
    h.start(broker)
    wait_status(store, conn, schema, message.message_id, "failed")
    error = store.get(message.message_id)["last_error"]
    assert "TransactionError" in error and level.upper() in error, error
    assert "read the database before the block began" in error, error
    assert effects() == []


# -- the lease after a block that raised -------------------------------------------------------


@pytest.mark.parametrize("level", ["read committed", *STRICT])
def test_an_actor_that_outlives_its_lease_after_a_failed_block_keeps_its_job(
    h, conn, schema, store, effects, pg_url, app_sessions, level
):
    """The block raises (nothing written); the actor catches it and works on for two and a
    half leases, then ends normally, while the reapers look for expired leases every half
    second. Its lease is renewed all along: a second worker of the queue never runs the
    job, and the job succeeds once, at attempt 1."""
    first = h.broker(lease_seconds=2, reaper_interval=0.5)
    second = h.broker(lease_seconds=2, reaper_interval=0.5)
    runs: list[int] = []
    done = threading.Event()

    def declare(broker):
        @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"long_{h.queue}")
        def work():
            job = current_job()
            runs.append(job.attempt)
            with psycopg.connect(pg_url, application_name=APP) as app:
                app.isolation_level = level_of(level)
                try:
                    with job.complete_in(app):
                        app.execute(effects.insert, (job.id, job.attempt))
                        raise ValueError("the block fails")
                except ValueError:
                    pass
            time.sleep(5)
            done.set()

        return work

    work = declare(first)
    declare(second)
    message = work.send()
    h.start(first, threads=1)
    wait_for(lambda: runs, 20, "the first worker to run the job")
    h.start(second, threads=1)
    row = wait_status(store, conn, schema, message.message_id, "succeeded")
    assert done.is_set()
    assert runs == [1], f"the job ran again while its first attempt was still running: {runs}"
    assert row[1] == 1
    assert effects() == []
    types = [e["type"] for e in store.events_of(message.message_id)]
    assert "timeout_requeued" not in types, types


# -- renew() and progress() inside a block ----------------------------------------------------


@pytest.mark.parametrize("call", ["renew", "progress"])
@pytest.mark.parametrize("level", STRICT)
def test_renew_and_progress_inside_a_pinned_block_answer_at_once(
    h, conn, schema, store, effects, pg_url, app_sessions, level, call
):
    """A REPEATABLE READ or SERIALIZABLE block holds its job's row from its start:
    ``renew()`` there is answered without a statement (the row's lock holds the job; a
    renewal would wait for it, in the thread that holds it), and ``progress()`` records
    its event without writing the job's row (a write after the block's snapshot would
    fail the block's success, on every attempt): one effect, the progress kept."""
    broker = h.broker(lease_seconds=1)
    answers: list[tuple] = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"rp_{h.queue}", max_retries=0)
    def work():
        job = current_job()
        with psycopg.connect(pg_url, application_name=APP) as app:
            app.isolation_level = level_of(level)
            with job.complete_in(app):
                app.execute(effects.insert, (job.id, job.attempt))
                began = time.monotonic()
                told = job.renew() if call == "renew" else job.progress({"done": 1})
                answers.append((told, time.monotonic() - began))
                time.sleep(0.4)  # past a renewal and the start record

    message = work.send()
    h.start(broker)
    try:
        row = wait_status(store, conn, schema, message.message_id, "succeeded")
    except BaseException:
        end_app_sessions(conn)  # a renewal that waits for the block's own transaction
        raise
    [(told, took)] = answers
    assert told is True and took < 0.5, answers
    assert row[1] == 1 and effects() == [(message.message_id, 1)]
    events = store.events_of(message.message_id)
    expected = [{"done": 1}] if call == "progress" else []
    assert [e["data"] for e in of_type(events, "progress")] == expected
    assert not of_type(events, "lease_renewed"), "a renewal written on the pinned row"
    succeeded_once(store, message.message_id)


def test_renew_and_progress_after_a_savepoint_block_inside_an_open_transaction_answer_at_once(
    h, conn, schema, store, effects, pg_url, app_sessions
):
    """READ COMMITTED: the block's success is written in a savepoint of the application's
    transaction, which stays open (and holds the job's row) while the actor calls
    ``renew()`` and ``progress()``: both answer at once, and the job succeeds once that
    transaction commits."""
    broker = h.broker()
    answers: list[tuple] = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"sp_{h.queue}", max_retries=0)
    def work():
        job = current_job()
        with psycopg.connect(pg_url, application_name=APP) as app, app.transaction():
            with job.complete_in(app):
                app.execute(effects.insert, (job.id, job.attempt))
            for what, call in (("renew", job.renew), ("progress", lambda: job.progress(2))):
                began = time.monotonic()
                answers.append((what, call(), time.monotonic() - began))

    message = work.send()
    h.start(broker)
    try:
        row = wait_status(store, conn, schema, message.message_id, "succeeded")
    except BaseException:
        end_app_sessions(conn)
        raise
    assert [(what, ok) for what, ok, _ in answers] == [("renew", True), ("progress", True)]
    assert all(took < 0.5 for _, _, took in answers), answers
    assert row[1] == 1 and effects() == [(message.message_id, 1)]
    assert [e["data"] for e in of_type(store.events_of(message.message_id), "progress")] == [2]


# -- a row the worker does not know is held ----------------------------------------------------


#: What an actor calls with its job's row locked by its own transaction, and the words the
#: refusal names it by.
CALLS = {
    "renew": (lambda job, app: job.renew(), "renew()"),
    "progress": (lambda job, app: job.progress(1), "progress()"),
    "complete_in": (lambda job, app: job.complete_in(app).__enter__(), "the complete_in() block"),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_what_writes_the_job_s_row_waits_a_bounded_time_for_a_row_the_application_locked(
    h, conn, schema, store, pg_url, app_sessions, call
):
    """The application's own transaction locks the job's row (the worker does not know of
    it): ``renew()``, ``progress()`` and a REPEATABLE READ block's pin of the row wait for
    it at most a second, then raise ``JobBusy`` naming that transaction, rather than
    hang (the wait is in the thread that holds the lock)."""
    broker = h.broker()
    seen: list[tuple] = []
    lock = sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR UPDATE").format(
        sql.Identifier(schema, "jobs")
    )
    run, words = CALLS[call]

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"bl_{h.queue}", max_retries=0)
    def work():
        job = current_job()
        with psycopg.connect(pg_url, application_name=APP) as app:
            app.isolation_level = IsolationLevel.REPEATABLE_READ
            with app.transaction():
                app.execute(lock, (job.id,))
                began = time.monotonic()
                try:
                    with app.transaction():  # what the call leaves rolls back
                        run(job, app)
                except JobBusy as e:
                    seen.append((str(e), time.monotonic() - began))
                else:
                    seen.append(("answered", time.monotonic() - began))

    message = work.send()
    h.start(broker)
    try:
        wait_for(lambda: seen, 20, f"{words} to answer")
        # The actor commits its transaction after the answer: ending its session before
        # that (below) would fail the job.
        wait_status(store, conn, schema, message.message_id, "succeeded")
    finally:
        end_app_sessions(conn)  # a call that waits for the row without end
    [(text, took)] = seen
    assert 0.9 < took < 3, f"answered after {took:.2f}s: {text}"
    assert f"job {message.message_id}'s row is held by the transaction of backend" in text, text
    assert f"application {APP!r}" in text and f"{words} waited" in text, text


# -- a block inside another block of the same job -------------------------------------------


@pytest.mark.parametrize("level", ["read committed", *STRICT])
@pytest.mark.parametrize("kind", ["psycopg", "sa-session"])
def test_a_block_inside_another_on_the_same_connection_joins_it_for_one_effect(
    h, conn, schema, store, effects, pg_url, app_sessions, kind, level
):
    """A helper that wraps its writes in ``complete_in()``, called from an actor's own
    block on the same connection: the inner block is a savepoint of the outer one's
    transaction, and the job succeeds once, when that transaction commits (it was
    refused with ``LostOwnership`` at the outer block's end, on every attempt: the job
    dead-lettered with no effect)."""
    engine = sa.create_engine(
        sa_url(pg_url),
        isolation_level=level.upper(),
        connect_args={"application_name": APP},
    )
    broker = h.broker()

    def record(obj, job, n):
        if kind == "psycopg":
            obj.execute(effects.insert, (job.id, n))
        else:
            obj.execute(effects.text, {"a": job.id, "b": n})

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, actor_name=f"nested_{h.queue}", max_retries=0
    )
    def work():
        job = current_job()
        if kind == "psycopg":
            app = psycopg.connect(pg_url, application_name=APP)
            app.isolation_level = level_of(level)
        else:
            app = Session(engine)
        with app:
            with job.complete_in(app):
                record(app, job, 1)
                with job.complete_in(app):  # the helper's block
                    record(app, job, 2)

    message = work.send()
    h.start(broker)
    try:
        row = wait_status(store, conn, schema, message.message_id, "succeeded")
    finally:
        engine.dispose()
    assert row[1] == 1, f"one attempt, not {row[1]}"
    assert effects() == [(message.message_id, 1), (message.message_id, 2)]
    [event] = succeeded_once(store, message.message_id)
    assert event["data"] == {"in_transaction": True}


@pytest.mark.parametrize("level", ["read committed", "repeatable read"])
def test_an_async_block_inside_another_on_the_same_connection_joins_it_for_one_effect(
    h, conn, schema, store, effects, pg_url, level
):
    """As above, with ``async with`` on a psycopg ``AsyncConnection``."""
    broker = h.broker()
    broker.add_middleware(AsyncIO())

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"anest_{h.queue}", max_retries=0)
    async def work():
        job = current_job()
        async with await psycopg.AsyncConnection.connect(pg_url, application_name=APP) as app:
            await app.set_isolation_level(level_of(level))
            async with job.complete_in(app):
                await app.execute(effects.insert, (job.id, 1))
                async with job.complete_in(app):  # the helper's block
                    await app.execute(effects.insert, (job.id, 2))

    message = work.send()
    h.start(broker)
    row = wait_status(store, conn, schema, message.message_id, "succeeded")
    assert row[1] == 1, f"one attempt, not {row[1]}"
    assert effects() == [(message.message_id, 1), (message.message_id, 2)]
    [event] = succeeded_once(store, message.message_id)
    assert event["data"] == {"in_transaction": True}
