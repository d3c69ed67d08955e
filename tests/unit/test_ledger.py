"""The in-flight ledger without a database: the moves an attempt may make, the ones it
refuses, and what it asks of the job store, on a store held in memory."""

from __future__ import annotations

import threading
import time

import pytest
from dramatiq.errors import BrokerConnectionError

from dramatiq_pg_broker.attempt import inflight_completions
from dramatiq_pg_broker.attempt.states import BlockEnd, State
from dramatiq_pg_broker.errors import JobAborted

from ..helpers import wait_for


def test_a_start_is_deferred_while_the_claim_is_surely_held(memory_broker, memory_store, claim):
    ledger = memory_broker.ledger
    attempt = claim()
    writes = memory_store.hold("start")
    assert ledger.start(attempt), "the start waited for a write"
    assert ledger.state_of(attempt) is State.STARTED
    writes.set()
    wait_for(lambda: memory_store.rows[attempt.id].started, 5, "the deferred start written")


def test_a_claim_whose_lease_may_have_lapsed_records_its_start_before_the_actor_runs(
    memory_broker, memory_store, claim
):
    # Less than half the lease surely left: the start is written first, guarded.
    attempt = claim(leased_until=time.monotonic() + 1)
    assert memory_broker.ledger.start(attempt)
    assert memory_store.rows[attempt.id].started, "the actor may run on a start not written"


def test_a_claim_another_worker_took_does_not_start(memory_broker, memory_store, claim):
    ledger = memory_broker.ledger
    attempt = claim(start_first=True)
    memory_store.take_over(attempt.id)
    assert not ledger.start(attempt), "a lost claim started"
    assert ledger.state_of(attempt) is State.DONE and len(ledger) == 0


def test_an_attempt_gets_one_outcome(memory_broker, memory_store, claim):
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    assert ledger.settle(attempt, "complete")
    assert not ledger.settle(attempt, "fail", "late"), "a second outcome was taken"
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.status(attempt.id) == "succeeded"
    assert memory_store.called("fail") == []
    assert len(ledger) == 0


def test_an_ack_of_an_attempt_whose_actor_raised_is_written_as_a_failure(
    memory_broker, memory_store, claim
):
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    ledger.failed_with(attempt, "ValueError: boom")
    assert ledger.settle(attempt, "complete")
    assert memory_broker.outcomes.flush(timeout=5)
    row = memory_store.rows[attempt.id]
    assert (row.status, row.last_error) == ("failed", "ValueError: boom")


SKIP = {"reason": "middleware", "skipped_by": "app.Skipper", "message": "not today"}


def test_an_ack_of_a_skipped_attempt_is_written_as_a_cancel(memory_broker, memory_store, claim):
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    ledger.skipped(attempt, SKIP)
    assert ledger.settle(attempt, "complete")
    assert memory_broker.outcomes.flush(timeout=5)
    row = memory_store.rows[attempt.id]
    assert (row.status, row.skip) == ("cancelled", SKIP)
    assert memory_store.called("complete") == []


def test_a_skip_before_the_start_is_cancelled_too(memory_broker, memory_store, claim):
    # A middleware ahead of the broker's (the age limit's place) skipped a claimed message.
    attempt = claim()
    memory_broker.ledger.skipped(attempt, SKIP)
    assert memory_broker.ledger.settle(attempt, "complete")
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.status(attempt.id) == "cancelled"


def test_a_nack_of_a_skipped_attempt_stays_a_failure_naming_the_middleware(
    memory_broker, memory_store, claim
):
    attempt = claim()
    memory_broker.ledger.skipped(attempt, SKIP)
    assert memory_broker.ledger.settle(attempt, "fail", "SkipMessage: refused")
    assert memory_broker.outcomes.flush(timeout=5)
    row = memory_store.rows[attempt.id]
    assert (row.status, row.last_error) == (
        "failed",
        "SkipMessage: refused (skipped by app.Skipper)",
    )


