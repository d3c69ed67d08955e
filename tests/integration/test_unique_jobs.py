"""Unique jobs (issue 46, item 6): at most one job per actor, queue and arguments.

A unique send is a send with a derived idempotency key in the scope 'unique'. These tests
hold what differs from an application's key: the key is freed by every exit of its job,
in the statement that ends it (and only then, or once a ``unique_for`` period has run out
and the job has ended); a later send then makes a new job. The races are real: threads
with connections of their own, released together, at each isolation level, and sends
from several processes.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import threading

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker, periodic
from dramatiq_pg_broker.errors import InvalidMessage, JobAlreadyFinished
from dramatiq_pg_broker.jobs import Attempt
from dramatiq_pg_broker.sending.unique import UNIQUE_SCOPE, unique_key

from ..helpers import wait_for

LEVELS = ["read committed", "repeatable read", "serializable"]
#: The injected clock's start: an hour ahead of the real one, so that a job sent on the
#: real clock is runnable at it (a fixed date became the past on the day it named).
T0 = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)).replace(microsecond=0)


def ms(n: int) -> dt.timedelta:
    return dt.timedelta(milliseconds=n)


@pytest.fixture
def unique_task(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue, actor_name=f"unique_{queue}")
    def unique_task(*args, **kwargs):
        pass

    return unique_task


def jobs_of(conn, schema, actor_name: str) -> list[tuple[str, str]]:
    """(id, status) of every job of the actor, unfinished or in history, oldest first."""
    query = sql.SQL(
        "SELECT id::text, status FROM {} WHERE actor_name = %s ORDER BY created_at, id"
    ).format(sql.Identifier(schema, "all_jobs"))
    return conn.execute(query, (actor_name,)).fetchall()


def keys_of(conn, schema, actor_name: str) -> list[tuple[str, object]]:
    """(job id, expires_at) of the actor's unique keys."""
    query = sql.SQL(
        "SELECT job_id::text, expires_at FROM {} WHERE actor_name = %s AND idempotency_scope = %s"
    ).format(sql.Identifier(schema, "job_keys"))
    return conn.execute(query, (actor_name, UNIQUE_SCOPE)).fetchall()


def new_job(broker, message, now=None):
    """The store's own send of ``message`` (as the broker builds it), at ``now``."""
    job, _ = broker.sender.job_for(message)
    return broker.store.enqueue(job, now=now)


def claim(broker, queue: str, now=None, lease: float = 60) -> Attempt:
    claimed = broker.store.claim(queue, 1, "w", lease, now=now)
    assert len(claimed) == 1, f"nothing was claimed from {queue}"
    attempt = Attempt(claimed[0].id, "w", claimed[0].attempts)
    assert broker.store.start([attempt], None, now=now) == {attempt.id}
    return attempt


# -- the key --------------------------------------------------------------------------


def test_the_key_is_the_queue_and_the_arguments_canonically_encoded():
    def key(queue="q", args=(1, "a"), kwargs=None):
        return unique_key(
            dramatiq.Message(
                queue_name=queue, actor_name="a", args=args, kwargs=kwargs or {}, options={}
            )
        )

    assert key(kwargs={"x": 1, "y": [2]}) == key(kwargs={"y": [2], "x": 1})
    assert key(args=(1, "a")) == key(args=[1, "a"])
    assert key().startswith("u1:") and len(key()) == 3 + 64
    assert key() != key(queue="r")
    assert key() != key(args=(1, "b"))
    assert key(args=(1,)) != key(args=(True,)), "1 and True are different arguments"
    with pytest.raises(InvalidMessage, match="JSON values"):
        key(args=(object(),))


@pytest.mark.parametrize(
    "options, error",
    [
        ({"unique": "yes"}, "unique must be True or False"),
        ({"unique_for": 0}, "unique_for must be an integer from 1"),
        ({"unique_for": 1.5}, "unique_for must be an integer from 1"),
        ({"unique_for": True}, "unique_for must be an integer from 1"),
        ({"unique": True, "idempotency_key": "k"}, "cannot have an idempotency_key"),
    ],
)
def test_bad_unique_options_are_refused_before_anything_is_written(
    broker, unique_task, conn, schema, options, error
):
    with pytest.raises(InvalidMessage, match=error):
        unique_task.send_with_options(args=(1,), **options)
    assert jobs_of(conn, schema, unique_task.actor_name) == []


