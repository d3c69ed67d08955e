"""Sends through the pool: concurrent sends sharing one statement (group commit), and
sends that do not wait for the WAL flush (``durable=False``)."""

from __future__ import annotations

import threading

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.errors import InvalidMessage, JobAlreadyFinished
from dramatiq_pg_broker.jobs import Attempt

THREADS = 8


def make_broker(pg_url, schema, **options):
    return PostgresBroker(url=pg_url, schema=schema, poll_interval=0.1, **options)


def stored(conn, schema, queue) -> dict[str, int]:
    """Each job of the queue with its number of created events."""
    rows = conn.execute(
        sql.SQL(
            "SELECT j.id::text, count(e.id) FROM {} j LEFT JOIN {} e "
            "ON e.job_id = j.id AND e.type = 'created' WHERE j.queue_name = %s GROUP BY j.id"
        ).format(sql.Identifier(schema, "all_jobs"), sql.Identifier(schema, "job_events")),
        (queue,),
    ).fetchall()
    return dict(rows)


class HeldWrite:
    """Holds the first write of the broker's group commit (a send alone: the store's
    ``enqueue``) until ``waiting`` other sends have queued behind it, so that they must
    share the next statement (the store's ``send_many``); ``writes`` holds how many sends
    each write carried."""

    def __init__(self, broker, monkeypatch, waiting: int) -> None:
        self.broker = broker
        self.waiting = waiting
        self.release = threading.Event()
        self.writes: list[int] = []
        store = broker.store
        enqueue, send_many = store.enqueue, store.send_many

        def held(job, **options):
            self.writes.append(1)
            if len(self.writes) == 1:
                assert self.release.wait(30), "the other sends never queued up"
            return enqueue(job, **options)

        def together(sends, **options):
            self.writes.append(len(sends))
            return send_many(sends, **options)

        monkeypatch.setattr(store, "enqueue", held)
        monkeypatch.setattr(store, "send_many", together)

    def queued(self) -> int:
        """How many sends wait behind the held write (at most 10 s for all of them)."""
        for _ in range(1000):
            if self.broker.sender.waiting == self.waiting:
                break
            threading.Event().wait(0.01)
        return self.broker.sender.waiting

    def finish(self, threads: list[threading.Thread]) -> None:
        """Let the held write go, and wait for every sending thread."""
        self.release.set()
        for t in threads:
            t.join(30)


def send_from_threads(count: int, send) -> list:
    """``send(i)`` from ``count`` threads released together; their results (or errors)."""
    barrier = threading.Barrier(count)
    results: list = [None] * count

    def run(i: int) -> None:
        barrier.wait(10)
        try:
            results[i] = send(i)
        except Exception as e:  # returned to the test
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, results


def test_sends_waiting_for_a_write_share_the_next_statement(
    broker, task, queue, schema, conn, monkeypatch
):
    held = HeldWrite(broker, monkeypatch, THREADS - 1)
    threads, results = send_from_threads(THREADS, lambda i: task.send(i))
    assert held.queued() == THREADS - 1, "the other sends did not queue behind the write"
    held.finish(threads)
    assert held.writes == [1, THREADS - 1], "one write alone, then every waiting send in one"
    sent = {m.message_id for m in results}
    assert stored(conn, schema, queue) == {i: 1 for i in sent}, "each job once, one event each"


def test_a_conflict_in_a_shared_statement_is_only_its_senders(
    broker, task, queue, schema, conn, monkeypatch
):
    finished = task.send(-2)
    [claimed] = broker.store.claim(queue, 1, "w", 60)
    broker.store.complete([Attempt(claimed.id, "w", claimed.attempts)])
    keyed = task.send_with_options(args=(-1,), idempotency_key="shared-key")

    def send(i):
        if i == 0:
            return task.send_with_options(args=(0,), idempotency_key="shared-key")
        if i == 1:
            return broker.enqueue(finished.copy())
        return task.send(i)

    held = HeldWrite(broker, monkeypatch, THREADS - 1)
    threads, results = send_from_threads(THREADS, send)
    held.queued()
    held.finish(threads)
    assert held.writes == [1, THREADS - 1]
    # The key already used: the existing job's message, as for a send alone.
    assert results[0].message_id == keyed.message_id and results[0].args == (-1,)
    assert isinstance(results[1], JobAlreadyFinished), results[1]
    others = results[2:]
    assert all(isinstance(r, dramatiq.Message) for r in others), others
    rows = stored(conn, schema, queue)
    assert set(rows) == {keyed.message_id, finished.message_id} | {m.message_id for m in others}
    assert set(rows.values()) == {1}


