"""``complete_in()`` under application code as it is written: every isolation level
PostgreSQL offers, commits inside the block, exceptions after it, aborts while the
application's transaction holds the job's row. In-process workers, real PostgreSQL.

Each block holds its transaction open for longer than the worker's first writes to the job's
row (its start, after 0.1 s, and its lease renewals: a one-second lease is renewed every
third of a second), which a REPEATABLE READ or SERIALIZABLE transaction that took its
snapshot earlier cannot see.
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
from psycopg import IsolationLevel, sql
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from dramatiq_pg_broker import current_job
from dramatiq_pg_broker.errors import JobBusy
from dramatiq_pg_broker.results import PostgresBackend

from ..helpers import wait_for
from .test_complete_in import empty_effects, job_row, sa_url, succeeded_once, wait_status

#: How long a block holds its transaction: past the start record and a lease renewal.
HOLD = 0.4

LEVELS = ["read uncommitted", "read committed", "repeatable read", "serializable"]
#: How the block meets the transaction: it begins it; it joins the application's, which
#: has read nothing yet; it joins the application's, which read before the block.
SHAPES = ["begins", "joins", "joins-after-read"]


@pytest.fixture
def effects(conn, schema):
    return empty_effects(conn, schema)


def refused(level: str, shape: str) -> bool:
    """Whether the block is refused: a snapshot taken before the block, at a level that
    keeps it."""
    return shape == "joins-after-read" and level in ("repeatable read", "serializable")


def _psycopg(url, insert, level, shape, inside=None):
    job = current_job()
    with psycopg.connect(url) as conn:
        conn.isolation_level = IsolationLevel[level.upper().replace(" ", "_")]
        if shape == "begins":
            with job.complete_in(conn):
                conn.execute(insert, (job.id, job.attempt))
                _hold(inside)
            return
        with conn.transaction():
            if shape == "joins-after-read":
                conn.execute("SELECT 1")
            with job.complete_in(conn):
                conn.execute(insert, (job.id, job.attempt))
                _hold(inside)


def _sa(engine, text, level, shape, kind, inside=None):
    job = current_job()
    engine = engine.execution_options(isolation_level=level.upper())
    params = {"a": job.id, "b": job.attempt}
    with Session(engine) if kind == "session" else engine.connect() as obj:
        if shape == "begins":
            with job.complete_in(obj):
                obj.execute(text, params)
                _hold(inside)
            return
        with obj.begin():
            if shape == "joins-after-read":
                obj.execute(sa.text("SELECT 1"))
            with job.complete_in(obj):
                obj.execute(text, params)
                _hold(inside)


def _hold(inside) -> None:
    """Inside the block, after the actor's write: what the test does there (``inside``),
    then hold the transaction open."""
    if inside is not None:
        inside()
    time.sleep(HOLD)


SYNC = {
    "psycopg": lambda ctx, *how: _psycopg(ctx["url"], ctx["insert"], *how, ctx.get("inside")),
    "sa-session": lambda ctx, *how: _sa(
        ctx["engine"], ctx["text"], *how, "session", ctx.get("inside")
    ),
    "sa-connection": lambda ctx, *how: _sa(
        ctx["engine"], ctx["text"], *how, "connection", ctx.get("inside")
    ),
}


def check_outcome(store, conn, schema, effects, message_id, level, shape) -> None:
    if refused(level, shape):
        row = wait_status(store, conn, schema, message_id, "failed")
        assert effects() == [], "a refused block writes nothing"
        error = store.get(message_id)["last_error"]
        assert "TransactionError" in error and level.upper() in error, error
        assert "read the database before the block began" in error, error
        assert row[1] == 1
        return
    row = wait_status(store, conn, schema, message_id, "succeeded")
    assert row[1] == 1, f"one attempt, not {row[1]}"
    assert effects() == [(message_id, 1)]
    [event] = succeeded_once(store, message_id)
    assert event["data"] == {"in_transaction": True}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", sorted(SYNC))
def test_every_isolation_level_gives_one_effect_or_an_immediate_refusal(
    h, conn, schema, store, effects, pg_url, kind, level, shape
):
    engine = sa.create_engine(sa_url(pg_url))
    ctx = {"url": pg_url, "insert": effects.insert, "text": effects.text, "engine": engine}
    broker = h.broker(lease_seconds=1)

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"level_{h.queue}", max_retries=0)
    def work():
        SYNC[kind](ctx, level, shape)

    message = work.send()
    h.start(broker)
    try:
        check_outcome(store, conn, schema, effects, message.message_id, level, shape)
    finally:
        engine.dispose()


async def _async_psycopg(url, insert, level, shape):
    job = current_job()
    async with await psycopg.AsyncConnection.connect(url) as conn:
        await conn.set_isolation_level(IsolationLevel[level.upper().replace(" ", "_")])
        if shape == "begins":
            async with job.complete_in(conn):
                await conn.execute(insert, (job.id, job.attempt))
                time.sleep(HOLD)
            return
        async with conn.transaction():
            if shape == "joins-after-read":
                await conn.execute("SELECT 1")
            async with job.complete_in(conn):
                await conn.execute(insert, (job.id, job.attempt))
                time.sleep(HOLD)


async def _async_sa(url, text, level, shape, kind):
    job = current_job()
    engine = create_async_engine(url, isolation_level=level.upper())
    params = {"a": job.id, "b": job.attempt}
    try:
        async with AsyncSession(engine) if kind == "session" else engine.connect() as obj:
            if shape == "begins":
                async with job.complete_in(obj):
                    await obj.execute(text, params)
                    time.sleep(HOLD)
                return
            async with obj.begin():
                if shape == "joins-after-read":
                    await obj.execute(sa.text("SELECT 1"))
                async with job.complete_in(obj):
                    await obj.execute(text, params)
                    time.sleep(HOLD)
    finally:
        await engine.dispose()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("level", ["read committed", "repeatable read", "serializable"])
@pytest.mark.parametrize("kind", ["psycopg", "sa-session", "sa-connection"])
def test_every_isolation_level_gives_one_effect_or_an_immediate_refusal_async(
    h, conn, schema, store, effects, pg_url, kind, level, shape
):
    broker = h.broker(lease_seconds=1)
    broker.add_middleware(AsyncIO())

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, actor_name=f"alevel_{h.queue}", max_retries=0
    )
    async def work():
        if kind == "psycopg":
            await _async_psycopg(pg_url, effects.insert, level, shape)
        else:
            await _async_sa(sa_url(pg_url), effects.text, level, shape, kind.removeprefix("sa-"))

    message = work.send()
    h.start(broker)
    check_outcome(store, conn, schema, effects, message.message_id, level, shape)


# -- a commit inside the block ----------------------------------------------------------------


def _commit_inside(engine, text, level, joined, kind):
    job = current_job()
    engine = engine.execution_options(isolation_level=level)
    params = {"a": job.id, "b": job.attempt}
    with Session(engine) if kind == "session" else engine.connect() as obj:
        outer = obj.begin() if joined else None
        if outer is not None:
            outer.__enter__()
        with job.complete_in(obj):
            obj.execute(text, params)
            obj.commit()  # the application's habit: commits the job's success with it
        if outer is not None:
            outer.__exit__(None, None, None)


async def _async_commit_inside(url, text, level, joined, kind):
    job = current_job()
    engine = create_async_engine(url, isolation_level=level)
    params = {"a": job.id, "b": job.attempt}
    try:
        async with AsyncSession(engine) if kind == "session" else engine.connect() as obj:
            if joined:
                await obj.begin()
            async with job.complete_in(obj):
                await obj.execute(text, params)
                await obj.commit()
    finally:
        await engine.dispose()


@pytest.mark.parametrize("joined", [False, True], ids=["begins", "joins"])
@pytest.mark.parametrize("level", ["READ COMMITTED", "REPEATABLE READ"])
@pytest.mark.parametrize("kind", ["session", "connection", "async-session", "async-connection"])
def test_a_sqlalchemy_commit_inside_the_block_commits_the_job_s_success_with_it(
    h, conn, schema, store, effects, pg_url, kind, level, joined
):
    """The application commits inside the block: its effect and the job's success commit
    together, once; the job is not retried."""
    broker = h.broker(lease_seconds=1)
    broker.add_middleware(AsyncIO())
    engine = sa.create_engine(sa_url(pg_url))
    ran = []

    if kind.startswith("async-"):

        @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"ac_{h.queue}")
        async def work():
            ran.append(1)
            await _async_commit_inside(
                sa_url(pg_url), effects.text, level, joined, kind.removeprefix("async-")
            )

    else:

        @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"c_{h.queue}")
        def work():
            ran.append(1)
            _commit_inside(engine, effects.text, level, joined, kind)

    message = work.send()
    h.start(broker)
    try:
        row = wait_status(store, conn, schema, message.message_id, "succeeded")
    finally:
        engine.dispose()
    assert row[1] == 1 and len(ran) == 1, f"run {len(ran)} times, {row[1]} attempts"
    assert effects() == [(message.message_id, 1)], "one effect"
    [event] = succeeded_once(store, message.message_id)
    assert event["data"] == {"in_transaction": True}


def test_a_psycopg_commit_inside_the_block_is_refused_before_it_commits(
    h, conn, schema, store, effects, pg_url
):
    """psycopg refuses ``commit()`` inside ``conn.transaction()``: nothing is committed."""
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"p_{h.queue}", max_retries=0)
    def work():
        job = current_job()
        with psycopg.connect(pg_url) as app, job.complete_in(app):
            app.execute(effects.insert, (job.id, job.attempt))
            app.commit()

    message = work.send()
    h.start(broker)
    wait_status(store, conn, schema, message.message_id, "failed")
    assert effects() == []
    assert "commit() forbidden" in store.get(message.message_id)["last_error"]


# -- an exception after the block committed --------------------------------------------------


@pytest.mark.parametrize("joined", [False, True], ids=["begins", "joins"])
def test_an_exception_after_a_committed_block_is_a_success_for_every_middleware(
    h, conn, schema, store, effects, pg_url, caplog, joined
):
    """The row says succeeded: the pipeline goes on, on_success runs (not on_failure), the
    results backend stores None, and the exception is logged with the job's id."""
    broker = h.broker()
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend))
    seen: list[tuple] = []

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, actor_name=f"raises_{h.queue}", store_results=True
    )
    def raises_after():
        job = current_job()
        with psycopg.connect(pg_url) as app:
            if joined:
                with app.transaction():
                    with job.complete_in(app):
                        app.execute(effects.insert, (job.id, job.attempt))
            else:
                with job.complete_in(app):
                    app.execute(effects.insert, (job.id, job.attempt))
        raise RuntimeError("after the block")

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"next_{h.queue}")
    def next_step(value):
        seen.append(("next", value))

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"ok_{h.queue}")
    def on_ok(message, result):
        seen.append(("success", result))

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"ko_{h.queue}")
    def on_ko(message, exception):
        seen.append(("failure", exception["type"]))

    first = raises_after.message_with_options(on_success=on_ok, on_failure=on_ko)
    dramatiq.pipeline([first, next_step.message()], broker=broker).run()
    h.start(broker)
    try:
        assert backend.get_result(first, block=True, timeout=20_000) is None
        wait_for(lambda: len(seen) >= 2, 20, "the pipeline's next step and the callback")
    finally:
        backend.close()
    # The callback's message is sent by the hook that sends either: once on_success ran,
    # a wrong on_failure would have a job too.
    callbacks = conn.execute(
        f'SELECT actor_name, count(*) FROM "{schema}".all_jobs WHERE actor_name IN (%s, %s) '
        "GROUP BY actor_name",
        (on_ok.actor_name, on_ko.actor_name),
    ).fetchall()
    assert callbacks == [(on_ok.actor_name, 1)], callbacks
    assert sorted(seen) == [("next", None), ("success", None)], seen
    row = wait_status(store, conn, schema, first.message_id, "succeeded")
    assert row[1] == 1 and effects() == [(first.message_id, 1)]
    logged = [r for r in caplog.records if "after the transaction of its complete_in()" in r.msg]
    assert logged and logged[0].args[0] == first.message_id and logged[0].exc_info