# -- while a job waits or runs ----------------------------------------------------------


def test_a_unique_send_returns_the_job_that_waits_or_runs_and_a_new_one_after_it_ended(
    broker, unique_task, queue, conn, schema
):
    first = unique_task.send_with_options(args=(1,), kwargs={"x": 2}, unique=True)
    again = unique_task.send_with_options(args=(1,), kwargs={"x": 2}, unique=True, delay=5)
    assert again.message_id == first.message_id
    assert again.options.get("unique") is True
    other = unique_task.send_with_options(args=(2,), kwargs={"x": 2}, unique=True)
    plain = unique_task.send(1, x=2)
    assert len({first.message_id, other.message_id, plain.message_id}) == 3

    attempt = claim(broker, queue)
    assert attempt.id == first.message_id
    running = unique_task.send_with_options(args=(1,), kwargs={"x": 2}, unique=True)
    assert running.message_id == first.message_id, "a running job is still the unique one"

    assert broker.store.complete([attempt]) == {attempt.id}
    assert [k for k, _ in keys_of(conn, schema, unique_task.actor_name)] == [other.message_id]
    after = unique_task.send_with_options(args=(1,), kwargs={"x": 2}, unique=True)
    assert after.message_id != first.message_id
    statuses = dict(jobs_of(conn, schema, unique_task.actor_name))
    assert statuses == {
        first.message_id: "succeeded",
        other.message_id: "queued",
        plain.message_id: "queued",
        after.message_id: "queued",
    }


def test_the_actor_option_makes_every_send_unique_and_a_message_can_turn_it_off(
    broker, queue, conn, schema
):
    @dramatiq.actor(broker=broker, queue_name=queue, actor_name=f"always_{queue}", unique=True)
    def always(n):
        pass

    a, b = always.send(1), always.send(1)
    assert a.message_id == b.message_id
    c = always.send_with_options(args=(1,), unique=False)
    assert c.message_id != a.message_id
    # A message's own key wins over the actor's option (a periodic schedule's tick key).
    d = always.send_with_options(args=(1,), idempotency_key="tick-1")
    e = always.send_with_options(args=(1,), idempotency_key="tick-1")
    assert d.message_id == e.message_id and d.message_id not in {a.message_id, c.message_id}
    assert len(jobs_of(conn, schema, always.actor_name)) == 3


def test_a_periodic_schedule_of_a_unique_actor_sends_one_job_per_tick(pg_url, schema, queue, conn):
    broker = PostgresBroker(url=pg_url, schema=schema, retention=False)
    try:

        @periodic(every=60)
        @dramatiq.actor(broker=broker, queue_name=queue, actor_name=f"tick_{queue}", unique=True)
        def ticking():
            pass

        scheduler = broker.periodic.new_scheduler()
        minute = dt.datetime.now(dt.timezone.utc).replace(second=0, microsecond=0)
        scheduler.register(broker.schedules[0], minute)
        sent = [
            scheduler.enqueue_tick(broker.schedules[0], tick).message_id
            for tick in (minute, minute, minute + dt.timedelta(minutes=1))
        ]
    finally:
        broker.close()
    assert sent[0] == sent[1] != sent[2], "one job per tick, the tick's key deciding"
    assert len(jobs_of(conn, schema, ticking.actor_name)) == 2


def test_a_unique_job_in_another_queue_is_another_job(broker, unique_task, conn, schema):
    a = unique_task.send_with_options(args=(1,), unique=True)
    moved = unique_task.message_with_options(args=(1,), unique=True)
    moved = moved.copy(queue_name=f"{moved.queue_name}_other")
    b = broker.enqueue(moved)
    assert a.message_id != b.message_id
    assert len(jobs_of(conn, schema, unique_task.actor_name)) == 2


# -- every exit frees the key -------------------------------------------------------------