def test_release_gives_back_claimed_attempts_and_leaves_started_ones(
    memory_broker, memory_store, claim
):
    ledger = memory_broker.ledger
    waiting, running = claim(), claim()
    assert ledger.start(running)
    assert ledger.release([waiting, running]) == {waiting.id}
    row = memory_store.rows[waiting.id]
    assert (row.status, row.attempts) == ("queued", 0), "given back uncharged"
    assert ledger.state_of(running) is State.STARTED
    assert not ledger.start(waiting), "a message given back started"


def test_shutdown_gives_back_what_has_not_started_and_claims_nothing_more(
    memory_broker, memory_store, claim
):
    ledger = memory_broker.ledger
    waiting, running = claim(), claim()
    assert ledger.start(running)
    assert ledger.begin_shutdown() == {waiting.id}
    assert ledger.closing
    assert memory_store.status(waiting.id) == "queued"
    assert ledger.holds(running), "a running actor's attempt was dropped at shutdown"
    ledger.open()
    assert not ledger.closing


def test_the_heartbeat_lets_go_of_attempts_another_worker_owns(memory_broker, memory_store, claim):
    ledger = memory_broker.ledger
    kept, lost = claim(), claim()
    assert ledger.start(kept) and ledger.start(lost)
    memory_store.take_over(lost.id)
    assert memory_broker.leases.renew() == {kept.id}
    assert ledger.holds(kept) and not ledger.holds(lost)
    assert not ledger.settle(lost, "complete"), "a lost attempt's outcome was taken"


def test_only_a_busy_heartbeat_refreshes_the_tables_statistics(memory_broker, memory_store, claim):
    def refreshes() -> int:
        return sum(name == "refresh_statistics" for name, _ in memory_store.calls)

    memory_broker.leases.heartbeat()
    assert refreshes() == 0, "an idle beat sent a statement for the statistics"
    assert memory_broker.ledger.start(claim())
    memory_broker.leases.heartbeat()
    assert refreshes() == 1


def test_the_heartbeat_delivers_an_abort_no_notification_told(memory_broker, memory_store, claim):
    attempt = claim()
    memory_store.request_abort(attempt.id)
    memory_broker.leases.renew()
    assert not memory_broker.ledger.start(attempt), "an aborted message started"
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.status(attempt.id) == "cancelled"


def test_a_rescheduled_attempt_takes_no_outcome(memory_broker, memory_store, claim, queue):
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)

    def retry() -> bool:
        return memory_store.reschedule(attempt, queue, 0, "ValueError: again")

    assert ledger.reschedule(attempt, retry)
    assert memory_store.status(attempt.id) == "running", "written before the ack"
    assert ledger.state_of(attempt) is State.RESCHEDULING
    assert ledger.settle(attempt, "complete"), "the ack writes the retry"
    assert memory_store.status(attempt.id) == "queued"
    assert not ledger.settle(attempt, "fail", "late"), "a second outcome was taken"
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.called("complete") == [] and memory_store.called("fail") == []


def test_a_retry_that_was_not_written_leaves_the_attempt_to_its_lease(
    memory_broker, memory_store, claim
):
    ledger = memory_broker.ledger
    attempt = claim()
    writes = memory_store.hold("start")
    assert ledger.start(attempt)  # deferred: not written yet
    assert ledger.reschedule(attempt, lambda: False)
    assert ledger.settle(attempt, "complete")  # the ack tries the retry
    assert not ledger.holds(attempt), "still renewed: the job would never run again"
    assert memory_store.called("complete") == [], "a failed attempt was acked"
    # Its start is written still, so that the reaper counts an interrupted attempt.
    writes.set()
    wait_for(lambda: memory_store.rows[attempt.id].started, 5, "the let-go start written")


