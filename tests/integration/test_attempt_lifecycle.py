"""An attempt's life in a worker process: the in-flight ledger, what counts as an attempt,
a failure or an interruption, and the outcomes Dramatiq's hooks see."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

import dramatiq
import psycopg
import pytest
from dramatiq.results import ResultFailure, ResultMissing, Results
from dramatiq.results.backends import StubBackend

from dramatiq_pg_broker import Attempt, current_job
from dramatiq_pg_broker.attempt.states import State
from dramatiq_pg_broker.db import CappedAttempt, translate_errors
from dramatiq_pg_broker.jobs import NewJob

from ..helpers import wait_for


def row(broker, message):
    return broker.store.get(message.message_id)


def events(broker, message):
    return [e["type"] for e in broker.store.events_of(message.message_id)]


class Unprintable(Exception):
    """An exception whose str() raises, as some API clients' do."""

    def __str__(self):
        raise KeyError("body has no 'detail'")


# -- 1: an exception whose str() raises ---------------------------------------------------


def test_an_exception_whose_str_raises_is_a_failure_with_or_without_retries_left(h):
    broker = h.broker()
    ran = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=1, min_backoff=10)
    def flaky():
        ran.append("flaky")
        raise Unprintable()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def hopeless(n):
        ran.append(n)
        raise Unprintable()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0, priority=100)
    def after():
        ran.append("after")

    first = flaky.send()
    others = [hopeless.send(n) for n in range(2)]
    last = after.send()
    h.start(broker, threads=1)
    broker.join(h.queue, timeout=20_000)
    assert broker.outcomes.flush(timeout=5)

    retried = row(broker, first)
    assert (retried["status"], retried["failures"]) == ("failed", 2), (
        "an attempt that raised was recorded as a success"
    )
    assert "retry_scheduled" in events(broker, first)
    assert "<exception str() failed>" in retried["last_error"]
    for message in others:
        assert row(broker, message)["status"] == "failed"
    assert row(broker, last)["status"] == "succeeded", "two such jobs stalled the queue"
    assert len(broker.ledger) == 0, "an attempt is still held (renewed, slot taken)"


# -- 3: an error text that cannot be encoded -----------------------------------------------


def test_an_unencodable_error_text_loses_no_other_outcome(h):
    broker = h.broker()
    runs = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def bad_name():
        runs.append("bad")
        raise FileNotFoundError("no such file: report-\udcff.csv")

    @dramatiq.actor(broker=broker, queue_name=h.queue, throws=(ValueError,))
    def never_retry(n):
        runs.append(n)
        raise ValueError(f"refused {n}")

    bad = bad_name.send()
    plain = [never_retry.send(n) for n in range(5)]
    h.start(broker, threads=4)
    broker.join(h.queue, timeout=15_000)
    assert broker.outcomes.flush(timeout=5)

    stored = row(broker, bad)
    assert stored["status"] == "failed"
    assert "report-\\udcff.csv" in stored["last_error"]
    for n, message in enumerate(plain):
        assert (row(broker, message)["status"], row(broker, message)["last_error"]) == (
            "failed",
            f"ValueError: refused {n}",
        )
    assert sorted(r for r in runs if r != "bad") == list(range(5)), "a throws= job ran again"


def test_a_batch_the_database_refuses_is_written_one_outcome_at_a_time(h):
    broker = h.broker()
    real_fail = broker.store.fail
    poisoned: set[str] = set()

    def fail_refusing_the_poisoned(attempts, errors, **kwargs):
        if poisoned & {a.id for a in attempts}:
            raise psycopg.errors.DataError("value refused")
        return real_fail(attempts, errors, **kwargs)

    broker.store.fail = fail_refusing_the_poisoned

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def boom(n):
        raise RuntimeError(f"boom {n}")

    messages = [boom.send(n) for n in range(6)]
    poisoned.add(messages[2].message_id)
    # Every outcome is queued before the writer starts, so they share one batch.
    consumer = broker.consume(h.queue, prefetch=6, timeout=1000)
    proxies = [next(consumer) for _ in messages]
    for proxy in proxies:
        assert broker.ledger.start(proxy.attempt)
        proxy.fail()
        consumer.nack(proxy)
    assert broker.outcomes.flush(timeout=10)
    statuses = {m.message_id: row(broker, m)["status"] for m in messages}
    assert statuses.pop(messages[2].message_id) == "running"
    assert set(statuses.values()) == {"failed"}, statuses
    assert len(broker.ledger) == 0
    consumer.close()