def _succeed(broker, queue, job_id):
    assert broker.store.complete([claim(broker, queue)]) == {job_id}


def _fail(broker, queue, job_id):
    assert broker.store.fail([claim(broker, queue)], ["boom"]) == {job_id}


def _cancel(broker, queue, job_id):
    assert broker.store.cancel(job_id, by="ops")["status"] == "cancelled"


def _abort_waiting(broker, queue, job_id):
    assert broker.store.abort(job_id, by="ops")["status"] == "cancelled"


def _abort_running(broker, queue, job_id):
    attempt = claim(broker, queue)
    broker.store.abort(job_id, by="ops")
    assert broker.store.abort_attempts([attempt]) == {job_id}


def _retry_after_abort(broker, queue, job_id):
    attempt = claim(broker, queue)
    broker.store.abort(job_id, by="ops")
    broker.store.reschedule(attempt, queue, 0, "boom")


def _reaper_fails_it(broker, queue, job_id):
    claim(broker, queue, now=T0, lease=1)
    reaped = broker.store.reap(
        batch=10, backoff_ms=[0], max_interruptions=1, lease_seconds=1, now=T0 + ms(60_000)
    )
    assert reaped.failed == [job_id]


def _complete_in_transaction(broker, queue, job_id):
    attempt = claim(broker, queue)
    with broker.pool.connection() as c, c.transaction():
        assert broker.store.complete_in_transaction(attempt, c) is not None


EXITS = {
    "succeeded": _succeed,
    "failed": _fail,
    "cancelled by an operator": _cancel,
    "aborted while waiting": _abort_waiting,
    "aborted while running": _abort_running,
    "aborted, its retry cancelled": _retry_after_abort,
    "failed by the reaper": _reaper_fails_it,
    "succeeded in the actor's transaction": _complete_in_transaction,
}


@pytest.mark.parametrize("exit_", EXITS, ids=list(EXITS))
def test_every_exit_frees_the_key_in_the_statement_that_ends_the_job(
    broker, unique_task, queue, conn, schema, exit_
):
    first = unique_task.send_with_options(args=("x",), unique=True)
    assert [k for k, _ in keys_of(conn, schema, unique_task.actor_name)] == [first.message_id]
    EXITS[exit_](broker, queue, first.message_id)
    ended = dict(jobs_of(conn, schema, unique_task.actor_name))[first.message_id]
    assert ended in {"succeeded", "failed", "cancelled"}
    assert keys_of(conn, schema, unique_task.actor_name) == [], f"{exit_} left the key held"
    second = unique_task.send_with_options(args=("x",), unique=True)
    assert second.message_id != first.message_id


def test_a_key_an_older_worker_left_behind_is_freed_by_the_next_send(
    broker, unique_task, queue, conn, schema
):
    """A worker of a release before 0024 moves a unique job to history without freeing its
    key: the next unique send finds the key's job ended, frees the key and sends."""
    first = unique_task.send_with_options(args=(7,), unique=True)
    keys = sql.Identifier(schema, "job_keys")
    saved = conn.execute(
        sql.SQL("SELECT * FROM {} WHERE job_id = %s").format(keys), (first.message_id,)
    ).fetchone()
    _succeed(broker, queue, first.message_id)
    conn.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s, %s, %s, %s)").format(keys), saved)
    second = unique_task.send_with_options(args=(7,), unique=True)
    assert second.message_id != first.message_id
    assert [k for k, _ in keys_of(conn, schema, unique_task.actor_name)] == [second.message_id]


def test_an_operator_s_retry_takes_the_key_back_unless_a_newer_job_holds_it(
    broker, unique_task, queue, conn, schema
):
    first = unique_task.send_with_options(args=(3,), unique=True)
    _fail(broker, queue, first.message_id)
    broker.store.retry_failed(first.message_id, by="ops")
    assert [k for k, _ in keys_of(conn, schema, unique_task.actor_name)] == [first.message_id]
    assert unique_task.send_with_options(args=(3,), unique=True).message_id == first.message_id

    _fail(broker, queue, first.message_id)
    newer = unique_task.send_with_options(args=(3,), unique=True)
    assert newer.message_id != first.message_id
    retried = broker.store.retry_failed(first.message_id, by="ops")
    assert retried["status"] == "queued" and retried["idempotency_key"] is None
    assert [k for k, _ in keys_of(conn, schema, unique_task.actor_name)] == [newer.message_id]
    assert unique_task.send_with_options(args=(3,), unique=True).message_id == newer.message_id


