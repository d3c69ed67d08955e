"""Bulk enqueue: broker.batch() and broker.enqueue_many()."""

from __future__ import annotations

import datetime as dt
import json

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import InvalidMessage, JobAlreadyFinished
from dramatiq_pg_broker.jobs import Attempt


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
        ).format(sql.Identifier(schema, "all_jobs")),
        (queue,),
    ).fetchall()


def created_events(conn, schema, queue) -> int:
    return sum(1 for _, kind, _, _ in event_rows(conn, schema, queue) if kind == "created")


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


# -- the direct COPY path of a large batch ---------------------------------------------------


def job_rows(conn, schema, queue) -> list[dict]:
    cur = conn.execute(
        sql.SQL(
            "SELECT id::text, queue_name, actor_name, message, message_bytes, status, priority, "
            "available_at - updated_at AS wait, max_attempts, idempotency_key, "
            "idempotency_scope, attempts, created_at, updated_at, available_at "
            "FROM {} WHERE queue_name = %s ORDER BY created_at, id"
        ).format(sql.Identifier(schema, "all_jobs")),
        (queue,),
    )
    names = [d.name for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def event_rows(conn, schema, queue) -> list[tuple]:
    return conn.execute(
        sql.SQL(
            "SELECT e.job_id::text, e.type, e.attempt, e.created_at = j.created_at "
            "FROM {} e JOIN {} j ON j.id = e.job_id WHERE j.queue_name = %s ORDER BY e.id"
        ).format(sql.Identifier(schema, "job_events"), sql.Identifier(schema, "all_jobs")),
        (queue,),
    ).fetchall()


@pytest.fixture
def resolving(broker, monkeypatch):
    """Counts the batches written by the path that resolves conflicts row by row."""
    calls = []
    # Which of enqueue_many's two write paths ran is not told by any public call.
    original = broker.store._insert_resolving

    def counted(c, jobs, *args, **kwargs):
        calls.append(len(jobs))
        return original(c, jobs, *args, **kwargs)

    monkeypatch.setattr(broker.store, "_insert_resolving", counted)
    return calls


def a_large_batch(task, count):
    return [
        task.message_with_options(args=(n,), priority=n % 3, max_retries=n % 5)
        if n % 2
        else task.message(n)
        for n in range(count)
    ]


def test_a_large_batch_without_conflicts_is_copied_as_the_resolving_path_would_write_it(
    broker, task, queue, schema, conn, resolving, monkeypatch
):
    monkeypatch.setattr(broker.store, "COPY_CHUNK", 120)  # several COPY rounds
    count = broker.store.BULK_COPY_MIN + 101
    copied = broker.enqueue_many(a_large_batch(task, count), delay=1500)
    assert resolving == [], "a batch without conflicts took the resolving path"

    other = f"{queue}_r"
    monkeypatch.setattr(broker.store, "DIRECT_COPY", False)
    resolved = broker.enqueue_many(
        [m.copy(queue_name=other) for m in a_large_batch(task, count)], delay=1500
    )
    assert resolving == [count]

    got, want = job_rows(conn, schema, queue), job_rows(conn, schema, other)
    assert [r["id"] for r in got] == [m.message_id for m in copied], "claim order = order sent"
    assert [r["id"] for r in want] == [m.message_id for m in resolved]
    varying = ("id", "queue_name", "message", "message_bytes", "created_at", "updated_at",
               "available_at")  # fmt: skip
    for mine, theirs in zip(got, want):
        assert {k: v for k, v in mine.items() if k not in varying} == {
            k: v for k, v in theirs.items() if k not in varying
        }
        # The jsonb view is the stored bytes, parsed by the server.
        assert mine["message"] == json.loads(bytes(mine["message_bytes"]))
        assert mine["status"] == "queued" and mine["wait"] == dt.timedelta(milliseconds=1500)
    assert len({r["created_at"] for r in got}) == count, "each row its own created_at"
    assert got[0]["updated_at"] == got[-1]["updated_at"] == got[0]["created_at"]
    events = event_rows(conn, schema, queue)
    assert [e[0] for e in events] == [m.message_id for m in copied]
    assert all(e[1:] == ("created", 0, True) for e in events)
    # Claimed in claim order: priority first, then the order sent.
    first = sorted(got, key=lambda r: (r["priority"], r["created_at"]))[:3]
    claimed = broker.store.claim(queue, 3, "w", 60, now=got[0]["available_at"])
    assert [c.id for c in claimed] == [r["id"] for r in first]


def test_a_conflict_in_a_large_batch_falls_back_without_writing_twice(
    broker, task, queue, schema, conn, resolving, monkeypatch
):
    monkeypatch.setattr(broker.store, "COPY_CHUNK", 100)
    existing = task.send_with_options(args=(-1,), idempotency_key="late-key")
    messages = [task.message(n) for n in range(broker.store.BULK_COPY_MIN + 50)]
    # Far enough in that earlier chunks were already copied when the conflict shows.
    messages[230] = task.message_with_options(args=(230,), idempotency_key="late-key")
    sent = broker.enqueue_many(messages)
    assert resolving == [len(messages)]
    assert sent[230].message_id == existing.message_id
    stored = [r[0] for r in rows(conn, schema, queue)]
    assert len(stored) == len(messages)  # the existing job and every other message once
    assert created_events(conn, schema, queue) == len(stored)


def test_a_repeated_id_in_a_large_batch_is_stored_once(
    broker, task, queue, schema, conn, resolving
):
    messages = [task.message(n) for n in range(broker.store.BULK_COPY_MIN + 10)]
    messages.append(messages[7].copy())
    sent = broker.enqueue_many(messages)
    assert resolving == [len(messages)]
    assert sent[-1].message_id == sent[7].message_id
    assert len(rows(conn, schema, queue)) == len(messages) - 1
    assert created_events(conn, schema, queue) == len(messages) - 1


def test_a_bad_message_late_in_a_large_batch_leaves_nothing_written(
    broker, task, queue, schema, conn, monkeypatch
):
    monkeypatch.setattr(broker.store, "COPY_CHUNK", 100)
    messages = [task.message(n) for n in range(broker.store.BULK_COPY_MIN + 150)]
    # Checked and encoded while earlier chunks are already with the server.
    messages[320] = task.message_with_options(args=(320,), priority=2**31)
    with pytest.raises(InvalidMessage, match="message 320 of the batch: priority must be"):
        broker.enqueue_many(messages)
    assert rows(conn, schema, queue) == []
    assert created_events(conn, schema, queue) == 0


def test_a_large_batch_takes_the_injected_clock_and_stores_other_encoders_bytes(
    broker, task, queue, schema, conn
):
    now = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    jobs = [
        broker.sender.job_for(task.message_with_options(args=(n,), idempotency_key=f"clock-{n}"))[0]
        for n in range(broker.store.BULK_COPY_MIN)
    ]
    jobs[0].message = {"shown": "\ufffd"}  # a display-safe view given by the sender
    jobs[0].message_view_from_bytes = False
    jobs[1].message_bytes = b"\x80\x04opaque"  # another encoder's bytes: no view
    jobs[1].message_view_from_bytes = False
    results = broker.store.enqueue_many(jobs, now=now)
    assert all(r.created for r in results)
    got = job_rows(conn, schema, queue)
    assert got[0]["created_at"] == now and got[-1]["created_at"] == now + dt.timedelta(
        microseconds=len(jobs) - 1
    )
    assert got[0]["message"] == {"shown": "\ufffd"}
    assert got[1]["message"] is None and bytes(got[1]["message_bytes"]) == b"\x80\x04opaque"
    assert [r["idempotency_key"] for r in got] == [f"clock-{n}" for n in range(len(jobs))]


def test_enqueue_hooks_run_for_every_message_of_a_large_batch(broker, task, queue):
    seen = {"before": [], "after": []}

    class Watch(dramatiq.Middleware):
        def before_enqueue(self, broker, message, delay):
            seen["before"].append((message.message_id, delay))

        def after_enqueue(self, broker, message, delay):
            seen["after"].append((message.message_id, delay))

    broker.add_middleware(Watch())
    messages = [task.message(n) for n in range(broker.store.BULK_COPY_MIN + 5)]
    broker.enqueue_many(messages, delay=10)
    expected = [(m.message_id, 10) for m in messages]
    assert seen["before"] == expected and seen["after"] == expected