# -- the ledger refuses illegal moves, and unwritten outcomes hold their slots ------------------


def test_a_reschedule_is_written_by_the_ack_and_the_ledger_refuses_a_second_outcome(h):
    broker = h.broker()
    noop = h.noop(broker)
    first, second = noop.send(1), noop.send(2)
    consumer = broker.consume(h.queue, prefetch=2, timeout=1000)
    a, b = next(consumer), next(consumer)
    assert broker.ledger.start(a.attempt) and broker.ledger.start(b.attempt)
    assert broker.sender.reschedule(a, 60_000, "later")
    assert row(broker, first)["status"] == "running", "the retry was written before the ack"
    assert broker.ledger.settle(a.attempt, "complete") is True, "the ack writes the retry"
    assert row(broker, first)["status"] == "queued"
    assert broker.ledger.settle(a.attempt, "fail", "no") is False, "a second outcome"
    assert broker.ledger.settle(b.attempt, "fail", "no") is True
    assert broker.ledger.settle(b.attempt, "complete") is False, "a second outcome"
    assert broker.outcomes.flush(timeout=5)
    assert row(broker, first)["status"] == "queued"
    assert row(broker, second)["status"] == "failed"
    assert broker.ledger.start(a.attempt) is False, "a rescheduled attempt started"
    consumer.close()


def _stall_completes(broker) -> threading.Event:
    """Make the outcome writer's completes wait (up to 10 s) until the returned event is
    set: outcomes pile up unwritten."""
    gate = threading.Event()
    real_complete = broker.store.complete

    def stalled_complete(attempts, **kwargs):
        gate.wait(10)
        return real_complete(attempts, **kwargs)

    broker.store.complete = stalled_complete
    return gate


def test_unwritten_outcomes_are_bounded_by_the_prefetch(h):
    """With the writer stuck, a consumer with prefetch 2 may run 2 more messages on the
    write-behind allowance, then no more: 4 unwritten outcomes at most, 2 of them holding
    their slots. (The claim window stays at the prefetch: prefetch_growth=1.)"""
    broker = h.broker(prefetch_growth=1)
    gate = _stall_completes(broker)
    noop = h.noop(broker)
    for n in range(6):
        noop.send(n)
    consumer = broker.consume(h.queue, prefetch=2, timeout=300)
    for expected_in_use in (0, 2):
        for _ in range(2):
            proxy = next(consumer)
            assert proxy is not None, "the allowance did not let the next claim through"
            assert broker.ledger.start(proxy.attempt)
            consumer.ack(proxy)
        assert consumer.slots.in_use == expected_in_use
    assert next(consumer) is None, "ran past twice the prefetch while outcomes were unwritten"
    assert len(broker.ledger) == 4
    gate.set()
    assert broker.outcomes.flush(timeout=5)
    assert consumer.slots.in_use == 0 and len(broker.ledger) == 0
    assert next(consumer) is not None
    consumer.close()


# -- 4: a job the reaper fails ends like one whose actor raised -----------------------------


def test_a_job_failed_by_the_reaper_runs_dramatiqs_failure_hooks(h):
    backend = StubBackend()
    broker = h.broker(lease_seconds=1, reaper_interval=0.2, max_interruptions=1)
    broker.add_middleware(Results(backend=backend))
    seen = {}

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def exhausted(message_data, retry_info):
        seen["exhausted"] = (message_data["message_id"], retry_info)

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def on_failure_callback(message_data, exception_data):
        seen["on_failure"] = (message_data["message_id"], exception_data["type"])

    @dramatiq.actor(
        broker=broker,
        queue_name=h.queue,
        max_retries=0,
        store_results=True,
        on_retry_exhausted="exhausted",
        priority=-10,
    )
    def victim():
        return "never"

    message = victim.send_with_options(on_failure="on_failure_callback")
    # A worker that started it, then died: its lease runs out.
    (claimed,) = broker.store.claim(h.queue, 1, "dead-worker", 1)
    attempt = Attempt(claimed.id, "dead-worker", claimed.attempts)
    assert broker.store.start([attempt], 1) == {message.message_id}
    h.start(broker, threads=2)
    wait_for(lambda: {"exhausted", "on_failure"} <= set(seen), 20, "both hooks")
    assert seen["exhausted"][0] == message.message_id
    assert seen["on_failure"] == (message.message_id, "JobInterrupted")
    with pytest.raises(ResultFailure) as failure:
        message.get_result(backend=backend, block=True, timeout=5_000)
    assert "interrupted 1 times" in str(failure.value)
    assert row(broker, message)["status"] == "failed"


