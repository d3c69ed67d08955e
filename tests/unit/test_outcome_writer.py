"""The outcome writer without a database: outcomes waiting together go in one statement a
kind, an unreachable database is waited out, a refused row costs only its own outcome, on
a job store held in memory."""

from __future__ import annotations

import logging

from dramatiq.errors import ConnectionClosed

from ..helpers import wait_for


def started(memory_broker, claim, count: int) -> list:
    attempts = [claim() for _ in range(count)]
    for attempt in attempts:
        assert memory_broker.ledger.start(attempt)
    return attempts


def test_outcomes_waiting_together_are_one_statement_a_kind(memory_broker, memory_store, claim):
    ledger = memory_broker.ledger
    first, *completed = started(memory_broker, claim, 3)
    failed = started(memory_broker, claim, 2)
    (aborted,) = started(memory_broker, claim, 1)
    memory_store.request_abort(aborted.id)
    writes = memory_store.hold("complete")
    assert ledger.settle(first, "complete")
    wait_for(lambda: memory_store.called("complete"), 5, "the first outcome being written")
    for attempt in completed:
        assert ledger.settle(attempt, "complete")
    for attempt in failed:
        assert ledger.settle(attempt, "fail", "ValueError: no")
    assert ledger.abort(aborted.id)
    writes.set()
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.called("complete") == [[first.id], [a.id for a in completed]]
    assert memory_store.called("fail") == [[a.id for a in failed]]
    assert memory_store.called("abort_attempts") == [[aborted.id]]
    statuses = {a.id: memory_store.status(a.id) for a in (first, *completed, *failed, aborted)}
    assert sorted(statuses.values()) == ["cancelled"] + ["failed"] * 2 + ["succeeded"] * 3
    assert len(ledger) == 0


def test_an_outcome_of_an_attempt_another_worker_took_is_discarded(
    memory_broker, memory_store, claim, caplog
):
    (attempt,) = started(memory_broker, claim, 1)
    memory_store.take_over(attempt.id)
    with caplog.at_level(logging.WARNING, logger="dramatiq_pg_broker"):
        assert memory_broker.ledger.settle(attempt, "complete")
        assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.status(attempt.id) == "running", "the new owner's attempt was ended"
    assert not memory_broker.ledger.holds(attempt)
    assert "this outcome is discarded" in caplog.text


def test_an_outcome_committed_as_the_connection_dropped_is_not_called_lost(
    memory_broker, memory_store, claim, caplog
):
    """The server went down just as the ack committed: the writer's second try finds the
    job no longer running, because its first try finished it. That job is fine: no
    warning that its outcome was discarded."""
    (attempt,) = started(memory_broker, claim, 1)
    complete = memory_store.complete
    tries = []

    def commit_then_drop(attempts, **kwargs):
        changed = complete(attempts, **kwargs)
        tries.append(changed)
        if len(tries) == 1:
            raise ConnectionClosed(OSError("server closed the connection unexpectedly"))
        return changed

    memory_store.complete = commit_then_drop
    with caplog.at_level(logging.DEBUG, logger="dramatiq_pg_broker"):
        assert memory_broker.ledger.settle(attempt, "complete")
        assert memory_broker.outcomes.flush(timeout=10)
    assert tries == [{attempt.id}, set()], "the second try found nothing to change"
    assert memory_store.status(attempt.id) == "succeeded"
    assert not memory_broker.ledger.holds(attempt)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [], [r.getMessage() for r in warnings]
    assert "was already succeeded" in caplog.text


def test_an_outcome_is_written_once_the_database_is_back(memory_broker, memory_store, claim):
    (attempt,) = started(memory_broker, claim, 1)
    down = [ConnectionClosed(OSError("connection refused")) for _ in range(2)]
    memory_store.fail_next("complete", *down)
    assert memory_broker.ledger.settle(attempt, "complete")
    assert memory_broker.outcomes.flush(timeout=10)
    assert memory_store.status(attempt.id) == "succeeded"
    assert memory_store.called("complete") == [[attempt.id]] * 3, "tried until it was written"


def test_a_refused_row_costs_only_its_own_outcome(memory_broker, memory_store, claim):
    ledger = memory_broker.ledger
    blocker, good, bad = started(memory_broker, claim, 3)
    memory_store.refuse(bad.id)
    writes = memory_store.hold("complete")
    assert ledger.settle(blocker, "complete")
    wait_for(lambda: memory_store.called("complete"), 5, "the first outcome being written")
    assert ledger.settle(good, "fail", "ValueError: good")
    assert ledger.settle(bad, "fail", "ValueError: bad")
    writes.set()
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.called("fail") == [[good.id, bad.id], [good.id], [bad.id]]
    assert memory_store.status(good.id) == "failed"
    # Not renewed any more: its lease expires and the job runs again.
    assert memory_store.status(bad.id) == "running"
    assert not ledger.holds(bad) and len(ledger) == 0


def test_flush_waits_for_every_outcome_up_to_its_timeout(memory_broker, memory_store, claim):
    (attempt,) = started(memory_broker, claim, 1)
    writes = memory_store.hold("complete")
    assert memory_broker.ledger.settle(attempt, "complete")
    assert not memory_broker.outcomes.flush(timeout=0.1), "flushed an outcome not written"
    writes.set()
    assert memory_broker.outcomes.flush(timeout=5)
    assert memory_store.status(attempt.id) == "succeeded"