def test_an_operator_s_retry_takes_back_a_key_whose_job_ended_and_period_ran_out(
    broker, unique_task, queue, conn, schema
):
    """A newer job's key left after it ended (its unique_for period ran past its end)
    holds nothing once the period has run out: a retried job takes it, and the next send
    of the same arguments returns the retried job instead of making a second one."""
    failed = unique_task.send_with_options(args=(10,), unique=True)
    _fail(broker, queue, failed.message_id)
    message = unique_task.message_with_options(args=(10,), unique_for=1_000)
    newer = new_job(broker, message, now=T0)
    attempt = claim(broker, queue, now=T0)
    assert broker.store.complete([attempt], now=T0 + ms(500)) == {newer.id}
    assert [k for k, _ in keys_of(conn, schema, unique_task.actor_name)] == [newer.id]
    retried = broker.store.retry_failed(failed.message_id, by="ops", now=T0 + ms(2_000))
    assert retried["idempotency_key"] is not None, "the retried job runs without its key"
    assert [k for k, _ in keys_of(conn, schema, unique_task.actor_name)] == [failed.message_id]
    again = new_job(broker, _fresh(message), now=T0 + ms(3_000))
    assert (again.id, again.created) == (failed.message_id, False)


def test_a_retry_racing_a_send_leaves_the_key_to_the_sent_job(
    broker, unique_task, queue, pg_url, conn, schema
):
    """A send commits its key while an operator's retry of a failed job with the same
    arguments waits for it: the retry's snapshot, older than the send, does not see the
    new job, which holds the key all the same; the retried job runs without it."""
    failed = unique_task.send_with_options(args=(11,), unique=True)
    _fail(broker, queue, failed.message_id)
    retried: list[dict] = []
    with psycopg.connect(pg_url) as app:
        app.execute("SELECT 1")  # the application's transaction, open until its commit
        with broker.transaction(app):
            sent = unique_task.send_with_options(args=(11,), unique=True)

        def retry_it():
            try:
                retried.append(broker.store.retry_failed(failed.message_id, by="ops"))
            except BaseException as e:  # noqa: BLE001 - reported below
                retried.append({"error": e})

        retry = threading.Thread(target=retry_it)
        retry.start()
        wait_for(
            lambda: conn.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone()[0],
            10,
            "the retry waiting for the send's key",
        )
        app.commit()
    retry.join(10)
    assert len(retried) == 1 and "error" not in retried[0], retried
    assert retried[0]["status"] == "queued" and retried[0]["idempotency_key"] is None
    assert [k for k, _ in keys_of(conn, schema, unique_task.actor_name)] == [sent.message_id]


def test_retrying_every_failed_job_gives_the_key_to_one_job_of_the_same_arguments(
    broker, unique_task, queue, conn, schema
):
    failed = []
    for _ in range(2):
        failed.append(unique_task.send_with_options(args=(4,), unique=True).message_id)
        _fail(broker, queue, failed[-1])
    retried = [i for batch in broker.store.retry_all_failed(queue_name=queue) for i in batch]
    assert sorted(retried) == sorted(failed)
    keyed = {i: broker.store.get(i)["idempotency_key"] is not None for i in failed}
    assert keyed == {failed[0]: True, failed[1]: False}, "the earlier failure takes the key"
    assert [k for k, _ in keys_of(conn, schema, unique_task.actor_name)] == [failed[0]]


# -- unique_for ----------------------------------------------------------------------------