# -- 7: shutdown returns unstarted messages at once -----------------------------------------


def test_shutdown_returns_unstarted_messages_at_once(h):
    broker = h.broker()
    started = threading.Event()
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, priority=0)
    def long():
        started.set()
        release.wait(20)

    @dramatiq.actor(broker=broker, queue_name=h.queue, priority=10)
    def quick(n):
        pass

    long.send()
    waiting = [quick.send(n) for n in range(3)]
    worker = h.start(broker, threads=1, prefetch=4)
    assert started.wait(10)
    wait_for(lambda: len(broker.ledger) == 4, 10, "the prefetch to fill")
    stopper = threading.Thread(target=worker.stop, kwargs={"timeout": 30_000})
    stopper.start()
    try:
        wait_for(
            lambda: all(row(broker, m)["status"] == "queued" for m in waiting),
            10,
            "the unstarted messages to go back while the long actor still runs",
        )
        for message in waiting:
            stored = row(broker, message)
            assert (stored["attempts"], stored["failures"]) == (0, 0)
            assert "released" in events(broker, message)
    finally:
        release.set()
        stopper.join(30)
    h.workers.remove(worker)


# -- 8: Dramatiq's retry options -------------------------------------------------------------


def test_retries_set_dramatiqs_traceback_and_requeue_timestamp(h):
    broker = h.broker()
    seen = []

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def exhausted(message_data, retry_info):
        seen.append((message_data["options"], retry_info))

    @dramatiq.actor(
        broker=broker,
        queue_name=h.queue,
        max_retries=1,
        min_backoff=10,
        on_retry_exhausted="exhausted",
    )
    def boom():
        raise RuntimeError("boom")

    before = int(time.time() * 1000)
    message = boom.send()
    h.start(broker)
    wait_for(lambda: seen, 15, "on_retry_exhausted")
    options, retry_info = seen[0]
    assert "RuntimeError: boom" in options["traceback"]
    assert options["requeue_timestamp"] >= before
    assert retry_info == {"retries": 1, "max_retries": 1}
    # The hook is sent before the last failure's outcome is written: wait for that.
    wait_for(lambda: row(broker, message)["status"] == "failed", 10, "the job to be failed")
    assert row(broker, message)["failures"] == 2


# -- 11: an idle consumer claims once per poll interval; a release wakes consumers -----------


def test_an_idle_consumer_claims_once_per_poll_interval(h):
    broker = h.broker(poll_interval=1.0)
    broker.declare_queue(h.queue)
    claims = []
    real_claim = broker.store.claim

    def counting_claim(*args, **kwargs):
        claims.append(time.monotonic())
        return real_claim(*args, **kwargs)

    broker.store.claim = counting_claim
    consumer = broker.consume(h.queue, prefetch=1, timeout=500)
    started = time.monotonic()
    while time.monotonic() - started < 3.0:
        assert next(consumer) is None
    consumer.close()
    # One claim at the start and one per poll interval after it: 3 or 4, never ~6.
    assert len(claims) <= 4, f"{len(claims)} claims in 3 s with a 1 s poll interval"


def test_a_release_wakes_idle_consumers(h):
    broker = h.broker(poll_interval=30.0)

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def noop():
        pass

    noop.send()
    holder = broker.consume(h.queue, prefetch=1, timeout=1000)
    held = next(holder)
    assert held is not None
    waiter = broker.consume(h.queue, prefetch=1, timeout=5000)
    got = []
    thread = threading.Thread(target=lambda: got.append(next(waiter)))
    thread.start()
    time.sleep(0.3)  # let the waiter claim nothing and go idle on LISTEN
    released_at = time.monotonic()
    holder.requeue([held])
    thread.join(10)
    assert got and got[0] is not None, "the released job was not claimed"
    # Far below the 30 s poll interval: only a notification explains it.
    assert time.monotonic() - released_at < 10.0, "the release sent no notification"
    waiter.close()
    holder.close()


# -- 14: leases that ran out during an outage are not reaped --------------------------------


