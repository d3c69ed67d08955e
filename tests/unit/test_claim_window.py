"""The consumer's claim window, without a database: how big the window is after each claim
(:class:`ClaimWindow`), and what a consumer claims, hands over and gives back, on a job
store held in memory."""

from __future__ import annotations

import pytest

from dramatiq_pg_broker.attempt.claiming import ClaimWindow
from dramatiq_pg_broker.attempt.states import Slots


def test_the_claim_window_grows_only_while_the_workers_run_dry_during_claims():
    slots = Slots(4)
    window = ClaimWindow(prefetch=4, growth=4, slots=slots)

    def after_claim(*, full=True, starved=True, seconds_later=0.005):
        # The last claim took 10 ms; the next one is due `seconds_later` after it returned.
        window.claimed(sent=99.990, returned=100.0, full=full, starved=starved)
        window.adapt(100.0 + seconds_later)

    assert window.size == 4
    after_claim()  # full, and everything handed over before it was done: threads idled
    assert window.size == 8 and slots.allowance == 8
    after_claim(starved=False)  # work was still in hand when it came back: enough
    assert window.size == 8
    after_claim()
    after_claim()
    assert window.size == 16, "the window grew past prefetch_growth times the prefetch"
    window.adapt(100.5)  # nothing new since the last claim: no second change
    assert window.size == 16
    after_claim(seconds_later=0.5)  # the next claim was due 50 claims' time later
    assert window.size == 8 and slots.allowance == 8
    after_claim(full=False)  # the queue ran dry
    assert window.size == 4


def test_the_first_claim_leaves_the_window_at_the_prefetch():
    window = ClaimWindow(prefetch=3, growth=4, slots=Slots(3))
    assert window.adapt(100.0) == 3


# -- a consumer on the memory store --------------------------------------------------------


@pytest.fixture
def consume(memory_broker, queue):
    """``consume(prefetch)``: a consumer of the test's queue (closed afterwards) that
    waits at most 50 ms for work."""
    consumers = []

    def consume(prefetch: int):
        memory_broker.declare_queue(queue)
        consumer = memory_broker.consume(queue, prefetch=prefetch, timeout=50)
        consumers.append(consumer)
        return consumer

    yield consume
    for consumer in consumers:
        consumer.close()


def take(consumer, count: int) -> list:
    """The next ``count`` messages the consumer hands over (each must come)."""
    messages = []
    for _ in range(count):
        message = next(consumer)
        assert message is not None, f"the consumer handed over {len(messages)} of {count}"
        messages.append(message)
    return messages


def finish(broker, consumer, message) -> None:
    """What a worker thread does with a message: start it, run it, ack it."""
    assert broker.ledger.start(message.attempt)
    consumer.ack(message)


def test_a_consumer_claims_half_its_window_at_once_and_holds_no_more_than_it(
    memory_broker, memory_store, actor, consume
):
    for n in range(10):
        actor.send(n)
    consumer = consume(prefetch=4)
    held = take(consumer, 4)
    assert memory_store.claims == [(2, 2), (2, 2)], "batches of half the window (4)"
    assert next(consumer) is None, "a fifth message while the window is full"
    assert len(memory_store.claims) == 2, "claimed with a full window"

    finish(memory_broker, consumer, held[0])
    assert next(consumer) is None, "3 held: more than half the window, no claim yet"
    finish(memory_broker, consumer, held[1])
    assert len(take(consumer, 2)) == 2, "down to half the window: the next batch comes"
    assert memory_store.claims[2] == (2, 2)
    assert memory_broker.outcomes.flush(timeout=5)
    statuses = [row.status for row in memory_store.rows.values()]
    assert (statuses.count("succeeded"), statuses.count("running")) == (2, 4)


def test_messages_sent_one_at_a_time_fill_the_whole_window(memory_store, actor, consume):
    """Sent while the worker threads are busy, each message is claimed as it comes, up to
    the prefetch (as Dramatiq's other brokers prefetch), not only up to half of it."""
    consumer = consume(prefetch=4)
    assert next(consumer) is None
    held = []
    for n in range(4):
        actor.send(n)
        held += take(consumer, 1)
    assert [took for _, took in memory_store.claims if took] == [1, 1, 1, 1]
    actor.send(4)
    assert next(consumer) is None, "a fifth message while the window is full"