def test_an_abort_stops_a_claimed_attempt_once(memory_broker, memory_store, claim):
    ledger = memory_broker.ledger
    attempt = claim()
    memory_store.request_abort(attempt.id)
    assert ledger.abort(attempt.id)
    ledger.abort(attempt.id)  # a second request for the same attempt changes nothing
    assert not ledger.start(attempt), "an aborted message started"
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.called("abort_attempts") == [[attempt.id]]
    assert memory_store.status(attempt.id) == "cancelled"
    assert not ledger.abort(attempt.id), "an abort of an attempt no longer held"


@pytest.mark.parametrize("reported", ["fail", "complete"])
def test_an_interrupted_actor_keeps_its_attempt_until_its_thread_leaves(
    memory_broker, memory_store, claim, reported
):
    """The abort raises JobAborted in the actor's thread, and the attempt stays started
    (renewed, occupying a thread, holding its place under a queue limit) until the thread
    leaves the actor; then whatever its message reports is written as the abort."""
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    entered, raised = threading.Event(), threading.Event()

    def actor():
        try:
            assert ledger.running_in(attempt, threading.get_ident())
            entered.set()
            for _ in range(500):
                time.sleep(0.01)
        except JobAborted:
            raised.set()

    thread = threading.Thread(target=actor)
    thread.start()
    assert entered.wait(5)
    memory_store.request_abort(attempt.id)
    assert ledger.abort(attempt.id)
    assert ledger.state_of(attempt) is State.STARTED, "ended while its thread is in the actor"
    assert ledger.occupying() == 1
    assert memory_store.called("abort_attempts") == []
    assert raised.wait(5), "JobAborted never reached the actor"
    thread.join(5)
    ledger.left(attempt)
    assert ledger.settle(attempt, reported, "JobAborted" if reported == "fail" else None)
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.called("abort_attempts") == [[attempt.id]]
    assert memory_store.status(attempt.id) == "cancelled"
    assert ledger.occupying() == 0


def test_an_actor_that_checks_for_its_abort_is_only_flagged_and_ends_cancelled(
    memory_broker, memory_store, claim
):
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    assert ledger.running_in(attempt, threading.get_ident(), interrupt=False)
    memory_store.request_abort(attempt.id)
    assert ledger.abort(attempt.id)
    assert ledger.abort_requested(attempt)
    assert ledger.state_of(attempt) is State.STARTED, "an actor that stops itself was stopped"
    ledger.left(attempt)
    assert ledger.settle(attempt, "fail", "RuntimeError: stopped")
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.status(attempt.id) == "cancelled"


def test_unwritten_outcomes_beyond_the_allowance_keep_their_slots(
    memory_broker, memory_store, claim
):
    ledger = memory_broker.ledger
    slots = ledger.slots(2)
    attempts = [claim(slots=slots) for _ in range(3)]
    writes = memory_store.hold("complete")
    for attempt in attempts:
        assert ledger.start(attempt)
        assert ledger.settle(attempt, "complete")
    assert slots.in_use == 1, "two outcomes give their slots back at once, the third keeps it"
    slots.allowance = 1  # the window shrank
    assert slots.held == 2, "the outcome behind the allowance counts as held"
    writes.set()
    assert memory_broker.outcomes.flush(timeout=5)
    assert (slots.in_use, slots.held, len(ledger)) == (0, 0, 0)


# -- a success written in the application's transaction (complete_in) -------------------------


def test_a_block_waits_for_a_renewal_in_flight_before_it_takes_the_row(
    memory_broker, memory_store, claim
):
    """A renewal that took the attempt before the block marked it runs to its end first:
    taken after, the row's lock would make the heartbeat wait for the application."""
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    renewals = memory_store.hold("renew_leases")
    beat = threading.Thread(target=memory_broker.leases.renew)
    beat.start()
    wait_for(lambda: memory_store.called("renew_leases"), 5, "the renewal to be sent")
    marked = []
    block = threading.Thread(target=lambda: marked.append(ledger.completing(attempt)))
    block.start()
    block.join(0.2)
    assert block.is_alive(), "the block went on while a renewal of its row was in flight"
    renewals.set()
    beat.join(5)
    block.join(5)
    assert marked == [True]
    assert attempt not in ledger.renewable(), "the heartbeat would wait for the app's lock"