def test_the_reaper_waits_a_lease_after_the_server_started(h, conn):
    broker = h.broker()
    (boot,) = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
    job_id = str(uuid.uuid4())
    # Claimed and started before the server (re)started; its lease ran out while it was
    # down, so its owner never had a chance to renew it.
    before = boot - dt.timedelta(seconds=10)
    job = NewJob(id=job_id, queue_name=h.queue, actor_name="a", message={}, max_attempts=21)
    broker.store.enqueue(job, now=before)
    (claimed,) = broker.store.claim(h.queue, 1, "owner", 1, now=before)
    attempt = Attempt(job_id, "owner", claimed.attempts)
    assert broker.store.start([attempt], 1, now=before) == {job_id}
    args = {"batch": 10, "backoff_ms": [0], "max_interruptions": 10, "lease_seconds": 30}
    soon = boot + dt.timedelta(seconds=10)
    assert job_id not in broker.store.reap(now=soon, **args).requeued
    later = boot + dt.timedelta(seconds=31)
    assert broker.store.reap(now=later, **args).requeued == [job_id]


def test_a_process_that_lost_the_database_waits_a_lease_before_reaping(h):
    broker = h.broker(lease_seconds=5)

    def unreachable():
        raise dramatiq.errors.ConnectionClosed(OSError("gone"))

    assert broker.leases.guarded(unreachable) is False
    assert broker.leases.reap() is None, "reaped right after an outage"


# -- 15: the pool's reconnection wait is capped; its timeout is a setting --------------------


def test_the_pool_retries_connecting_at_least_twice_a_second():
    attempt = CappedAttempt(timeout=300)
    now = 0.0
    delays = []
    for _ in range(12):
        attempt.update_delay(now)
        delays.append(attempt.delay)
        now += attempt.delay
    assert max(delays) <= 0.5, delays


def test_the_pool_timeout_is_a_setting(h):
    broker = h.broker(pool_timeout=2.5)
    assert broker.pool.get().timeout == 2.5


# -- 16: lock order, and a deadlock is not a lost connection ---------------------------------


def test_a_deadlock_is_not_reported_as_a_lost_connection():
    with pytest.raises(psycopg.errors.DeadlockDetected):
        with translate_errors():
            raise psycopg.errors.DeadlockDetected("deadlock detected")


def test_batch_statements_lock_rows_in_id_order(h, pg_url):
    broker = h.broker()
    broker.declare_queue(h.queue)
    ids = sorted(str(uuid.uuid4()) for _ in range(2))
    # Inserted highest id first, so that neither the heap nor the leases are in id order.
    for job_id in reversed(ids):
        broker.store.enqueue(
            NewJob(id=job_id, queue_name=h.queue, actor_name="a", message={}, max_attempts=21)
        )
    claimed = broker.store.claim(h.queue, 2, "w", 30)
    attempts = [Attempt(c.id, "w", c.attempts) for c in claimed]
    table = f'"{h.schema}".jobs'
    with psycopg.connect(pg_url) as holder, psycopg.connect(pg_url, autocommit=True) as probe:
        # Another transaction holds the higher id: the statement must lock the lower one
        # first, then wait.
        holder.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR UPDATE", (ids[1],))
        done = []
        thread = threading.Thread(target=lambda: done.append(broker.store.renew(attempts, 30)))
        thread.start()

        def lower_is_locked():
            try:
                probe.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR UPDATE NOWAIT", (ids[0],))
                return False
            except psycopg.errors.LockNotAvailable:
                return True

        wait_for(lower_is_locked, 5, "the renewal to lock the lower id while it waits")
        holder.rollback()
        thread.join(10)
    assert done and done[0] == set(ids)


# -- 17: a message whose claim was lost while it waited is not run ---------------------------