# -- aborts while the application's transaction holds the row --------------------------------


def test_an_abort_answers_within_its_wait_and_names_the_transaction_that_holds_the_row(
    h, conn, schema, store, effects, pg_url
):
    """The block's success is written; the actor holds its transaction open. The abort
    answers within its wait, changes nothing, and says who holds the row; once that
    transaction commits, the job has succeeded."""
    broker = h.broker()
    holding = threading.Event()
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"hold_{h.queue}")
    def work():
        job = current_job()
        with psycopg.connect(pg_url, application_name="the-app") as app, app.transaction():
            with job.complete_in(app):
                app.execute(effects.insert, (job.id, job.attempt))
            holding.set()
            release.wait(20)

    message = work.send()
    h.start(broker)
    wait_for(holding.is_set, 20, "the block's success to be written")
    try:
        for wait in (0.5, 1.5):
            began = time.monotonic()
            with pytest.raises(JobBusy) as raised:
                store.abort(message.message_id, by="operator", lock_wait=wait)
            took = time.monotonic() - began
            assert wait <= took < wait + 1.0, f"answered after {took:.2f}s, its wait {wait}s"
        text = str(raised.value)
        assert "idle in transaction" in text and "'the-app'" in text, text
        assert "complete_in()" in text and "nothing was changed" in text, text
    finally:
        release.set()
    row = wait_status(store, conn, schema, message.message_id, "succeeded")
    assert row[1] == 1 and effects() == [(message.message_id, 1)]
    assert store.get(message.message_id)["abort_requested_at"] is None