def test_a_committed_block_leaves_nothing_to_write_and_no_retry(memory_broker, memory_store, claim):
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    assert ledger.completing(attempt)
    ledger.completion_written(attempt, "1234")
    ledger.completion_committed(attempt)
    # The actor raised after the block: no retry, and its nack writes nothing.
    assert ledger.reschedule(attempt, lambda: pytest.fail("a retry was written"))
    ledger.failed_with(attempt, "RuntimeError: after the block")
    assert ledger.settle(attempt, "fail", "RuntimeError: after the block")
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.called("fail") == [] and memory_store.called("complete") == []
    assert len(ledger) == 0


def test_an_undone_block_gives_the_attempt_back_to_the_heartbeat(
    memory_broker, memory_store, claim
):
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    assert ledger.completing(attempt)
    assert not ledger.completing(attempt), "a second block of the same attempt"
    ledger.completion_undone(attempt)
    assert attempt in ledger.renewable()
    assert ledger.settle(attempt, "complete")
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.status(attempt.id) == "succeeded"


def test_a_block_of_an_attempt_whose_abort_was_requested_is_refused(
    memory_broker, memory_store, claim
):
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    ledger.running_in(attempt, threading.get_ident(), interrupt=False)
    assert ledger.abort(attempt.id)
    assert not ledger.completing(attempt)


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "rolled-back"])
def test_an_abort_while_a_block_s_transaction_holds_the_row_leaves_the_outcome_to_it(
    memory_broker, memory_store, claim, committed
):
    """The block's success is written in the application's transaction, which holds the
    row: the abort writes nothing then (the outcome writer would wait for that
    transaction); how the transaction ended decides, once the actor returned."""
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    assert ledger.completing(attempt)
    ledger.completion_written(attempt, "1234")
    memory_store.request_abort(attempt.id)
    assert ledger.abort(attempt.id)
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.called("abort_attempts") == [], "written while the row was held"
    if committed:
        ledger.completion_committed(attempt)
        assert ledger.succeeded_in_transaction(attempt)
    else:
        ledger.completion_undone(attempt)
        assert not ledger.succeeded_in_transaction(attempt)
    assert ledger.settle(attempt, "fail", "JobAborted")
    assert memory_broker.outcomes.flush(timeout=5)
    expected = [] if committed else [[attempt.id]]
    assert memory_store.called("abort_attempts") == expected
    assert len(ledger) == 0


# -- how a block ends, and what the actor's own calls do meanwhile ----------------------------


def test_a_block_that_ends_without_its_success_is_renewed_again_at_once(
    memory_broker, memory_store, claim
):
    """A block that held the row (pinned) and wrote nothing: the attempt is renewed again,
    at once rather than at the next beat (the row was left alone meanwhile), and a block
    tried again in the same attempt may write its success."""
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    block = object()
    assert ledger.pin_completion(attempt, block) is not None
    assert attempt not in ledger.renewable()
    before = len(memory_store.called("renew_leases"))
    ledger.completion_ended(attempt, block, BlockEnd.NOT_WRITTEN)
    assert attempt in ledger.renewable()
    wait_for(
        lambda: len(memory_store.called("renew_leases")) > before,
        2,  # the beat's interval is a third of a 30 s lease
        "a renewal right after the block",
    )
    again = object()
    assert ledger.completing(attempt, again), "a block tried again in the same attempt"