def test_a_message_whose_lease_was_lost_while_it_waited_is_not_run(h, conn):
    """A lease is lost only after the heartbeat failed to renew it for a whole lease. The
    worker then no longer trusts it, and records the start before running the message: the
    guarded start finds another owner. The lease is four seconds; neither the heartbeat nor
    the reaper runs before the message's turn comes."""
    backend = StubBackend()
    broker = h.broker(lease_seconds=4, heartbeat_seconds=3.9, reaper_interval=60)
    broker.add_middleware(Results(backend=backend))
    blocker_started = threading.Event()
    release = threading.Event()
    ran = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, priority=0)
    def blocker():
        blocker_started.set()
        release.wait(20)

    @dramatiq.actor(broker=broker, queue_name=h.queue, priority=10, store_results=True)
    def waiting():
        ran.append("waiting")
        return "ran here"

    blocker.send()
    stolen = waiting.send()
    h.start(broker, threads=1, prefetch=2)
    assert blocker_started.wait(10)
    wait_for(lambda: len(broker.ledger) == 2, 10, "the second message to be prefetched")
    # Its lease expired and another worker claimed it, while it waited here.
    conn.execute(
        f'UPDATE "{h.schema}".jobs SET locked_by = %s WHERE id = %s',
        ("another-worker", stolen.message_id),
    )
    # Past half the lease since the claim, with no renewal: the lease is no longer surely
    # held (a monotonic-clock fact, not a hope that something happened meanwhile).
    time.sleep(2.1)
    release.set()
    wait_for(lambda: len(broker.ledger) == 0, 10, "this worker to let go of both")
    assert ran == [], "a message this worker no longer owned was run"
    with pytest.raises(ResultMissing):
        # The job's result is its real owner's to store, not None from this skip.
        backend.get_result(stolen, block=False)
    assert row(broker, stolen)["locked_by"] == "another-worker"
    assert broker.ledger.state_of(Attempt(stolen.message_id, "x", 1)) is State.DONE


# -- 13: priority order across a prefetched batch --------------------------------------------


@pytest.mark.parametrize("by", ["actor", "message"])
def test_messages_sent_while_paused_run_in_priority_order(h, by):
    broker = h.broker()
    order = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, priority=10)
    def low(n):
        order.append(("low", n))

    @dramatiq.actor(broker=broker, queue_name=h.queue, priority=0 if by == "actor" else 10)
    def high(n):
        order.append(("high", n))

    worker = h.start(broker, threads=1, prefetch=20)
    broker.declare_queue(h.queue)
    worker.pause()
    for n in range(10):
        low.send(n)
    for n in range(10):
        if by == "actor":
            high.send(n)
        else:
            high.send_with_options(args=(n,), priority=0)
    worker.resume()
    wait_for(lambda: len(order) == 20, 20, "every message to run")
    assert [kind for kind, _ in order] == ["high"] * 10 + ["low"] * 10, order


# -- starts are written a moment after the actor began, or before it for a suspect job ----


def test_a_running_attempts_start_is_written_while_it_runs(h):
    broker = h.broker()
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def long_job():
        release.wait(20)

    message = long_job.send()
    h.start(broker, threads=1)
    try:
        wait_for(lambda: row(broker, message)["started"], 10, "the start to be written")
    finally:
        release.set()
    broker.join(h.queue, timeout=10_000)
    assert (row(broker, message)["status"], row(broker, message)["attempts"]) == ("succeeded", 1)


def test_a_job_with_an_abandoned_claim_has_its_start_written_before_it_runs(h, conn):
    broker = h.broker()
    seen = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def suspect():
        # What the database says while the actor runs, read on a connection of its own.
        seen.append(row(broker, message)["started"])

    message = suspect.send()
    # A worker claimed it and died before its start was written; the reaper gave it back.
    (claimed,) = broker.store.claim(h.queue, 1, "dead-worker", 30)
    conn.execute(
        f"UPDATE \"{h.schema}\".jobs SET locked_until = now() - interval '1 minute' WHERE id = %s",
        (message.message_id,),
    )
    # The reaper is schema-wide: a job an earlier test of the module left with its lease run
    # out is reaped too, and may fill a batch.
    released: list[str] = []
    while message.message_id not in released:
        result = broker.store.reap(batch=10, backoff_ms=[0], max_interruptions=10, lease_seconds=0)
        assert result.released or result.requeued or result.failed, "the claim was not reaped"
        released += result.released
    assert row(broker, message)["abandoned_claims"] == 1
    h.start(broker, threads=1)
    broker.join(h.queue, timeout=10_000)
    assert seen == [True], "the start was not written before the actor ran"
    final = row(broker, message)
    assert (final["status"], final["attempts"], final["interruptions"]) == ("succeeded", 1, 0)


