"""Outcomes that cannot be written as they are never leave a job running forever."""

from __future__ import annotations

import time

import dramatiq
from dramatiq.errors import ConnectionClosed


def wait_for_status(broker, job_id, status, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = broker.store.get(job_id)
        if row["status"] == status:
            return row
        time.sleep(0.05)
    return broker.store.get(job_id)


def test_an_error_text_with_a_nul_character_is_dead_lettered(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def boom():
        raise ValueError("bad\x00bytes")

    message = boom.send()
    h.start(broker, threads=1)
    row = wait_for_status(broker, message.message_id, "failed")
    assert row["status"] == "failed"
    assert "ValueError" in row["last_error"]
    assert broker.outcomes.flush(timeout=5)


def test_a_retry_with_a_nul_character_in_its_error_is_rescheduled(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=1, min_backoff=10)
    def boom():
        raise ValueError("bad\x00bytes")

    message = boom.send()
    h.start(broker, threads=1)
    broker.join(h.queue, timeout=15_000)
    row = broker.store.get(message.message_id)
    assert (row["status"], row["attempts"]) == ("failed", 2)
    types = [e["type"] for e in broker.store.events_of(message.message_id)]
    assert "retry_scheduled" in types


def test_an_unexpected_write_error_does_not_stop_the_outcome_writer(h):
    broker = h.broker()
    seen = []

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def ok(n):
        seen.append(n)

    real_complete = broker.store.complete
    calls = {"n": 0}

    def complete_failing_once(attempts, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("unexpected")
        return real_complete(attempts, **kwargs)

    broker.store.complete = complete_failing_once
    first = ok.send(1)
    h.start(broker, threads=1)
    deadline = time.monotonic() + 10
    # Until the failing write was attempted: the actor having run is not enough, its
    # outcome may not be queued for the writer yet (and flush would have nothing to wait on).
    while calls["n"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert seen and calls["n"] >= 1, "the actor's outcome was never written"
    # The batch that could not be written is given up (its lease expires; it runs again),
    # and the writer neither hangs nor keeps renewing the lost attempt.
    assert broker.outcomes.flush(timeout=5)
    assert first.message_id not in {a.id for a in broker.ledger.renewable()}
    second = ok.send(2)
    assert wait_for_status(broker, second.message_id, "succeeded")["status"] == "succeeded"


def test_claimed_messages_that_cannot_be_returned_are_no_longer_renewed(h):
    broker = h.broker()
    ok = h.noop(broker)
    for n in range(3):
        ok.send(n)
    # A claim takes at most half the window: a prefetch of 6 claims all three at once.
    consumer = broker.consume(h.queue, prefetch=6, timeout=1000)
    first = next(consumer)
    assert first is not None
    buffered = [a for a in broker.ledger.renewable() if a != first.attempt]
    assert len(buffered) == 2

    def unreachable(attempts, **kwargs):
        raise ConnectionClosed(OSError("server went away"))

    broker.store.release = unreachable
    consumer.close()
    tracked = set(broker.ledger.renewable())
    # Their leases must be allowed to expire so that the reaper gives them back.
    assert not tracked.intersection(buffered)
    assert first.attempt in tracked
