"""Dramatiq's public behaviour on this broker: actors, options, group, pipeline, the default
middleware, generic and async actors, the current job API, and heartbeat=False.

Workers run in-process (``dramatiq.Worker``); ``broker.join`` waits for a queue to drain.
"""

from __future__ import annotations

import asyncio
import threading
import time

import dramatiq
import pytest
from dramatiq.errors import QueueJoinTimeout
from dramatiq.middleware import AsyncIO, CurrentMessage

from dramatiq_pg_broker import JobFailed, current_job

from ..helpers import wait_for
from .harness import of_type


def booted(broker):
    """What the ``dramatiq`` CLI does in each worker process before starting the worker:
    TimeLimit and ShutdownNotifications start their helpers here."""
    broker.emit_after("process_boot")
    return broker


def status(broker, message):
    return broker.store.get(message.message_id)["status"]


def test_actor_runs_with_args_and_kwargs(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def add(x, y=0, *, label=None):
        h.record(x + y, label)

    messages = [add.send(1, 2, label="a"), add.send_with_options(args=(5,), kwargs={"y": 1})]
    h.start(broker)
    broker.join(h.queue, timeout=10_000)
    assert sorted(h.runs, key=str) == [(3, "a"), (6, None)]
    assert {status(broker, m) for m in messages} == {"succeeded"}
    # Calling the actor directly still runs it synchronously, without the broker.
    add(10, 1, label="direct")
    assert h.runs[-1] == (11, "direct")


def test_send_with_options_delay_runs_later(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def stamp():
        h.record(time.monotonic())

    h.start(broker)
    sent = time.monotonic()
    message = stamp.send_with_options(delay=500)
    broker.join(h.queue, timeout=10_000)
    [(ran,)] = h.runs
    assert ran - sent >= 0.49, f"a message delayed 500ms ran after {ran - sent:.3f}s"
    assert status(broker, message) == "succeeded"


def test_group_runs_every_message(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def square(n):
        h.record(n * n)

    g = dramatiq.group(square.message(n) for n in range(10))
    g.run()
    h.start(broker, threads=3)
    broker.join(h.queue, timeout=10_000)
    assert sorted(r[0] for r in h.runs) == [n * n for n in range(10)]
    assert {status(broker, m) for m in g.children} == {"succeeded"}


def test_pipeline_passes_each_result_on(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def add(x, y):
        return x + y

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def keep(value):
        h.record(value)

    pipe = add.message(1, 2) | add.message(3) | add.message(4) | keep.message()
    pipe.run()
    h.start(broker)
    broker.join(h.queue, timeout=10_000)
    assert h.runs == [(10,)]


def test_time_limit_interrupts_a_long_actor(h):
    broker = booted(h.broker())

    @dramatiq.actor(broker=broker, queue_name=h.queue, time_limit=200, max_retries=0)
    def too_slow():
        h.record("started")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)
        h.record("finished")

    message = too_slow.send()
    h.start(broker)
    broker.join(h.queue, timeout=15_000)
    assert h.runs == [("started",)], "the time limit did not interrupt the actor"
    row = broker.store.get(message.message_id)
    assert row["status"] == "failed"
    assert row["last_error"].startswith("TimeLimitExceeded")


def test_age_limit_fails_an_expired_message_without_running_it(h):
    broker = h.broker()

    # A fresh message must be processed well within max_age even on a loaded machine; the
    # stale one becomes available only after max_age has passed.
    fresh_only = h.recorder(broker, max_age=2_000)
    stale = fresh_only.send_with_options(delay=2_500)
    fresh = fresh_only.send()
    h.start(broker)
    broker.join(h.queue, timeout=10_000)
    assert h.runs == [("ran",)]
    assert status(broker, fresh) == "succeeded"
    row = broker.store.get(stale.message_id)
    assert (row["status"], row["attempts"]) == ("failed", 1)


def test_callbacks_on_success_and_on_failure(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def succeeded(message_data, result):
        h.record("success", message_data["args"], result)

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def failed(message_data, error):
        h.record("failure", message_data["args"], error["type"], error["message"])

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def divide(a, b):
        return a // b

    divide.send_with_options(args=(6, 3), on_success=succeeded, on_failure=failed)
    divide.send_with_options(args=(1, 0), on_success=succeeded, on_failure=failed)
    h.start(broker)
    broker.join(h.queue, timeout=10_000)
    assert sorted(h.runs, key=str) == [
        ("failure", [1, 0], "ZeroDivisionError", "integer division or modulo by zero"),
        ("success", [6, 3], 2),
    ]


def test_shutdown_notification_interrupts_and_the_job_is_not_lost(h):
    broker = booted(h.broker())
    started = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, notify_shutdown=True, min_backoff=1000)
    def long_running():
        attempt = current_job().attempt
        h.record("start", attempt)
        if attempt > 1:
            return
        started.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.01)
        h.record("not interrupted", attempt)

    message = long_running.send()
    worker = h.start(broker)
    assert started.wait(10), "the actor never started"
    stopped_at = time.monotonic()
    worker.stop(timeout=10_000)
    assert time.monotonic() - stopped_at < 5, "shutdown waited for the actor to finish"
    broker.outcomes.flush(timeout=5)
    row = broker.store.get(message.message_id)
    assert (row["status"], row["attempts"]) == ("queued", 1)
    assert row["last_error"].startswith("Shutdown")

    h.start(broker)
    broker.join(h.queue, timeout=10_000)
    assert h.runs == [("start", 1), ("start", 2)]
    assert status(broker, message) == "succeeded"


def test_current_message_is_the_job(h):
    broker = h.broker()
    broker.add_middleware(CurrentMessage())

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def who_am_i():
        h.record(CurrentMessage.get_current_message().message_id, current_job().id)

    message = who_am_i.send()
    h.start(broker)
    broker.join(h.queue, timeout=10_000)
    assert h.runs == [(message.message_id, message.message_id)]


def test_generic_actor(h):
    pg_broker = h.broker()

    class Multiply(dramatiq.GenericActor):
        class Meta:
            abstract = True
            broker = pg_broker
            queue_name = h.queue
            max_retries = 0

        factor = 1

        def perform(self, n):
            h.record(type(self).__name__, n * self.factor)

    class Triple(Multiply):
        factor = 3

    message = Triple.send(7)
    assert Triple.actor_name == "Triple"
    h.start(pg_broker)
    pg_broker.join(h.queue, timeout=10_000)
    assert h.runs == [("Triple", 21)]
    row = pg_broker.store.get(message.message_id)
    assert (row["status"], row["actor_name"], row["max_attempts"]) == ("succeeded", "Triple", 1)


def test_async_actor(h):
    broker = h.broker()
    broker.add_middleware(AsyncIO())

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    async def fetch(n):
        await asyncio.sleep(0.01)
        job = current_job()
        h.record(n, job.id, job.progress({"n": n}))

    messages = [fetch.send(n) for n in range(3)]
    h.start(broker)
    broker.join(h.queue, timeout=10_000)
    assert sorted(h.runs) == [(n, m.message_id, True) for n, m in enumerate(messages)]
    for n, m in enumerate(messages):
        assert status(broker, m) == "succeeded"
        progress = of_type(broker.store.events_of(m.message_id), "progress")
        assert [e["data"] for e in progress] == [{"n": n}]


def test_current_job_progress_and_renew_are_recorded(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def report():
        job = current_job()
        h.record(job.progress({"step": 1, "of": 2}), job.renew(), job.progress({"step": 2}))

    message = report.send()
    h.start(broker)
    broker.join(h.queue, timeout=10_000)
    assert h.runs == [(True, True, True)]
    events = broker.store.events_of(message.message_id)
    assert [e["type"] for e in events] == [
        "created",
        "claimed",
        "progress",
        "lease_renewed",
        "progress",
        "succeeded",
    ]
    assert [e["data"] for e in of_type(events, "progress")] == [{"step": 1, "of": 2}, {"step": 2}]
    assert current_job() is None, "current_job leaked outside the actor"


def test_heartbeat_keeps_long_actors_and_heartbeat_false_lets_the_lease_expire(h):
    # A 2 s lease renewed every 0.67 s: a heartbeat held back for over a second (a busy
    # machine running the suite in parallel) still renews in time; the actors run well past
    # one lease.
    broker = h.broker(lease_seconds=2, reaper_interval=0.2, backoff_base_ms=10, max_interruptions=2)
    finished = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def renewed():
        time.sleep(3.5)
        finished.append("renewed")

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0, heartbeat=False)
    def unrenewed():
        time.sleep(3.5)
        finished.append("unrenewed")

    kept = renewed.send()
    dropped = unrenewed.send()
    h.start(broker, threads=2)
    # The unrenewed actor loses its lease on every attempt: an interruption each time,
    # never a failure, until the interruptions reach their bound.
    wait_for(lambda: len(finished) >= 3, 20, "every attempt to finish")
    assert broker.outcomes.flush(timeout=5)
    broker.join(h.queue, timeout=10_000)

    row = broker.store.get(kept.message_id)
    assert (row["status"], row["attempts"]) == ("succeeded", 1)
    assert not of_type(broker.store.events_of(kept.message_id), "timeout_requeued")

    row = broker.store.get(dropped.message_id)
    assert row["status"] == "failed", "a heartbeat=False actor kept its lease past expiry"
    assert "interrupted 2 times (the limit)" in row["last_error"], row["last_error"]
    assert (row["attempts"], row["failures"], row["interruptions"]) == (2, 0, 2)
    events = broker.store.events_of(dropped.message_id)
    assert not of_type(events, "succeeded"), "the late ack of a lost attempt was written"


def test_join_times_out_and_fails_fast(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def boom():
        raise RuntimeError("boom")

    boom.send_with_options(delay=60_000)
    with pytest.raises(QueueJoinTimeout):
        broker.join(h.queue, timeout=200)
    broker.flush(h.queue)
    broker.join(h.queue, timeout=1_000)

    boom.send()
    boom.send_with_options(delay=60_000)  # keeps the queue unfinished
    h.start(broker)
    with pytest.raises(JobFailed):
        broker.join(h.queue, timeout=10_000, fail_fast=True)
    broker.flush_all()
    broker.join(h.queue, timeout=1_000)
