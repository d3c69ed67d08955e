"""One row per job id at every moment, whatever the isolation level of the application's
transaction that sends, on every send path (issue 30, item 2).

A message sent again (same message id) by an application transaction while a worker
finishes its job must not give the id a second row: queued in ``jobs`` and finished in
``jobs_history``. Under READ COMMITTED the send sees the move; under REPEATABLE READ and
SERIALIZABLE its snapshot may not, and the send then raises psycopg's
``SerializationFailure`` (the application retries its transaction) instead of writing.
The races are real: each side has its own connection, and the application's transaction
begins with an explicit ``BEGIN ISOLATION LEVEL``.
"""

from __future__ import annotations

import asyncio
import json
import threading

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.errors import DuplicateJobId, JobAlreadyFinished
from dramatiq_pg_broker.jobs import Attempt

from ..helpers import wait_for
from ..rows import tables_of

LEVELS = ["read committed", "repeatable read", "serializable"]

#: How the application sends the message again inside its transaction: one send, a
#: Dramatiq group, enqueue_many below the COPY threshold (array parameters), a
#: broker.batch() block, enqueue_many through COPY, enqueue_many whose COPY meets a
#: conflict (the staged path), and an ``async with broker.transaction(aconn)`` block.
PATHS = ["single", "group", "arrays", "batch", "copy", "staged", "async"]

#: What a send that must not write may raise: the job finished (its move was seen), or the
#: transaction's snapshot cannot see what it conflicts with.
REFUSED = (JobAlreadyFinished, psycopg.errors.SerializationFailure)


def claim(broker, queue: str, job_id: str) -> Attempt:
    claimed = [c for c in broker.store.claim(queue, 100, "w", 60) if c.id == job_id]
    assert claimed, f"job {job_id} was not claimed"
    return Attempt(job_id, "w", claimed[0].attempts)


def race_with_the_move(broker, pg_url: str, queue: str, message, send, waiting, what: str):
    """Claim ``message``'s job and move it to history in a worker's transaction left open;
    meanwhile run ``send`` in a thread, wait until ``waiting(mover_pid)`` says that it waits
    for the move (``what`` names the send), then commit the move: the send must end within
    30 s."""
    attempt = claim(broker, queue, message.message_id)
    with psycopg.connect(pg_url, autocommit=True) as mover:
        mover.execute("BEGIN")
        assert broker.store.complete([attempt], conn=mover) == {message.message_id}
        thread = threading.Thread(target=send)
        thread.start()
        try:
            mover_pid = mover.info.backend_pid
            wait_for(lambda: waiting(mover_pid), 10, f"{what} to wait for the worker's move")
        finally:
            mover.execute("COMMIT")
            thread.join(30)
    assert not thread.is_alive(), f"{what} hung"


def send_again(broker, task, app, path: str, message: dramatiq.Message) -> None:
    """Send ``message`` again on the synchronous connection ``app`` (in its transaction)."""
    with broker.transaction(app):
        if path == "single":
            broker.enqueue(message)
        elif path == "group":
            dramatiq.group([task.message(-1), message], broker=broker).run()
        elif path == "arrays":
            broker.enqueue_many([task.message(-1), message])
        elif path == "batch":
            with broker.batch():
                task.send(-1)
                broker.enqueue(message)
        elif path == "copy":
            broker.enqueue_many([message, *(task.message(n) for n in range(250))])
        elif path == "staged":
            # An id already queued makes the COPY fail: the staged path resolves each row.
            queued = task.message(-2)
            broker.enqueue(queued)
            broker.enqueue_many([message, queued, *(task.message(n) for n in range(250))])
        else:
            raise AssertionError(path)


async def send_again_async(broker, pg_url: str, level: str, message, ready=None) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as app:
        await app.execute(f"BEGIN ISOLATION LEVEL {level}")
        await app.execute("SELECT 1")  # the transaction's snapshot, for RR and SERIALIZABLE
        if ready is not None:
            ready(app.info.backend_pid)
        try:
            async with broker.transaction(app):
                broker.enqueue(message)
        finally:
            # An application that ignores the error and commits anyway.
            await app.execute("COMMIT")