def test_a_refused_block_leaves_the_success_of_an_earlier_one_alone(
    memory_broker, memory_store, claim
):
    """A first block's success is written in a transaction still open; a second block of
    the same attempt is refused, and its end changes nothing of the first one's."""
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    first, second = object(), object()
    assert ledger.completing(attempt, first)
    xid = memory_store.complete_in_transaction(attempt, None)
    ledger.completion_written(attempt, xid)
    ledger.completion_ended(attempt, first, BlockEnd.OPEN)
    assert not ledger.completing(attempt, second), "the row is the first block's"
    ledger.completion_ended(attempt, second, BlockEnd.NOT_WRITTEN)
    assert ledger.holds_row(attempt) and attempt not in ledger.renewable()
    memory_store.end_transaction(xid, committed=True)
    assert ledger.succeeded_in_transaction(attempt)


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "rolled-back"])
def test_a_block_whose_transaction_ended_unseen_is_settled_by_its_id(
    memory_broker, memory_store, claim, committed
):
    """The block's COMMIT raised (or the application committed inside the block): the
    transaction's id says what stands, as the block ends."""
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    block = object()
    assert ledger.completing(attempt, block)
    xid = memory_store.complete_in_transaction(attempt, None)
    ledger.completion_written(attempt, xid)
    memory_store.end_transaction(xid, committed=committed)
    ledger.completion_ended(attempt, block, BlockEnd.ENDED)
    assert ledger.holds_row(attempt) is False
    assert (attempt in ledger.renewable()) is not committed
    assert ledger.succeeded_in_transaction(attempt) is committed


def test_the_actor_s_renewal_and_progress_leave_a_held_row_alone(
    memory_broker, memory_store, claim
):
    """While a block's transaction holds the row, renew() writes nothing (the row's lock
    holds the job) and progress() writes its event alone; afterwards both write the row."""
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    block = object()
    assert ledger.pin_completion(attempt, block) is not None
    renewals = len(memory_store.called("renew_leases"))
    assert ledger.renew(attempt, 30, record=True)
    assert ledger.progress(attempt, {"done": 1}, 30)
    assert len(memory_store.called("renew_leases")) == renewals
    assert memory_store.called("progress_event") == [[attempt.id]]
    assert memory_store.called("progress") == []
    ledger.completion_ended(attempt, block, BlockEnd.NOT_WRITTEN)
    assert ledger.renew(attempt, 30, record=True)
    assert ledger.progress(attempt, {"done": 2}, 30)
    assert memory_store.called("progress") == [[attempt.id]]


def test_a_block_does_not_begin_while_a_heartbeat_statement_outlasts_its_wait(
    memory_broker, memory_store, claim, monkeypatch
):
    """A renewal that took the attempt still runs after the block's wait: the block does
    not begin (its transaction would hold the row that statement needs), and the attempt
    is left as it was."""
    monkeypatch.setattr(inflight_completions, "HEARTBEAT_WAIT_SECONDS", 0.2)
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    renewals = memory_store.hold("renew_leases")
    beat = threading.Thread(target=memory_broker.leases.renew)
    beat.start()
    try:
        wait_for(lambda: memory_store.called("renew_leases"), 5, "the renewal to be sent")
        with pytest.raises(BrokerConnectionError, match="heartbeat statement"):
            ledger.completing(attempt, object())
        assert not ledger.holds_row(attempt)
    finally:
        renewals.set()
        beat.join(5)
    assert attempt in ledger.renewable()
    assert ledger.completing(attempt, object())


def test_how_a_block_s_transaction_ended_is_read_again_while_the_database_is_away(
    memory_broker, memory_store, claim
):
    """The actor raised after a block whose transaction committed: the read of how that
    transaction ended meets an unreachable database twice, then answers. The job
    succeeded: Dramatiq is told so, not a failure."""
    ledger = memory_broker.ledger
    attempt = claim()
    assert ledger.start(attempt)
    block = object()
    assert ledger.completing(attempt, block)
    xid = memory_store.complete_in_transaction(attempt, None)
    ledger.completion_written(attempt, xid)
    ledger.completion_ended(attempt, block, BlockEnd.OPEN)
    memory_store.end_transaction(xid, committed=True)
    lost = BrokerConnectionError("the server went away")
    memory_store.fail_next("completion_status", lost, lost)
    assert ledger.succeeded_in_transaction(attempt)
    assert len(memory_store.called("completion_status")) == 3
