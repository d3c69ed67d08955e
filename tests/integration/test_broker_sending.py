"""Sending: claim order, delays, eta, idempotency keys and non-JSON encoders."""

from __future__ import annotations

import datetime as dt
import uuid

import dramatiq
import pytest
from dramatiq.common import current_millis

from dramatiq_pg_broker import PostgresBroker


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def claim_one_by_one(broker, queue, *, now=None) -> list[str]:
    """Claim a queue's runnable jobs one statement each: the order the claim query picks."""
    order = []
    while True:
        jobs = broker.store.claim(queue, 1, "test-owner", 60, now=now)
        if not jobs:
            return order
        order.append(jobs[0].id)


def test_claim_order_is_priority_then_availability(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue, priority=5)
    def task(name):
        pass

    def send(name, **options):
        return task.send_with_options(args=(name,), **options).message_id

    # Inserted in an order that is wrong on purpose: neither insertion order nor delay
    # alone gives the expected result.
    ids = {
        "p5_late": send("p5_late", delay=30_000),
        "p5_early": send("p5_early"),
        "p0_late": send("p0_late", priority=0, delay=20_000),
        "p9_early": send("p9_early", priority=9),
        "p0_early": send("p0_early", priority=0),
        "pminus": send("pminus", priority=-3, delay=10_000),
    }
    expected = ["pminus", "p0_early", "p0_late", "p5_early", "p5_late", "p9_early"]
    names = {v: k for k, v in ids.items()}

    # Before the delays pass only the undelayed jobs are runnable, still in priority order.
    base = utcnow()
    early = claim_one_by_one(broker, queue, now=base)
    assert [names[i] for i in early] == ["p0_early", "p5_early", "p9_early"]
    # Give them back uncharged, then look again once every delay has passed.
    released = broker.store.release([_attempt(broker, i) for i in early])
    assert released == set(early)

    later = claim_one_by_one(broker, queue, now=base + dt.timedelta(seconds=31))
    assert [names[i] for i in later] == expected, "claim order is not priority, available_at"


def _attempt(broker, job_id):
    from dramatiq_pg_broker import Attempt

    row = broker.store.get(job_id)
    return Attempt(str(row["id"]), row["locked_by"], row["attempts"])


def test_one_batch_claims_the_first_rows_in_claim_order(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def task(n):
        pass

    ids = [task.send_with_options(args=(n,), priority=n % 3).message_id for n in range(9)]
    now = utcnow() + dt.timedelta(seconds=1)
    batch = broker.store.claim(queue, 4, "owner", 60, now=now)
    # Priority 0 (n = 0, 3, 6) first, then the oldest priority-1 job (n = 1).
    assert [j.id for j in batch] == [ids[0], ids[3], ids[6], ids[1]]
    assert [j.attempts for j in batch] == [1, 1, 1, 1]


def test_delay_sets_available_at_and_the_job_is_not_claimable_before(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def task():
        pass

    before = utcnow()
    message = task.send_with_options(delay=60_000)
    after = utcnow()
    row = broker.store.get(message.message_id)
    assert row["status"] == "queued"
    assert (
        before + dt.timedelta(seconds=59) <= row["available_at"] <= after + dt.timedelta(seconds=61)
    )
    assert broker.store.claim(queue, 10, "owner", 60) == [], "a delayed job was claimed early"
    assert broker.store.next_available_at(queue) == row["available_at"]
    # No ".DQ" delay queue: the delayed message is a row of the queue itself.
    assert all(not q.endswith(".DQ") for q in broker.queues)
    assert row["queue_name"] == queue
    claimed = broker.store.claim(queue, 10, "owner", 60, now=row["available_at"])
    assert [j.id for j in claimed] == [message.message_id]


def test_eta_option_sets_available_at(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def task():
        pass

    eta = current_millis() + 120_000
    message = task.send_with_options(eta=eta)
    row = broker.store.get(message.message_id)
    expected = dt.datetime.fromtimestamp(eta / 1000, dt.timezone.utc)
    assert abs((row["available_at"] - expected).total_seconds()) < 2
    assert "eta" not in row["message"]["options"], "a worker would hold the message in memory"
    assert broker.store.claim(queue, 10, "owner", 60) == []
    claimed = broker.store.claim(queue, 10, "owner", 60, now=expected + dt.timedelta(seconds=2))
    assert [j.id for j in claimed] == [message.message_id]


def test_idempotency_key_returns_the_first_job(broker, queue, conn):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def task(n):
        pass

    key = f"order-{uuid.uuid4()}"
    first = task.send_with_options(args=(1,), idempotency_key=key)
    second = task.send_with_options(args=(2,), idempotency_key=key)
    assert second.message_id == first.message_id
    assert second.args == (1,), "the second send should return the first job's message"
    rows = conn.execute(
        f'SELECT id FROM "{broker.settings.schema}".jobs WHERE idempotency_key = %s', (key,)
    ).fetchall()
    assert [str(r[0]) for r in rows] == [first.message_id]
    created = [e for e in broker.store.events_of(first.message_id) if e["type"] == "created"]
    assert len(created) == 1
    # Another key is another job.
    third = task.send_with_options(args=(3,), idempotency_key=key + "-other")
    assert third.message_id != first.message_id


def test_sending_the_same_message_twice_stores_one_row(broker, queue, conn):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def task():
        pass

    message = task.message()
    broker.enqueue(message)
    broker.enqueue(message)
    count = conn.execute(
        f'SELECT count(*) FROM "{broker.settings.schema}".jobs WHERE queue_name = %s', (queue,)
    ).fetchone()[0]
    assert count == 1


def test_max_retries_sets_max_attempts(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=4)
    def task():
        pass

    assert broker.store.get(task.send().message_id)["max_attempts"] == 5
    message = task.send_with_options(max_retries=0)
    assert broker.store.get(message.message_id)["max_attempts"] == 1


@pytest.fixture
def pickle_encoder():
    previous = dramatiq.get_encoder()
    dramatiq.set_encoder(dramatiq.PickleEncoder())
    yield
    dramatiq.set_encoder(previous)


def test_pickle_encoder_stores_bytes_and_is_processed(pg_url, schema, queue, pickle_encoder):
    broker = PostgresBroker(url=pg_url, schema=schema, poll_interval=0.1)
    seen = []

    @dramatiq.actor(broker=broker, queue_name=queue)
    def task(point, when):
        seen.append((point.x, point.y, when))

    # Neither argument survives JSON: only the pickle encoder can carry them.
    when = dt.date(2024, 2, 29)
    message = task.send(_PicklablePoint(3, 4), when)
    row = broker.store.get(message.message_id)
    assert row["message"] is None
    assert isinstance(row["message_bytes"], bytes) and row["message_bytes"]
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        broker.join(queue, timeout=10_000)
    finally:
        worker.stop()
        broker.close()
    assert seen == [(3, 4, when)]
    assert broker.store.get(message.message_id)["status"] == "succeeded"


class _PicklablePoint:
    def __init__(self, x, y):
        self.x, self.y = x, y