def attempt_send(broker, task, pg_url: str, level: str, path: str, message, ready=None):
    """Send ``message`` again in an application transaction at ``level``, then COMMIT even
    if the send raised (an application that ignores the error must not commit a second
    row). Returns the error raised, or None."""
    try:
        if path == "async":
            asyncio.run(send_again_async(broker, pg_url, level, message, ready))
            return None
        with psycopg.connect(pg_url, autocommit=True) as app:
            app.execute(f"BEGIN ISOLATION LEVEL {level}")
            app.execute("SELECT 1")  # the transaction's snapshot, for RR and SERIALIZABLE
            if ready is not None:
                ready(app.info.backend_pid)
            try:
                send_again(broker, task, app, path, message)
            finally:
                app.execute("COMMIT")
    except REFUSED as e:
        return e
    return None


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("level", LEVELS)
def test_a_job_that_finished_after_the_snapshot_is_not_sent_again(
    broker, task, queue, conn, schema, pg_url, level, path
):
    """The application's snapshot predates the job's send, claim and finish: under
    REPEATABLE READ and SERIALIZABLE it sees the id nowhere, yet the id is in history."""
    message = task.message(0)
    started = threading.Event()
    go_on = threading.Event()
    outcome: dict = {}

    def application() -> None:
        def ready(pid: int) -> None:
            started.set()
            assert go_on.wait(10), "the main thread never finished the job"

        outcome["error"] = attempt_send(broker, task, pg_url, level, path, message, ready)

    thread = threading.Thread(target=application)
    thread.start()
    try:
        assert started.wait(10), "the application's transaction did not begin"
        broker.enqueue(message)
        broker.store.fail([claim(broker, queue, message.message_id)], ["boom"])
        assert tables_of(conn, schema, message.message_id) == [("history", "failed")]
    finally:
        go_on.set()
        thread.join(30)
    assert not thread.is_alive(), "the application's send hung"
    assert tables_of(conn, schema, message.message_id) == [("history", "failed")]
    error = outcome["error"]
    if level == "read committed":
        assert isinstance(error, JobAlreadyFinished), error
    else:
        assert isinstance(error, psycopg.errors.SerializationFailure), error
    # And the operator's retry then finds one row to move back.
    assert broker.store.retry_failed(message.message_id)["status"] == "queued"
    assert tables_of(conn, schema, message.message_id) == [("jobs", "queued")]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("level", LEVELS)
def test_a_send_racing_with_the_finish_of_its_job_never_makes_a_second_row(
    broker, task, queue, conn, schema, pg_url, level, path
):
    """The worker's move to history is under way (its transaction holds the row) when the
    application sends the message again; the move then commits."""
    message = broker.enqueue(task.message(0))
    outcome: dict = {}
    pids: list[int] = []

    def send() -> None:
        outcome["error"] = attempt_send(broker, task, pg_url, level, path, message, pids.append)

    def waiting(mover_pid: int) -> bool:
        if not pids:  # the application's transaction has not begun yet
            return False
        query = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s"
        return conn.execute(query, (pids[0],)).fetchone()[0]

    race_with_the_move(broker, pg_url, queue, message, send, waiting, "the application's send")
    assert tables_of(conn, schema, message.message_id) == [("history", "succeeded")]
    error = outcome["error"]
    assert error is not None, "the send of a finished job was taken without a word"
    if level == "read committed":
        assert isinstance(error, JobAlreadyFinished), error


@pytest.mark.parametrize("path", ["single", "group", "bulk"])
def test_a_pooled_send_racing_with_the_finish_of_its_job_never_makes_a_second_row(
    broker, task, queue, conn, schema, pg_url, path
):
    """The same race for the broker's own sends (no application transaction): a single
    send, the group commit's statement (the sends of several threads at once), a bulk
    send through the pool."""
    message = broker.enqueue(task.message(0))
    outcome: dict = {}

    def send() -> None:
        try:
            if path == "single":
                broker.enqueue(message)
            elif path == "group":
                job, _ = broker.sender.job_for(message)
                other, _ = broker.sender.job_for(task.message(1))
                [_, result] = broker.store.send_many([(other, True), (job, True)])
                if isinstance(result, Exception):
                    raise result
            else:
                broker.enqueue_many([task.message(1), message])
        except JobAlreadyFinished as e:
            outcome["error"] = e

    def waiting(mover_pid: int) -> bool:
        # Blocked by the mover itself: another test's lock waits (the suite runs in
        # parallel) are not this send's.
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            (mover_pid,),
        ).fetchone()[0]

    race_with_the_move(broker, pg_url, queue, message, send, waiting, "the send")
    assert tables_of(conn, schema, message.message_id) == [("history", "succeeded")]
    assert isinstance(outcome.get("error"), JobAlreadyFinished), outcome


@pytest.mark.parametrize("level", LEVELS)
def test_a_new_job_sends_at_every_level(broker, task, queue, conn, schema, pg_url, level):
    """No false alarm: the check after the insert finds nothing for a new id."""
    for path in PATHS:
        message = task.message(0)
        assert attempt_send(broker, task, pg_url, level, path, message) is None, path
        assert tables_of(conn, schema, message.message_id) == [("jobs", "queued")], path


