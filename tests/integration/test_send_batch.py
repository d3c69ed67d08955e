"""Bulk enqueue: broker.batch() and broker.enqueue_many()."""

from __future__ import annotations

import datetime as dt
import uuid

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import InvalidMessage, JobAlreadyFinished, PostgresBroker
from dramatiq_pg_broker.jobs import Attempt


@pytest.fixture
def broker(pg_url, schema):
    broker = PostgresBroker(url=pg_url, schema=schema, poll_interval=0.1)
    yield broker
    broker.close()


@pytest.fixture
def queue():
    return f"b_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def task(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue, actor_name=f"task_{queue}", priority=5)
    def task(n):
        pass

    return task


@pytest.fixture
def statements(broker, monkeypatch):
    """Counts the store's writes: single inserts and bulk inserts."""
    calls = {"enqueue": 0, "enqueue_many": 0}
    for name in calls:
        original = getattr(broker.store, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(broker.store, name, counted)
    return calls


def rows(conn, schema, queue) -> list[tuple]:
    return conn.execute(
        sql.SQL(
            "SELECT id::text, priority, available_at, idempotency_key FROM {} "
            "WHERE queue_name = %s ORDER BY created_at"
        ).format(sql.Identifier(schema, "jobs")),
        (queue,),
    ).fetchall()


def created_events(conn, schema, queue) -> int:
    return conn.execute(
        sql.SQL(
            "SELECT count(*) FROM {} e JOIN {} j ON j.id = e.job_id "
            "WHERE j.queue_name = %s AND e.type = 'created'"
        ).format(sql.Identifier(schema, "job_events"), sql.Identifier(schema, "jobs")),
        (queue,),
    ).fetchone()[0]


def test_a_loop_of_sends_is_written_once_at_the_end_of_the_block(
    broker, task, queue, schema, conn, statements
):
    with broker.batch():
        sent = [task.send(n) for n in range(50)]
        assert rows(conn, schema, queue) == [], "written before the block ended"
    assert statements == {"enqueue": 0, "enqueue_many": 1}
    assert [r[0] for r in rows(conn, schema, queue)] == [m.message_id for m in sent]
    assert created_events(conn, schema, queue) == 50
    # Same priority and availability: claimed in the order sent.
    claimed = broker.store.claim(queue, 50, "w", 60)
    assert [j.id for j in claimed] == [m.message_id for m in sent]


def test_a_group_run_in_a_batch_is_one_write(broker, task, queue, schema, conn, statements):
    with broker.batch():
        group = dramatiq.group([task.message(n) for n in range(10)], broker=broker).run()
    assert statements == {"enqueue": 0, "enqueue_many": 1}
    assert len(rows(conn, schema, queue)) == 10
    assert {m.message_id for m in group.children} == {r[0] for r in rows(conn, schema, queue)}


def test_priorities_delays_and_keys_behave_as_for_single_sends(broker, task, queue, schema, conn):
    existing = task.send_with_options(args=(0,), idempotency_key="k-existing")
    before = dt.datetime.now(dt.timezone.utc)
    sent = broker.enqueue_many(
        [
            task.message_with_options(args=(1,), priority=1),
            task.message_with_options(args=(2,), idempotency_key="k-existing"),
            task.message_with_options(args=(3,), idempotency_key="k-new"),
            task.message_with_options(args=(4,), idempotency_key="k-new"),
            task.message_with_options(args=(5,), eta=int(before.timestamp() * 1000) + 60_000),
        ],
        delay=1000,
    )
    assert sent[1].message_id == existing.message_id and sent[1].args == (0,)
    assert sent[3].message_id == sent[2].message_id and sent[3].args == (3,)
    by_id = {r[0]: r for r in rows(conn, schema, queue)}
    assert len(by_id) == 4  # existing + 1 + k-new + eta
    assert by_id[sent[0].message_id][1] == 1
    assert by_id[sent[2].message_id][1] == 5, "the actor's priority"
    waits = {i: (by_id[sent[i].message_id][2] - before).total_seconds() for i in (0, 4)}
    assert 0.5 < waits[0] < 30 and 55 < waits[4] < 90
    assert created_events(conn, schema, queue) == 4


def test_a_bad_message_is_reported_by_index_and_nothing_is_written(
    broker, task, queue, schema, conn
):
    messages = [task.message(n) for n in range(3)]
    messages.append(task.message_with_options(args=(3,), priority=2**31))
    with pytest.raises(InvalidMessage, match="message 3 of the batch: priority must be"):
        broker.enqueue_many(messages)
    with pytest.raises(InvalidMessage, match="message 1 of the batch: .*cannot be encoded"):
        broker.enqueue_many([task.message(1), task.message(object())])
    assert rows(conn, schema, queue) == []


def test_a_finished_id_in_a_batch_writes_nothing(broker, task, queue, schema, conn):
    done = task.send(0)
    [claimed] = broker.store.claim(queue, 1, "w", 60)
    broker.store.complete([Attempt(claimed.id, "w", claimed.attempts)])
    with pytest.raises(JobAlreadyFinished, match="message 2 of the batch"):
        with broker.batch():
            task.send(1)
            task.send(2)
            broker.enqueue(done.copy())
    assert [r[0] for r in rows(conn, schema, queue)] == [done.message_id]


def test_a_block_that_raises_writes_nothing(broker, task, queue, schema, conn):
    with pytest.raises(InvalidMessage):
        with broker.batch():
            task.send(1)
            task.send_with_options(args=(2,), delay=-1)
    with pytest.raises(RuntimeError):
        with broker.batch():
            task.send(3)
            raise RuntimeError("abandon")
    assert rows(conn, schema, queue) == []


def test_a_batch_inside_a_transaction_rolls_back_with_it(
    broker, task, queue, schema, conn, pg_url, statements
):
    with psycopg.connect(pg_url) as app:
        with pytest.raises(RuntimeError):
            with broker.transaction(app), broker.batch():
                for n in range(5):
                    task.send(n)
                with broker.batch():  # a nested batch joins the outer one
                    task.send(5)
                raise RuntimeError("roll back")
        with broker.transaction(app):
            with broker.batch():
                sent = [task.send(n) for n in range(6)]
            assert rows(conn, schema, queue) == [], "committed before the transaction"
    assert [r[0] for r in rows(conn, schema, queue)] == [m.message_id for m in sent]
    assert statements["enqueue_many"] == 1 and statements["enqueue"] == 0


def test_enqueue_many_reschedules_a_waiting_id(broker, task, queue, schema, conn):
    first = task.send(1)
    [again, new] = broker.enqueue_many([first.copy(), task.message(2)], delay=60_000)
    assert again.message_id == first.message_id
    by_id = {r[0]: r for r in rows(conn, schema, queue)}
    assert len(by_id) == 2
    now = dt.datetime.now(dt.timezone.utc)
    assert by_id[first.message_id][2] > now + dt.timedelta(seconds=30)


def test_a_large_batch_keeps_the_rules_and_twice_in_one_transaction(
    broker, task, queue, schema, conn, pg_url
):
    existing = task.send_with_options(args=(0,), idempotency_key="big-0")
    count = broker.store.BULK_COPY_MIN + 50

    def messages(offset):
        return [
            task.message_with_options(args=(offset + n,), idempotency_key=f"big-{n % 100}")
            if n % 3 == 0
            else task.message_with_options(args=(offset + n,), priority=n % 7)
            for n in range(count)
        ]

    with psycopg.connect(pg_url) as app:
        with pytest.raises(RuntimeError):
            with broker.transaction(app):
                broker.enqueue_many(messages(0))
                raise RuntimeError("roll back")
        assert [r[0] for r in rows(conn, schema, queue)] == [existing.message_id]
        with broker.transaction(app):
            first = broker.enqueue_many(messages(0))
            second = broker.enqueue_many(messages(1000))
    assert first[0].message_id == existing.message_id
    keyed = {
        m.options["idempotency_key"]: m.message_id for m in first if "idempotency_key" in m.options
    }
    assert all(
        m.message_id == keyed[m.options["idempotency_key"]]
        for m in second
        if "idempotency_key" in m.options
    )
    stored = {r[0]: r for r in rows(conn, schema, queue)}
    unkeyed = [m for m in first + second if "idempotency_key" not in m.options]
    assert len(stored) == 1 + len(set(keyed.values()) - {existing.message_id}) + len(unkeyed)
    assert all(stored[m.message_id][1] == m.options["priority"] for m in unkeyed)
    assert created_events(conn, schema, queue) == len(stored)