def test_unique_for_holds_the_key_for_its_period_whatever_the_state_then_frees_it(
    broker, unique_task, queue, conn, schema
):
    message = unique_task.message_with_options(args=(5,), unique_for=60_000)
    first = new_job(broker, message, now=T0)
    assert first.created
    (key,) = keys_of(conn, schema, unique_task.actor_name)
    assert key == (first.id, T0 + ms(60_000))

    attempt = claim(broker, queue, now=T0 + ms(1_000))
    assert broker.store.complete([attempt], now=T0 + ms(2_000)) == {first.id}
    assert keys_of(conn, schema, unique_task.actor_name) == [key], "freed before its period ran out"
    during = new_job(broker, _fresh(message), now=T0 + ms(59_000))
    assert (during.id, during.created, during.status) == (first.id, False, "succeeded")

    after = new_job(broker, _fresh(message), now=T0 + ms(60_000))
    assert after.created and after.id != first.id
    assert keys_of(conn, schema, unique_task.actor_name) == [(after.id, T0 + ms(120_000))]


def test_a_job_that_still_waits_after_its_period_is_still_the_unique_one(
    broker, unique_task, conn, schema
):
    message = unique_task.message_with_options(args=(6,), unique_for=1_000)
    first = new_job(broker, message, now=T0)
    later = new_job(broker, _fresh(message), now=T0 + ms(3_600_000))
    assert (later.id, later.created) == (first.id, False)
    assert len(jobs_of(conn, schema, unique_task.actor_name)) == 1


def test_an_exit_after_the_period_frees_the_key(broker, unique_task, queue, conn, schema):
    message = unique_task.message_with_options(args=(8,), unique_for=1_000)
    first = new_job(broker, message, now=T0)
    attempt = claim(broker, queue, now=T0)
    assert broker.store.complete([attempt], now=T0 + ms(5_000)) == {first.id}
    assert keys_of(conn, schema, unique_task.actor_name) == []


def test_a_refused_send_of_a_finished_job_s_message_takes_no_key(
    broker, unique_task, queue, conn, schema
):
    """Sending again the message of a unique job that finished raises JobAlreadyFinished
    and writes nothing: it does not take the key back for its job, nor start a period."""
    message = unique_task.message_with_options(args=(9,), unique_for=1_000)
    first = new_job(broker, message, now=T0)
    attempt = claim(broker, queue, now=T0)
    assert broker.store.complete([attempt], now=T0 + ms(5_000)) == {first.id}
    assert keys_of(conn, schema, unique_task.actor_name) == []
    with pytest.raises(JobAlreadyFinished):
        new_job(broker, message, now=T0 + ms(6_000))
    assert keys_of(conn, schema, unique_task.actor_name) == [], "a refused send took the key"
    # A batch tried again (its first try may have committed) is given the finished job,
    # and takes no key for it either: by arrays, and through a staging table.
    job, _ = broker.sender.job_for(message)
    (retried,) = broker.store.enqueue_many([job], again=False, now=T0 + ms(6_000))
    assert (retried.id, retried.created) == (first.id, False)
    others = [broker.sender.job_for(_fresh(message.copy(args=[-n])))[0] for n in range(1, 200)]
    staged = broker.store.enqueue_many([job, *others], again=False, now=T0 + ms(6_000))
    assert (staged[0].id, staged[0].created) == (first.id, False)
    assert first.id not in {i for i, _ in keys_of(conn, schema, unique_task.actor_name)}
    later = new_job(broker, _fresh(message), now=T0 + ms(6_500))
    assert later.created and later.id != first.id


def _fresh(message):
    """The same call as ``message``, as a new message (its own id)."""
    return dramatiq.Message(
        queue_name=message.queue_name,
        actor_name=message.actor_name,
        args=message.args,
        kwargs=message.kwargs,
        options=dict(message.options),
    )


# -- the other send paths -------------------------------------------------------------------


def test_a_batch_and_enqueue_many_keep_one_job_per_arguments(broker, unique_task, conn, schema):
    with broker.batch():
        for n in (1, 1, 2, 1):
            unique_task.send_with_options(args=(n,), unique=True)
    assert len(jobs_of(conn, schema, unique_task.actor_name)) == 2
    sent = broker.enqueue_many(
        [unique_task.message_with_options(args=(n % 3,), unique=True) for n in range(300)]
    )
    assert len({m.message_id for m in sent}) == 3, "the COPY path let a duplicate in"
    assert len(jobs_of(conn, schema, unique_task.actor_name)) == 3