def test_an_abort_names_the_transaction_that_locked_the_row_in_two_savepoints(
    h, conn, schema, store, pg_url
):
    """The row is locked by two savepoints of one transaction (a share lock, then an update
    lock: its xmax is then a MultiXact, not a transaction id, as when SQLAlchemy's commit
    hook writes a success after a savepoint locked the row): the abort still names that
    transaction."""
    broker = h.broker()
    holding = threading.Event()
    release = threading.Event()
    jobs = sql.Identifier(schema, "jobs")
    share = sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR KEY SHARE").format(jobs)
    update = sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR NO KEY UPDATE").format(jobs)

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"mx_{h.queue}")
    def work():
        job = current_job()
        with psycopg.connect(pg_url, application_name="the-app") as app, app.transaction():
            with app.transaction():
                app.execute(share, (job.id,))
            with app.transaction():
                app.execute(update, (job.id,))
                holding.set()
                release.wait(20)

    message = work.send()
    h.start(broker)
    wait_for(holding.is_set, 20, "the row to be locked in two savepoints")
    try:
        with pytest.raises(JobBusy) as raised:
            store.abort(message.message_id, by="operator", lock_wait=0.3)
    finally:
        release.set()
    text = str(raised.value)
    assert "held by the transaction of backend" in text and "'the-app'" in text, text
    wait_status(store, conn, schema, message.message_id, "succeeded")