def test_a_full_batch_that_leaves_room_is_followed_by_another(memory_store, actor, consume):
    consumer = consume(prefetch=8)
    actor.send(0)
    take(consumer, 1)
    for n in range(1, 11):
        actor.send(n)
    take(consumer, 7)
    assert [took for _, took in memory_store.claims if took] == [1, 4, 3], (
        "a batch of half the window, then the rest of the window"
    )
    assert next(consumer) is None


def test_a_consumer_claims_in_priority_then_send_order(memory_broker, actor, consume):
    sent = [actor.send_with_options(args=(n,), priority=p) for n, p in enumerate([5, 0, 5, 0])]
    consumer = consume(prefetch=8)
    order = [m.message_id for m in take(consumer, 4)]
    assert order == [sent[i].message_id for i in (1, 3, 0, 2)]


def test_a_claimed_job_whose_abort_was_requested_is_cancelled_not_handed_over(
    memory_broker, memory_store, actor, consume
):
    aborted, kept = actor.send(1), actor.send(2)
    memory_store.request_abort(aborted.message_id)
    consumer = consume(prefetch=4)
    assert [m.message_id for m in take(consumer, 1)] == [kept.message_id]
    assert next(consumer) is None
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.status(aborted.message_id) == "cancelled"


def test_a_message_nobody_can_decode_is_dead_lettered_with_the_reason(
    memory_broker, memory_store, actor, queue, consume
):
    good = actor.send(1)
    job, _ = memory_broker.sender.job_for(actor.message(2))
    job.message_bytes = b"\x80 not a message"
    bad = memory_store.add(job)
    consumer = consume(prefetch=4)
    assert [m.message_id for m in take(consumer, 1)] == [good.message_id]
    assert memory_store.status(bad) == "failed"
    assert memory_store.rows[bad].last_error.startswith("cannot decode message: ")
    assert [a.id for a in memory_broker.ledger.claimed_by(consumer.owner)] == [good.message_id]


def test_a_message_carries_its_earlier_failures_as_dramatiqs_retries_option(
    memory_broker, memory_store, actor, consume
):
    message = actor.message(1)
    job, _ = memory_broker.sender.job_for(message)
    # A row written by other means than a send: its message still has an eta, and a
    # retries count older than the row's failures.
    job.message_bytes = message.copy(options={"eta": 1, "retries": 5}).encode()
    memory_store.add(job, failures=2)
    fresh = actor.send(2)
    consumer = consume(prefetch=4)
    first, second = take(consumer, 2)
    assert first.options["retries"] == 2
    assert "eta" not in first.options, "the row's available_at did the waiting"
    assert second.message_id == fresh.message_id and "retries" not in second.options


def test_a_paused_queue_gets_back_what_its_consumer_claimed_and_did_not_start(
    memory_broker, memory_store, actor, queue, consume
):
    for n in range(4):
        actor.send(n)
    consumer = consume(prefetch=4)
    running, waiting = take(consumer, 2)
    assert memory_broker.ledger.start(running.attempt)
    memory_store.paused.add(queue)
    assert next(consumer) is None
    assert memory_store.rows[waiting.message_id].status == "queued"
    assert memory_store.rows[waiting.message_id].attempts == 0, "given back uncharged"
    assert memory_store.rows[running.message_id].status == "running", "a started one runs on"
    assert memory_broker.ledger.claimed_by(consumer.owner) == []
    memory_store.paused.discard(queue)
    consumer.ack(running)
    assert len(take(consumer, 2)) == 2, "claims again once resumed"


def test_a_consumer_gives_back_what_it_holds_when_it_closes(
    memory_broker, memory_store, actor, consume
):
    for n in range(2):
        actor.send(n)
    consumer = consume(prefetch=4)
    (handed,) = take(consumer, 1)  # the other one stays in the consumer's buffer
    consumer.requeue([handed])
    consumer.close()
    assert {row.status for row in memory_store.rows.values()} == {"queued"}
    assert {row.attempts for row in memory_store.rows.values()} == {0}
    assert len(memory_broker.ledger) == 0