def test_a_bulk_send_through_copy_registers_each_key_with_its_period(
    broker, unique_task, conn, schema
):
    sent = broker.enqueue_many(
        [unique_task.message_with_options(args=(n,), unique_for=60_000) for n in range(250)]
    )
    assert len({m.message_id for m in sent}) == 250
    keys = keys_of(conn, schema, unique_task.actor_name)
    assert len(keys) == 250 and all(expires is not None for _, expires in keys)
    again = broker.enqueue_many(
        [unique_task.message_with_options(args=(n,), unique_for=60_000) for n in range(250)]
    )
    assert [m.message_id for m in again] == [m.message_id for m in sent]


# -- races -----------------------------------------------------------------------------------


THREADS = 8


@pytest.mark.parametrize("level", LEVELS)
def test_concurrent_sends_in_transactions_make_exactly_one_job(
    pg_url, schema, broker, unique_task, conn, level
):
    """Each thread sends the same unique job in a transaction of its own connection at
    ``level``, all released together; a transaction that hits a serialization failure is
    tried again, as an application does. One job, and every send returns it."""
    barrier = threading.Barrier(THREADS)
    results: list[str] = []
    errors: list[BaseException] = []
    failures = []

    def send() -> None:
        try:
            with psycopg.connect(pg_url) as c:
                first = True
                while True:
                    try:
                        c.execute(f"BEGIN ISOLATION LEVEL {level.upper()}")
                        c.execute("SELECT 1")  # the snapshot, taken before the race
                        if first:
                            barrier.wait(30)
                            first = False
                        with broker.transaction(c):
                            sent = unique_task.send_with_options(args=("race",), unique=True)
                        c.execute("COMMIT")
                        results.append(sent.message_id)
                        return
                    except psycopg.errors.SerializationFailure:
                        c.execute("ROLLBACK")
                        failures.append(1)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=send) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(results) == THREADS
    rows = jobs_of(conn, schema, unique_task.actor_name)
    assert len(rows) == 1, f"{len(rows)} jobs for one unique send at {level}"
    assert set(results) == {rows[0][0]}
    if level != "read committed":
        assert failures, f"no send at {level} met the winner's key unseen: the race did not happen"


def test_concurrent_sends_through_the_pool_make_exactly_one_job(broker, unique_task, conn, schema):
    """The broker's own sends from many threads share statements (group commit): the
    first of the group with the arguments makes the job, with its period."""
    barrier = threading.Barrier(THREADS)
    results: list[str] = []

    def send() -> None:
        barrier.wait(30)
        sent = unique_task.send_with_options(args=("pool",), unique_for=600_000)
        results.append(sent.message_id)

    threads = [threading.Thread(target=send) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    rows = jobs_of(conn, schema, unique_task.actor_name)
    assert len(rows) == 1 and set(results) == {rows[0][0]} and len(results) == THREADS
    ((job_id, expires_at),) = keys_of(conn, schema, unique_task.actor_name)
    assert job_id == rows[0][0] and expires_at is not None


def _send_from_a_process(pg_url, schema, queue, actor_name, barrier, out) -> None:
    broker = PostgresBroker(url=pg_url, schema=schema)
    try:
        actor = dramatiq.actor(
            lambda *a: None, broker=broker, queue_name=queue, actor_name=actor_name
        )
        barrier.wait(60)
        ids = [actor.send_with_options(args=("p",), unique=True).message_id for _ in range(5)]
        out.put(ids)
    finally:
        broker.close()


def test_concurrent_sends_from_many_processes_make_exactly_one_job(pg_url, schema, queue, conn):
    actor_name = f"procs_{queue}"
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(
            target=_send_from_a_process, args=(pg_url, schema, queue, actor_name, barrier, out)
        )
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    sent = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    rows = jobs_of(conn, schema, actor_name)
    assert len(rows) == 1, f"{len(rows)} jobs from 4 processes' unique sends"
    assert {i for ids in sent for i in ids} == {rows[0][0]}
