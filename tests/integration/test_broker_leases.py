"""Leases: the reaper gives back unstarted claims, requeues or fails interrupted attempts,
and a stale worker changes nothing.

Time is injected with ``now=`` (a clock far ahead of the server's), never slept.
"""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from dramatiq_pg_broker import Attempt
from dramatiq_pg_broker.backoff import backoff_table
from dramatiq_pg_broker.jobs import NewJob

BASE_MS = 1000
MAX_MS = 10_000
LEASE = 30


@pytest.fixture
def clock():
    """A start time an hour ahead, so that every injected instant is after the server's
    now() at insert time."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0) + dt.timedelta(hours=1)


def at(clock, seconds):
    return clock + dt.timedelta(seconds=seconds)


def new_job(store, *, max_attempts=3):
    queue = f"q_{uuid.uuid4().hex[:8]}"
    job_id = str(uuid.uuid4())
    store.enqueue(
        NewJob(
            id=job_id,
            queue_name=queue,
            actor_name="a",
            message={"x": 1},
            max_attempts=max_attempts,
        )
    )
    return job_id, queue


def claim(store, queue, owner, now, *, start=True):
    """Claim the queue's job; ``start`` also records that its actor started."""
    jobs = store.claim(queue, 1, owner, LEASE, now=now)
    assert len(jobs) == 1, f"{owner} could not claim at {now}"
    attempt = Attempt(jobs[0].id, owner, jobs[0].attempts)
    if start:
        assert store.start([attempt], LEASE, now=now) == {attempt.id}
    return attempt


def reap(store, now, max_interruptions=10):
    return store.reap(
        batch=100,
        backoff_ms=backoff_table(BASE_MS, MAX_MS),
        max_interruptions=max_interruptions,
        lease_seconds=LEASE,
        now=now,
    )


def test_reaper_leaves_live_leases_alone(store, clock):
    job_id, queue = new_job(store)
    claim(store, queue, "A", clock)
    result = reap(store, at(clock, LEASE - 1))
    assert job_id not in result.requeued + result.failed
    assert store.get(job_id)["status"] == "running"


def test_reaper_gives_back_an_unstarted_claim_uncharged_at_once(store, clock):
    job_id, queue = new_job(store, max_attempts=1)
    claim(store, queue, "A", clock, start=False)
    reap_at = at(clock, LEASE + 1)
    result = reap(store, reap_at)
    assert job_id in result.released and job_id not in result.requeued + result.failed
    row = store.get(job_id)
    assert (row["status"], row["attempts"], row["failures"], row["interruptions"]) == (
        "queued",
        0,
        0,
        0,
    ), "a claim that never started was charged"
    assert row["available_at"] == reap_at
    assert row["last_error"] is None
    assert store.events_of(job_id)[-1]["type"] == "released"


def test_an_abandoned_claim_is_counted_and_the_next_claim_carries_the_count(store, clock):
    """A lease that expired with no start recorded: uncharged, but counted, so that the
    next worker records the start before the actor runs."""
    job_id, queue = new_job(store, max_attempts=1)
    claim(store, queue, "A", clock, start=False)
    reap(store, at(clock, LEASE + 1))
    assert store.get(job_id)["abandoned_claims"] == 1
    (again,) = store.claim(queue, 1, "B", LEASE, now=at(clock, LEASE + 2))
    assert (again.attempts, again.abandoned_claims) == (1, 1)
    attempt = Attempt(job_id, "B", again.attempts)
    # A start recorded after the actor began leaves the lease as it was.
    assert store.start([attempt], None, now=at(clock, LEASE + 3)) == {job_id}
    row = store.get(job_id)
    assert row["started"] and row["locked_until"] == at(clock, 2 * LEASE + 2)
    reap(store, at(clock, 2 * LEASE + 3))
    row = store.get(job_id)
    assert (row["interruptions"], row["abandoned_claims"]) == (1, 1), "a started attempt died"


def test_a_claim_that_finds_nothing_says_when_the_next_job_is_due(store, clock):
    job_id, queue = new_job(store)
    claim(store, queue, "A", clock)
    empty = store.claim_or_wait(queue, 5, "B", LEASE, now=clock)
    assert empty.jobs == [] and empty.next_available_at is None
    store.enqueue(NewJob(id=str(uuid.uuid4()), queue_name=queue, actor_name="a",
                         message={}, delay_ms=60_000, max_attempts=21), now=clock)  # fmt: skip
    due = store.claim_or_wait(queue, 5, "B", LEASE, now=clock)
    assert due.jobs == [] and due.next_available_at is not None
    assert due.seconds_until_available == pytest.approx(
        (due.next_available_at - clock).total_seconds()
    )


def test_reaper_requeues_an_interrupted_attempt_with_backoff(store, clock):
    job_id, queue = new_job(store, max_attempts=1)
    claim(store, queue, "A", clock)
    reap_at = at(clock, LEASE + 1)
    result = reap(store, reap_at)
    assert job_id in result.requeued
    row = store.get(job_id)
    assert row["status"] == "queued", "an interruption was taken for a failure"
    assert (row["attempts"], row["failures"], row["interruptions"]) == (1, 0, 1)
    assert row["locked_by"] is None and row["locked_until"] is None
    assert row["available_at"] == reap_at + dt.timedelta(milliseconds=BASE_MS)
    assert "lease expired" in row["last_error"] and "A" in row["last_error"]
    event = store.events_of(job_id)[-1]
    assert event["type"] == "timeout_requeued"
    assert (event["attempt"], event["actor"]) == (1, "A")

    # Not claimable during the backoff; the second expiry doubles it.
    assert store.claim(queue, 1, "B", LEASE, now=at(reap_at, 0.5)) == []
    second = claim(store, queue, "B", at(reap_at, 1))
    assert second.attempt == 2
    reap_again = at(reap_at, 1 + LEASE + 1)
    reap(store, reap_again)
    assert store.get(job_id)["available_at"] == reap_again + dt.timedelta(milliseconds=2 * BASE_MS)


