"""An operator's abort reaching an in-process worker: the actor is interrupted (or, declared
``interrupt_on_abort=False``, checks for itself), the job ends cancelled when its thread
leaves the actor (within moments, unless the thread is blocked in a call) with an
``aborted`` event naming who asked, and it is never retried nor run again. With NOTIFY
(the queue's channel) and without it (the lease heartbeat)."""

from __future__ import annotations

import threading
import time

import dramatiq
import pytest

from dramatiq_pg_broker import current_job
from dramatiq_pg_broker.errors import JobAborted

from ..helpers import wait_for
from .harness import Harness

pytestmark = pytest.mark.timeout(120)


def declare_actors(h: Harness, broker):
    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=3, min_backoff=100)
    def spin():
        job_id = current_job().id
        h.record("start", job_id)
        try:
            while True:
                pass
        except JobAborted:
            h.record("interrupted", job_id)
            raise

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=3, min_backoff=100)
    def nap(seconds: float):
        job_id = current_job().id
        h.record("start", job_id)
        time.sleep(seconds)
        h.record("after sleep", job_id)

    return spin, nap


def events(broker, job_id):
    return [(e["type"], e["actor"]) for e in broker.store.events_of(job_id)]


def settle(broker, worker) -> None:
    """Wait until the worker processed every message it took and its outcomes are
    written."""
    worker.join()
    assert broker.outcomes.flush(timeout=10), "outcomes not written"


def abort_and_time(broker, job_id: str, by: str = "ops") -> float:
    """Abort, then return the seconds until the job was cancelled (at most 2)."""
    started = time.monotonic()
    broker.store.abort(job_id, by=by)
    wait_for(lambda: broker.store.get(job_id)["status"] == "cancelled", 2, "the job cancelled")
    return time.monotonic() - started


def test_an_actor_in_a_busy_loop_is_interrupted_and_never_retried(h):
    broker = h.broker()
    spin, _ = declare_actors(h, broker)
    worker = h.start(broker)
    job_id = spin.send().message_id
    wait_for(lambda: h.ran("start", job_id), 10, "the actor starting")

    took = abort_and_time(broker, job_id)

    assert took < 2, f"the job was cancelled {took:.2f}s after the abort"
    wait_for(lambda: h.ran("interrupted", job_id), 5, "JobAborted raised in the actor")
    settle(broker, worker)  # every message processed: a retry would be written by now
    assert broker.store.get(job_id)["status"] == "cancelled"
    assert events(broker, job_id)[2:] == [("abort_requested", "ops"), ("aborted", "ops")]
    assert [t for t, _ in events(broker, job_id)[:2]] == ["created", "claimed"]
    assert h.ran("start", job_id) == 1


def test_a_job_blocked_in_sleep_stays_running_until_the_call_returns(h):
    broker = h.broker()
    _, nap = declare_actors(h, broker)
    worker = h.start(broker)
    sent = time.monotonic()
    job_id = nap.send(1.5).message_id
    wait_for(lambda: h.ran("start", job_id), 10, "the actor starting")

    job = broker.store.abort(job_id, by="ops")
    assert job["status"] == "running" and job["abort_requested_by"] == "ops"
    wait_for(lambda: broker.store.get(job_id)["status"] == "cancelled", 5, "the job cancelled")

    # No exception interrupts a system call: the thread still sleeps, so the job is still
    # running (and holds its place under a queue limit) until the call returns; the
    # exception then fires before the next line, and the job ends cancelled.
    assert time.monotonic() - sent >= 1.5, "cancelled while its thread still slept"
    assert not h.ran("after sleep", job_id)
    settle(broker, worker)
    assert not h.ran("after sleep", job_id)
    assert broker.store.get(job_id)["status"] == "cancelled"
    assert [t for t, _ in events(broker, job_id)][-2:] == ["abort_requested", "aborted"]


def test_without_notify_the_heartbeat_delivers_the_abort(h):
    broker = h.broker(listen=False, lease_seconds=1.5)  # a heartbeat every 0.5 s
    spin, _ = declare_actors(h, broker)
    worker = h.start(broker)
    job_id = spin.send().message_id
    wait_for(lambda: h.ran("start", job_id), 10, "the actor starting")

    took = abort_and_time(broker, job_id)

    assert took < 2
    wait_for(lambda: h.ran("interrupted", job_id), 5, "JobAborted raised in the actor")
    settle(broker, worker)
    assert broker.store.get(job_id)["status"] == "cancelled"


def test_an_actor_that_checks_for_itself_stops_where_it_chooses(h):
    broker = h.broker()
    checked = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, interrupt_on_abort=False, max_retries=3)
    def careful():
        job = current_job()
        h.record("start", job.id)
        while True:
            try:
                job.raise_if_aborted()
            except JobAborted:
                h.record("stopped itself", job.id)
                raise
            time.sleep(0.01)

    @dramatiq.actor(broker=broker, queue_name=h.queue, interrupt_on_abort=False, max_retries=3)
    def stubborn():
        job = current_job()
        h.record("start", job.id)
        while not job.abort_requested:
            time.sleep(0.01)
        checked.set()
        return "finished anyway"

    worker = h.start(broker)
    first, second = careful.send().message_id, stubborn.send().message_id
    wait_for(lambda: h.ran("start", first) and h.ran("start", second), 10, "both started")

    # The request is seen by the actor; the job ends when it stops.
    abort_and_time(broker, first)
    assert h.ran("stopped itself", first) == 1
    broker.store.abort(second, by="ops")
    assert checked.wait(5), "the actor never saw the abort"
    settle(broker, worker)
    # An actor that returns normally after the request succeeded: the request is history.
    job = broker.store.get(second)
    assert job["status"] == "succeeded" and job["abort_requested_by"] == "ops"
    assert broker.store.get(first)["status"] == "cancelled"


def test_a_prefetched_message_is_cancelled_without_running(h):
    broker = h.broker()
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def hold(tag):
        h.record("start", current_job().id)
        release.wait(10)

    worker = h.start(broker, threads=1)
    busy = hold.send("busy").message_id
    wait_for(lambda: h.ran("start", busy), 10, "the first message running")
    waiting = hold.send("waiting").message_id
    wait_for(lambda: broker.store.get(waiting)["status"] == "running", 10, "the second prefetched")

    abort_and_time(broker, waiting)
    release.set()
    settle(broker, worker)
    assert h.ran("start", waiting) == 0, "an aborted message ran"
    assert broker.store.get(busy)["status"] == "succeeded"
    assert [t for t, _ in events(broker, waiting)] == [
        "created", "claimed", "abort_requested", "aborted",
    ]  # fmt: skip
