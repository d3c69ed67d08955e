"""One claim returns its batch in claim order: priority, then availability, then age; and a
worker whose threads are busy while messages of two priorities are sent one at a time
prefetches them all and runs the higher priority first (Dramatiq's
``test_actors_can_prioritize_work``)."""

from __future__ import annotations

import datetime as dt
import random
import threading
import uuid

import dramatiq

from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.jobs import JobStore, NewJob

from ..helpers import wait_for
from .harness import race, repeatable_read_store


def test_a_batch_comes_back_in_claim_order(pg_url, schema):
    store = JobStore(ProcessPool(Settings.load(url=pg_url, schema=schema)), schema)
    base = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    # (priority, seconds after base): created and available at that moment.
    plan = [(p, s) for p in (0, 5, 10) for s in range(8)]
    random.Random(7).shuffle(plan)
    expected = {}
    for priority, seconds in plan:
        job_id = str(uuid.uuid4())
        expected[job_id] = (priority, seconds)
        store.enqueue(
            NewJob(
                id=job_id,
                queue_name="claim-order",
                actor_name="a",
                message={"args": [], "kwargs": {}, "options": {}},
                priority=priority,
                max_attempts=21,
            ),
            now=base + dt.timedelta(seconds=seconds),
        )

    claimed = store.claim("claim-order", len(plan), "owner-1", 30)

    got = [expected[job.id] for job in claimed]
    assert got == sorted(expected.values()), f"batch order was {got}"
    store.pool.close()


def test_next_available_at_is_the_earliest_across_priorities(pg_url, schema):
    store = JobStore(ProcessPool(Settings.load(url=pg_url, schema=schema)), schema)
    queue = "next-due"
    assert store.next_available_at(queue) is None
    assert store.seconds_until_available(queue) is None
    now = dt.datetime.now(dt.timezone.utc)
    # The earliest job hides behind a higher priority number and later lower-numbered ones.
    for priority, delay_s in [(0, 300), (0, 200), (3, 900), (7, 50), (7, 400), (9, 100)]:
        store.enqueue(
            NewJob(
                id=str(uuid.uuid4()),
                queue_name=queue,
                actor_name="a",
                message={"args": [], "kwargs": {}, "options": {}},
                priority=priority,
                delay_ms=delay_s * 1000,
                max_attempts=21,
            ),
            now=now,
        )

    due = store.next_available_at(queue)
    seconds = store.seconds_until_available(queue)

    assert due == now + dt.timedelta(seconds=50), due
    # By the server's clock (the same machine's here, so within a few seconds of 50).
    assert 40 < seconds <= 50, seconds
    store.pool.close()


def test_a_busy_worker_runs_what_it_prefetched_in_priority_order(h):
    broker = h.broker()
    busy, release = threading.Event(), threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, priority=0)
    def blocker():
        busy.set()
        release.wait(30)

    hi = h.recorder(broker, "hi", priority=0)
    lo = h.recorder(broker, "lo", priority=10)
    h.start(broker, threads=1, prefetch=21)
    blocker.send()
    assert busy.wait(30), "the blocker did not start"
    for _ in range(10):
        lo.send()
        hi.send()
    # Each send is claimed as it comes, up to the prefetch (the blocker's and 20 more): all
    # twenty wait in the worker.
    wait_for(
        lambda: len(broker.ledger) == 21,
        20,
        "the worker to prefetch all 20 messages",
        on_timeout=lambda: f"it holds {len(broker.ledger)} of 21",
    )
    release.set()
    broker.join(h.queue, timeout=30_000)
    assert h.runs == [("hi",)] * 10 + [("lo",)] * 10, h.runs


def test_racing_claims_on_a_repeatable_read_database_claim_each_job_once_without_errors(
    pg_url, schema
):
    """A database whose default isolation is REPEATABLE READ (``ALTER DATABASE ... SET
    default_transaction_isolation``; here the connections' ``options``): a claim statement
    whose snapshot saw a row that a racing claim took and committed meanwhile gets a
    serialization failure from PostgreSQL, where READ COMMITTED would have skipped the row.
    The claim tries again with a new snapshot: twelve claimers racing for five rounds each
    claim without an error, and no job is claimed twice."""
    queue = f"rr-{uuid.uuid4().hex[:8]}"
    claimers, rounds, each = 12, 5, 3
    with repeatable_read_store(pg_url, schema) as store:
        for _ in range(claimers * rounds * each):
            store.enqueue(
                NewJob(
                    id=str(uuid.uuid4()),
                    queue_name=queue,
                    actor_name="a",
                    message={"args": [], "kwargs": {}, "options": {}},
                    max_attempts=21,
                )
            )
        claimed: list[str] = []

        def claim(i: int) -> None:
            got = store.claim_or_wait(queue, each, f"w{i}", 30)
            claimed.extend(job.id for job in got.jobs)

        errors = race(claimers, rounds, claim)
        assert not errors, f"{len(errors)} claims failed: {errors[:3]}"
        assert len(claimed) == len(set(claimed)) == claimers * rounds * each