def double_in_history(conn, schema: str, job_id: str) -> None:
    """A second failed row of ``job_id`` in history, a millisecond after the first (what
    an earlier release could leave)."""
    conn.execute(
        sql.SQL(
            "INSERT INTO {s}.jobs_history SELECT (x.h).* FROM (SELECT h FROM "
            "{s}.jobs_history AS h WHERE id = %s) AS x"
        ).format(s=sql.Identifier(schema)),
        (job_id,),
    )
    conn.execute(
        sql.SQL(
            "UPDATE {s}.jobs_history SET finished_at = finished_at + interval '1 ms' "
            "WHERE ctid = (SELECT max(ctid) FROM {s}.jobs_history WHERE id = %s)"
        ).format(s=sql.Identifier(schema)),
        (job_id,),
    )


def also_in_jobs(conn, schema: str, job_id: str) -> None:
    """A queued row of ``job_id`` in jobs next to its failed row in history."""
    columns = sql.SQL(
        "id, queue_name, actor_name, message, message_bytes, priority, available_at, "
        "max_attempts, idempotency_key, idempotency_scope, created_at, updated_at"
    )
    conn.execute(
        sql.SQL(
            "INSERT INTO {s}.jobs ({c}, status) SELECT {c}, 'queued' FROM {s}.jobs_history "
            "WHERE id = %s"
        ).format(s=sql.Identifier(schema), c=columns),
        (job_id,),
    )


def test_retry_all_failed_skips_and_reports_ids_with_a_second_row(
    broker, task, queue, conn, schema, run
):
    ids = []
    for n in range(3):
        message = task.send(n)
        broker.store.fail([claim(broker, queue, message.message_id)], ["boom"])
        ids.append(message.message_id)
    doubled, twice, alone = ids
    also_in_jobs(conn, schema, doubled)
    double_in_history(conn, schema, twice)
    code, out, err = run("jobs", "retry", "--all-failed", "--queue", queue)
    assert code == 0, err
    assert "retried 1 failed job(s)" in out, out
    assert doubled in out and twice in out, out
    assert tables_of(conn, schema, alone) == [("jobs", "queued")]
    assert sorted(tables_of(conn, schema, doubled)) == [("history", "failed"), ("jobs", "queued")]
    assert tables_of(conn, schema, twice) == [("history", "failed"), ("history", "failed")]
    # Run again: the skipped ones are reported again, nothing crashes.
    code, out, err = run("jobs", "retry", "--all-failed", "--queue", queue, "--json")
    assert code == 0, err
    assert json.loads(out) == {"retried": [], "skipped": sorted([doubled, twice])}, out
    with pytest.raises(DuplicateJobId, match=twice):
        broker.store.retry_failed(twice)
    code, out, err = run("jobs", "retry", twice)
    assert code != 0 and "second row" in err and "Traceback" not in err, err


def test_the_admin_api_answers_409_for_a_retry_of_an_id_with_a_second_row(env, conn, schema):
    twice = env.failed()
    double_in_history(conn, schema, twice)
    response = env.post(f"/api/jobs/{twice}/retry", role="admin")
    assert response.status_code == 409, response.text
    assert "second row" in response.json["message"], response.json


def test_the_brokers_own_bulk_transactions_begin_read_committed(pg_url, schema, queue, monkeypatch):
    """A server (or role) whose default isolation is SERIALIZABLE: the broker's own bulk
    transactions still begin READ COMMITTED, where each statement sees every move to
    history committed before it."""
    monkeypatch.setenv("PGOPTIONS", "-c default_transaction_isolation=serializable")
    broker = PostgresBroker(url=pg_url, schema=schema)
    try:

        @dramatiq.actor(broker=broker, queue_name=queue, actor_name=f"rc_{queue}")
        def task(n):
            pass

        seen: list[str | None] = []
        confirm = broker.store._confirm_new

        def spy(c, jobs, isolation, pooled):
            seen.append(isolation)
            return confirm(c, jobs, isolation, pooled)

        monkeypatch.setattr(broker.store, "_confirm_new", spy)
        broker.enqueue_many([task.message(n) for n in range(3)])
        broker.enqueue_many([task.message(n) for n in range(250)])
        with psycopg.connect(pg_url) as c:
            assert c.execute("SHOW default_transaction_isolation").fetchone()[0] == "serializable"
        # The broker's pooled sessions set themselves back to READ COMMITTED (0028).
        with broker.pool.connection() as c:
            assert c.execute("SHOW default_transaction_isolation").fetchone()[0] == (
                "read committed"
            )
        assert seen == ["read committed", "read committed"]
    finally:
        broker.close()