def test_an_abort_during_a_repeatable_read_block_is_recorded_at_once_and_cancels_the_job(
    h, conn, schema, store, effects, pg_url
):
    """A REPEATABLE READ block holds the job's row from its start (FOR KEY SHARE): an
    abort is recorded at once, the actor is interrupted, nothing is committed."""
    broker = h.broker()
    inside = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"rr_{h.queue}")
    def work():
        job = current_job()
        with psycopg.connect(pg_url) as app:
            app.isolation_level = IsolationLevel.REPEATABLE_READ
            with job.complete_in(app):
                app.execute(effects.insert, (job.id, job.attempt))
                inside.set()
                for _ in range(200):
                    time.sleep(0.05)

    message = work.send()
    h.start(broker)
    wait_for(inside.is_set, 20, "the actor to be inside its block")
    began = time.monotonic()
    job = store.abort(message.message_id, by="operator", lock_wait=1.0)
    assert time.monotonic() - began < 0.9 and job["status"] == "running"
    wait_status(store, conn, schema, message.message_id, "cancelled", timeout=10)
    assert effects() == []
    assert job_row(conn, schema, message.message_id)[0] == "cancelled"


@pytest.mark.parametrize("level", ["read committed", "repeatable read", "serializable"])
@pytest.mark.parametrize("kind", sorted(SYNC))
def test_an_abort_the_worker_never_hears_of_ends_the_job_cancelled_at_every_level(
    h, conn, schema, store, effects, pg_url, kind, level
):
    """An operator's abort lands on the job's row while the block runs, and the worker
    never hears of it (no LISTEN, its heartbeat beyond the test): the block's success is
    refused, the actor's failure is its last one as far as the worker knows, and the
    failure's statement ends the job cancelled all the same, with nothing committed,
    whatever the level and the kind of connection. (The worker's ledger took the refused
    block for an ordinary last failure, and the job ended `failed`, before the failure's
    statement read the request on the row.)"""
    engine = sa.create_engine(sa_url(pg_url))

    def abort_now():
        store.abort(current_job().id, by="operator")

    ctx = {"url": pg_url, "insert": effects.insert, "text": effects.text, "engine": engine}
    ctx["inside"] = abort_now
    broker = h.broker(listen=False, lease_seconds=300, heartbeat_seconds=120)

    @dramatiq.actor(
        broker=broker,
        queue_name=h.queue,
        actor_name=f"unheard_{h.queue}",
        interrupt_on_abort=False,
        max_retries=0,
    )
    def work():
        SYNC[kind](ctx, level, "begins")

    message = work.send()
    h.start(broker)
    try:
        row = wait_status(store, conn, schema, message.message_id, "cancelled")
    finally:
        engine.dispose()
    assert row[1] == 1
    assert effects() == [], "the refused block committed the actor's write"
    events = store.events_of(message.message_id)
    assert [e["type"] for e in events][-2:] == ["abort_requested", "aborted"], events
    assert events[-1]["actor"] == "operator"
    # Which statement wrote the end depends on timing: the actor's failure (fail_jobs, its
    # error LostOwnership) or, when the block's refusal reached the worker's ledger first,
    # the worker's own abort (abort_attempts, no error). Cancelled, by the operator, either
    # way: what is promised.


def test_an_actor_called_as_a_function_after_the_block_raises_as_it_would(
    h, conn, schema, store, effects, pg_url
):
    """Only the actor the worker runs is the job's: another actor called as a plain
    function after the block committed raises to its caller as usual."""
    broker = h.broker()
    caught: list[BaseException] = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"inner_{h.queue}")
    def inner():
        raise LookupError("inner")

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"outer_{h.queue}")
    def outer():
        job = current_job()
        with psycopg.connect(pg_url) as app, job.complete_in(app):
            app.execute(effects.insert, (job.id, job.attempt))
        try:
            inner()
        except LookupError as e:
            caught.append(e)

    message = outer.send()
    h.start(broker)
    wait_status(store, conn, schema, message.message_id, "succeeded")
    # The job's success commits with the block, a moment before the actor calls inner().
    wait_for(lambda: caught, 10, "the actor to catch inner()'s error")
    assert len(caught) == 1 and effects() == [(message.message_id, 1)]