def test_an_attempt_let_go_before_its_start_was_written_counts_as_interrupted(h, monkeypatch):
    """A failed attempt whose retry cannot be written is let go at once, before the
    worker wrote its start: the start is written still, so that the reaper counts an
    interruption (and the next attempt is number 2), not an abandoned claim."""
    broker = h.broker(lease_seconds=1.0, reaper_interval=0.2, backoff_base_ms=50, backoff_max_ms=50)
    real_reschedule = broker.store.reschedule

    def refuse_the_first(attempt, *args, **kwargs):
        if attempt.attempt == 1:
            raise dramatiq.errors.ConnectionClosed(OSError("server went away"))
        return real_reschedule(attempt, *args, **kwargs)

    monkeypatch.setattr(broker.store, "reschedule", refuse_the_first)

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=3, min_backoff=50)
    def fails_at_once():
        h.record(current_job().attempt)
        if current_job().attempt == 1:
            raise ValueError("first attempt fails")

    message = fails_at_once.send()
    h.start(broker)
    broker.join(h.queue, timeout=20_000)
    final = row(broker, message)
    assert (final["status"], final["attempts"], final["interruptions"]) == ("succeeded", 2, 1)
    assert final["abandoned_claims"] == 0
    assert [attempt for (attempt,) in h.runs] == [1, 2]


# -- the claim window grows for short jobs, and only for them -------------------------------


def test_outcomes_behind_a_shrunken_window_count_as_held(h):
    """When the window shrinks below the outcomes already waiting for the writer, the
    excess holds slots: the consumer claims nothing until the writer catches up, so it
    never runs more than twice its window ahead of what the database recorded."""
    broker = h.broker(prefetch_growth=4)
    gate = _stall_completes(broker)
    noop = h.noop(broker)
    broker.enqueue_many([noop.message(n) for n in range(20)])
    consumer = broker.consume(h.queue, prefetch=2, timeout=300)
    try:
        consumer.claim_window.size = consumer.slots.allowance = 8
        for _ in range(8):
            proxy = next(consumer)
            assert proxy is not None
            assert broker.ledger.start(proxy.attempt)
            consumer.ack(proxy)
        assert consumer.slots.in_use == 0 and len(broker.ledger) == 8
        # The queue looks dry to the window logic: it falls back to the prefetch (2), and
        # 6 of the 8 outcomes behind now count as held.
        now = time.monotonic()
        consumer.claim_window.claimed(sent=now, returned=now, full=False, starved=False)
        assert next(consumer) is None, "claimed while 8 outcomes were unwritten, window 2"
        assert consumer.window == 2 and consumer.slots.held == 6
        gate.set()
        assert broker.outcomes.flush(timeout=5)
        assert consumer.slots.held == 0
        assert next(consumer) is not None
    finally:
        gate.set()
        consumer.close()


def test_a_consumer_with_short_jobs_claims_more_than_its_prefetch_and_only_then(h):
    broker = h.broker(prefetch_growth=4)
    short = h.noop(broker)
    broker.enqueue_many([short.message(n) for n in range(200)])
    consumer = broker.consume(h.queue, prefetch=2, timeout=1000)
    biggest = 0
    try:
        for _ in range(200):
            proxy = next(consumer)
            assert proxy is not None
            biggest = max(biggest, consumer.slots.in_use)
            assert broker.ledger.start(proxy.attempt)
            consumer.ack(proxy)
        assert 2 < biggest <= 8, f"held {biggest} messages at most with a prefetch of 2"
    finally:
        consumer.close()


def test_the_next_batch_is_claimed_while_the_last_one_runs(h):
    """Claims take at most half the window, and the next one goes out as soon as a batch
    is handed over: a consumer never waits for its batch to finish before claiming."""
    broker = h.broker(prefetch_growth=1)
    running = h.noop(broker)
    broker.enqueue_many([running.message(n) for n in range(10)])
    claims = []
    real_claim = broker.store.claim_or_wait

    def counting_claim(queue_name, limit, *args, **kwargs):
        claims.append(limit)
        return real_claim(queue_name, limit, *args, **kwargs)

    broker.store.claim_or_wait = counting_claim
    consumer = broker.consume(h.queue, prefetch=4, timeout=300)
    try:
        held = [next(consumer) for _ in range(4)]
        assert all(proxy is not None for proxy in held), "the second batch was not claimed"
        assert claims == [2, 2], f"claims of {claims} rows for a window of 4"
        assert consumer.slots.in_use == 4
        # Nothing acked yet: the window is full, and no claim goes out.
        assert next(consumer) is None
        assert claims == [2, 2]
        for proxy in held[:2]:
            assert broker.ledger.start(proxy.attempt)
            consumer.ack(proxy)
        assert next(consumer) is not None
        assert claims == [2, 2, 2]
    finally:
        consumer.close()