def test_reaper_fails_the_job_when_interruptions_are_exhausted(store, clock):
    job_id, queue = new_job(store, max_attempts=2)
    claim(store, queue, "A", clock)
    reap(store, at(clock, LEASE + 1), max_interruptions=2)
    claim(store, queue, "B", at(clock, LEASE + 10))
    finish = at(clock, 2 * LEASE + 20)
    result = reap(store, finish, max_interruptions=2)
    assert job_id in result.failed
    assert [j.id for j in result.failed_jobs] == [job_id]
    assert result.failed_jobs[0].actor_name == "a"
    row = store.get(job_id)
    assert (row["status"], row["attempts"], row["interruptions"]) == ("failed", 2, 2)
    assert "interrupted 2 times (the limit)" in row["last_error"], row["last_error"]
    assert row["finished_at"] == finish
    assert row["locked_by"] is None
    types = [e["type"] for e in store.events_of(job_id)]
    assert types == ["created", "claimed", "timeout_requeued", "claimed", "failed"]
    assert store.claim(queue, 1, "C", LEASE, now=at(finish, 3600)) == [], "a failed job ran"


def test_reaper_backoff_doubles_and_is_capped(store, clock):
    job_id, queue = new_job(store, max_attempts=10)
    now = clock
    delays = []
    for _ in range(6):
        claim(store, queue, "A", now)
        now = at(now, LEASE + 1)
        reap(store, now)
        available_at = store.get(job_id)["available_at"]
        delays.append(int((available_at - now) / dt.timedelta(milliseconds=1)))
        now = available_at
    assert delays == [1000, 2000, 4000, 8000, 10_000, 10_000]
    assert store.get(job_id)["attempts"] == 6


def snapshot(store, job_id):
    row = store.get(job_id)
    return row, [e["id"] for e in store.events_of(job_id)]


def test_stale_worker_changes_nothing_after_another_worker_claimed_the_next_attempt(store, clock):
    job_id, queue = new_job(store, max_attempts=3)
    stale = claim(store, queue, "worker-A", clock)
    reap(store, at(clock, LEASE + 1))
    current = claim(store, queue, "worker-B", at(clock, LEASE + 5))
    assert current.attempt == 2

    before = snapshot(store, job_id)
    late = at(clock, LEASE + 6)
    assert store.complete([stale], now=late) == set(), "stale ack was applied"
    assert store.fail([stale], ["boom"], now=late) == set(), "stale nack was applied"
    assert store.renew([stale], LEASE, record=True, now=late) == set(), "stale renewal applied"
    assert store.progress(stale, {"step": 1}, LEASE, now=late) is False, "stale progress applied"
    assert store.reschedule(stale, queue, 0, "err", now=late) is False
    assert store.release([stale], now=late) == set()
    # Same owner, wrong attempt; right attempt, wrong owner: both are stale too.
    assert store.complete([Attempt(job_id, "worker-A", 2)], now=late) == set()
    assert store.complete([Attempt(job_id, "worker-B", 1)], now=late) == set()
    assert snapshot(store, job_id) == before, "a stale worker changed the row or its events"

    # The current owner still can.
    assert store.progress(current, {"step": 1}, LEASE, now=late) is True
    assert store.complete([current], now=at(late, 1)) == {job_id}
    row = store.get(job_id)
    assert (row["status"], row["attempts"]) == ("succeeded", 2)
    succeeded = [e for e in store.events_of(job_id) if e["type"] == "succeeded"]
    assert [(e["attempt"], e["actor"]) for e in succeeded] == [(2, "worker-B")]


def test_stale_worker_cannot_touch_a_job_the_reaper_requeued(store, clock):
    job_id, queue = new_job(store, max_attempts=3)
    stale = claim(store, queue, "worker-A", clock)
    reap(store, at(clock, LEASE + 1))
    before = snapshot(store, job_id)
    late = at(clock, LEASE + 2)
    assert store.complete([stale], now=late) == set()
    assert store.renew([stale], LEASE, now=late) == set()
    assert snapshot(store, job_id) == before
    assert before[0]["status"] == "queued"


def test_renewal_and_progress_keep_a_lease_alive(store, clock):
    job_id, queue = new_job(store)
    attempt = claim(store, queue, "A", clock)
    assert store.renew([attempt], LEASE, record=True, now=at(clock, LEASE - 1)) == {job_id}
    assert store.progress(attempt, {"done": 5}, LEASE, now=at(clock, 2 * LEASE - 2)) is True
    # Without those the lease would have expired at clock + LEASE.
    result = reap(store, at(clock, 3 * LEASE - 3))
    assert job_id not in result.requeued + result.failed
    row = store.get(job_id)
    assert row["locked_until"] == at(clock, 3 * LEASE - 2)
    events = store.events_of(job_id)
    assert [e["type"] for e in events][-2:] == ["lease_renewed", "progress"]
    assert events[-1]["data"] == {"done": 5}
    # The heartbeat's renewals are silent.
    store.renew([attempt], LEASE, now=at(clock, 3 * LEASE - 2))
    assert len(store.events_of(job_id)) == len(events)