def test_a_row_the_server_refuses_fails_only_its_own_send(
    broker, task, queue, schema, conn, monkeypatch
):
    def send(i):
        if i == 0:
            # A queue name the jobs table refuses (empty), past the broker's own checks.
            return broker.enqueue(task.message(0).copy(queue_name=""))
        return task.send(i)

    held = HeldWrite(broker, monkeypatch, THREADS - 1)
    threads, results = send_from_threads(THREADS, send)
    held.queued()
    held.finish(threads)
    assert isinstance(results[0], psycopg.errors.CheckViolation), results[0]
    assert all(isinstance(r, dramatiq.Message) for r in results[1:]), results
    assert set(stored(conn, schema, queue)) == {m.message_id for m in results[1:]}


# -- durable=False -----------------------------------------------------------------------


def flush_setting_after_insert(broker, job) -> str:
    """synchronous_commit as the insert left it, read in the insert's own transaction."""
    # The single insert's statement with its own parameters, run on a connection of the
    # test's: no public call leaves its transaction open to read the setting in.
    params = broker.store._new_job_params(job, None)
    with broker.pool.connection() as c, c.transaction(force_rollback=True):
        c.execute(broker.store.queries["insert_job"], params).fetchall()
        return c.execute("SHOW synchronous_commit").fetchone()[0]


def test_a_non_durable_send_turns_the_flush_wait_off_for_its_own_commit_only(broker, task, pg_url):
    with psycopg.connect(pg_url, autocommit=True) as c:
        default = c.execute("SHOW synchronous_commit").fetchone()[0]
    durable, _ = broker.sender.job_for(task.message(1))
    fast, _ = broker.sender.job_for(task.message_with_options(args=(2,), durable=False))
    assert durable.durable and not fast.durable
    assert flush_setting_after_insert(broker, durable) == default
    assert flush_setting_after_insert(broker, fast) == "off"
    # The pool's connection is back to the server's setting afterwards.
    with broker.pool.connection() as c:
        assert c.execute("SHOW synchronous_commit").fetchone()[0] == default


def test_the_setting_makes_sends_non_durable_and_the_option_wins(pg_url, schema, queue):
    broker = make_broker(pg_url, schema, durable_sends=False)
    try:

        @dramatiq.actor(broker=broker, queue_name=queue, actor_name=f"fast_{queue}")
        def fast(n):
            pass

        assert not broker.sender.job_for(fast.message(1))[0].durable
        assert broker.sender.job_for(fast.message_with_options(args=(1,), durable=True))[0].durable
        jobs = broker.enqueue_many([fast.message(n) for n in range(3)])
        assert len(jobs) == 3
        sent = fast.send(5)
        assert broker.store.get(sent.message_id)["status"] == "queued"
    finally:
        broker.close()


def test_a_durable_option_that_is_not_a_bool_is_refused(broker, task):
    with pytest.raises(InvalidMessage, match="durable must be True or False"):
        task.send_with_options(args=(1,), durable="no")


def test_a_non_durable_send_in_the_applications_transaction_leaves_its_commit_alone(
    broker, task, pg_url, queue, schema, conn
):
    with psycopg.connect(pg_url) as app:
        default = app.execute("SHOW synchronous_commit").fetchone()[0]
        app.commit()
        with broker.transaction(app):
            sent = task.send_with_options(args=(1,), durable=False)
            assert app.execute("SHOW synchronous_commit").fetchone()[0] == default
    assert stored(conn, schema, queue) == {sent.message_id: 1}
