"""Pausing a queue, against real PostgreSQL: the claim statement refuses a paused queue,
sends are still accepted, who paused and resumed is recorded, a worker gives back what it
prefetched (uncharged) and claims again at once after the resume."""

from __future__ import annotations

import threading
import time
import uuid

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import current_job
from dramatiq_pg_broker.control import queues as queue_control
from dramatiq_pg_broker.errors import InvalidQueueName, QueueNotDeclared
from dramatiq_pg_broker.jobs import PAUSE_PAYLOAD, JobStore, NewJob, channel_name

from ..helpers import wait_for
from .harness import declared_queue

pytestmark = pytest.mark.timeout(120)


def send(store: JobStore, queue: str) -> str:
    job_id = str(uuid.uuid4())
    store.enqueue(
        NewJob(id=job_id, queue_name=queue, actor_name="tests.a", message={}, max_attempts=21)
    )
    return job_id


def test_a_paused_queue_is_claimed_by_nobody_and_still_accepts_sends(store, pg_url):
    queue = declared_queue(store)
    send(store, queue)
    with psycopg.connect(pg_url, autocommit=True) as listener:
        listener.execute(
            sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(store.schema, queue)))
        )
        with store.pool.connection() as conn:
            state = queue_control.pause(conn, store.schema, queue, by="ops@example.com")
        assert [n.payload for n in listener.notifies(timeout=2, stop_after=1)] == [PAUSE_PAYLOAD]
    assert state.paused and state.paused_by == "ops@example.com" and state.paused_at

    waiting = send(store, queue)  # accepted while paused
    claim = store.claim_or_wait(queue, 10, "worker-1", 30)
    assert claim.jobs == [] and claim.paused
    # Nothing there becomes runnable by itself: no wait is reported (an idle consumer
    # does not spin on a queue full of runnable jobs).
    assert claim.seconds_until_available is None and claim.next_available_at is None
    assert store.get(waiting)["status"] == "queued"

    with store.pool.connection() as conn:
        resumed = queue_control.resume(conn, store.schema, queue, by="lead@example.com")
    assert not resumed.paused and resumed.resumed_by == "lead@example.com"
    assert resumed.paused_by == "ops@example.com", "the last pause stays recorded"
    assert len(store.claim(queue, 10, "worker-1", 30)) == 2
    # Another queue was never paused.
    other = declared_queue(store)
    send(store, other)
    assert len(store.claim(other, 10, "worker-1", 30)) == 1


def test_pausing_twice_keeps_the_first_pause_and_resuming_an_active_queue_does_nothing(store):
    queue = declared_queue(store)
    with store.pool.connection() as conn:
        first = queue_control.pause(conn, store.schema, queue, by="first")
        again = queue_control.pause(conn, store.schema, queue, by="second")
        assert (again.paused_by, again.paused_at) == (first.paused_by, first.paused_at)
        queue_control.resume(conn, store.schema, queue, by="ops")
        twice = queue_control.resume(conn, store.schema, queue, by="someone else")
    assert twice.resumed_by == "ops"


def test_only_a_declared_queue_is_paused_unless_forced(store):
    name = f"ahead_{uuid.uuid4().hex[:8]}"
    with store.pool.connection() as conn:
        with pytest.raises(QueueNotDeclared, match="no worker has declared queue"):
            queue_control.pause(conn, store.schema, name, by="ops")
        with pytest.raises(QueueNotDeclared):
            queue_control.resume(conn, store.schema, name, by="ops")
        with pytest.raises(InvalidQueueName, match="is not a queue name"):
            queue_control.pause(conn, store.schema, "no spaces", by="ops", force=True)
        assert queue_control.get(conn, store.schema, name) is None
        ahead = queue_control.pause(conn, store.schema, name, by="ops", force=True)
        assert ahead.paused
        # A worker that declares it later keeps the pause.
        queue_control.declare(conn, store.schema, [name])
        assert queue_control.get(conn, store.schema, name).paused


def test_a_worker_gives_back_what_it_prefetched_and_resumes_at_once(h, store):
    broker = h.broker()
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def hold(tag):
        h.record("start", current_job().id)
        if tag == "first":
            release.wait(10)

    worker = h.start(broker, threads=1)
    first = hold.send("first").message_id
    wait_for(lambda: h.ran("start", first), 10, "the first message running")
    later = [hold.send(f"later{i}").message_id for i in range(2)]
    # One thread, so a window of two messages: one of the later ones is prefetched.
    wait_for(lambda: any(store.get(i)["status"] == "running" for i in later), 10, "one prefetched")

    with store.pool.connection() as conn:
        queue_control.pause(conn, store.schema, h.queue, by="ops")
    # The prefetched message goes back at once, uncharged; the running one goes on.
    wait_for(
        lambda: all(store.get(i)["status"] == "queued" for i in later), 2, "prefetched given back"
    )
    assert all(store.get(i)["attempts"] == 0 for i in later)
    assert sorted([e["type"] for e in store.events_of(i)][-1] for i in later) == [
        "created", "released",
    ]  # fmt: skip
    assert store.get(first)["status"] == "running"
    release.set()
    wait_for(lambda: store.get(first)["status"] == "succeeded", 10, "the running job finishing")
    # Ten poll intervals of an idle worker on a paused queue: nothing is claimed.
    time.sleep(1.0)  # the span observed, not a wait for a result
    assert all(store.get(i)["status"] == "queued" for i in later)
    assert not any(h.ran("start", i) for i in later)

    resumed_at = time.monotonic()
    with store.pool.connection() as conn:
        queue_control.resume(conn, store.schema, h.queue, by="ops")
    wait_for(
        lambda: all(store.get(i)["status"] == "succeeded" for i in later), 5, "the queue draining"
    )
    assert time.monotonic() - resumed_at < 2
    worker.join()
