"""Retries reschedule the same row: backoff values, exhaustion, Retry(delay=...), throws,
and Dramatiq's stock Retries middleware kept by the user."""

from __future__ import annotations

import datetime as dt
import logging
import time
from unittest.mock import patch

import dramatiq
from dramatiq.middleware import AgeLimit, Middleware
from dramatiq.middleware import Retries as StockRetries

from dramatiq_pg_broker import Retries as PgRetries
from dramatiq_pg_broker import current_job
from dramatiq_pg_broker.retries import RETRYING_LINE

from .harness import of_type


def deterministic(broker) -> PgRetries:
    """The broker's Retries middleware, switched to the deterministic backoff."""
    retries = next(m for m in broker.middleware if isinstance(m, PgRetries))
    retries.jitter = False
    return retries


def logged_delays(caplog, message_id: str) -> list[int]:
    """The delays Dramatiq's Retries logged for a message's retries, in order."""
    return [
        r.args[1]
        for r in caplog.records
        if r.msg == RETRYING_LINE and r.args and r.args[0] == message_id
    ]


def test_failures_are_rescheduled_with_doubling_backoff_then_fail(h, caplog):
    caplog.set_level(logging.INFO)
    broker = h.broker()
    deterministic(broker)

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, max_retries=4, min_backoff=60, max_backoff=150
    )
    def always_fails():
        h.record(current_job().attempt, time.monotonic())
        raise ValueError("nope")

    message = always_fails.send()
    h.start(broker)
    broker.join(h.queue, timeout=20_000)

    row = broker.store.get(message.message_id)
    assert (row["status"], row["attempts"], row["max_attempts"]) == ("failed", 5, 5)
    assert row["last_error"] == "ValueError: nope"
    events = broker.store.events_of(message.message_id)
    retries = of_type(events, "retry_scheduled")
    assert [e["data"]["delay_ms"] for e in retries] == [60, 120, 150, 150]
    assert logged_delays(caplog, message.message_id) == [60, 120, 150, 150], (
        "the log line states the delay the row waits"
    )
    assert [e["attempt"] for e in retries] == [1, 2, 3, 4]
    assert all(e["data"]["error"] == "ValueError: nope" for e in retries)
    failed = of_type(events, "failed")
    assert [(e["attempt"], e["data"]["error"]) for e in failed] == [(5, "ValueError: nope")]
    assert [e["attempt"] for e in of_type(events, "claimed")] == [1, 2, 3, 4, 5]
    assert [attempt for attempt, _ in h.runs] == [1, 2, 3, 4, 5]
    # Each attempt waited at least its backoff after the previous one.
    gaps = [b - a for (_, a), (_, b) in zip(h.runs, h.runs[1:])]
    for gap, delay in zip(gaps, [60, 120, 150, 150]):
        assert gap >= delay / 1000 - 0.01, f"an attempt ran {gap:.3f}s after the last, < {delay}ms"


def test_the_default_backoff_jitters_as_dramatiqs_and_the_log_states_the_delay(h, caplog):
    caplog.set_level(logging.INFO)
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=2, min_backoff=100)
    def fails_twice(n):
        if current_job().attempt < 3:
            raise ValueError("not yet")

    messages = [fails_twice.send(n) for n in range(6)]
    h.start(broker, threads=3)
    broker.join(h.queue, timeout=30_000)
    firsts = []
    for message in messages:
        retries = of_type(broker.store.events_of(message.message_id), "retry_scheduled")
        delays = [e["data"]["delay_ms"] for e in retries]
        assert logged_delays(caplog, message.message_id) == delays, (
            "the log line states the delay the row waits"
        )
        # Dramatiq's backoff: min_backoff * 2 ** retries, stretched by 1 to 2.
        assert len(delays) == 2 and 100 <= delays[0] < 200 and 200 <= delays[1] < 400, delays
        assert broker.store.get(message.message_id)["status"] == "succeeded"
        firsts.append(delays[0])
    assert len(set(firsts)) > 1, f"six jobs failing together retry at one instant: {firsts}"


def test_a_retry_policy_that_goes_past_max_retries_raises_the_rows_limit(h):
    broker = h.broker(backoff_base_ms=10, backoff_max_ms=10)

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, max_retries=1, retry_when=lambda retries, e: retries < 3
    )
    def stubborn():
        h.record(current_job().attempt, broker.store.get(current_job().id)["max_attempts"])
        raise ValueError("again")

    message = stubborn.send()
    h.start(broker)
    broker.join(h.queue, timeout=20_000)
    # Each retry the policy granted is within the row's limit when it runs.
    assert h.runs == [(1, 2), (2, 2), (3, 3), (4, 4)]
    row = broker.store.get(message.message_id)
    assert (row["status"], row["failures"], row["max_attempts"]) == ("failed", 4, 4)


def test_a_retry_that_succeeds_keeps_one_row(h, conn):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=5, min_backoff=10)
    def flaky():
        attempt = current_job().attempt
        h.record(attempt)
        if attempt < 3:
            raise RuntimeError(f"attempt {attempt}")

    message = flaky.send()
    h.start(broker)
    broker.join(h.queue, timeout=20_000)
    assert h.rows(broker, conn) == [(message.message_id, "succeeded", 3)]
    assert h.runs == [(1,), (2,), (3,)]
    assert broker.store.get(message.message_id)["last_error"] == "RuntimeError: attempt 2"


def test_retry_exception_delay_is_honoured(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=3, min_backoff=10)
    def later():
        h.record(current_job().attempt, time.monotonic())
        if current_job().attempt == 1:
            raise dramatiq.Retry(delay=700)

    message = later.send()
    h.start(broker)
    broker.join(h.queue, timeout=20_000)
    row = broker.store.get(message.message_id)
    assert (row["status"], row["attempts"]) == ("succeeded", 2)
    retry = of_type(broker.store.events_of(message.message_id), "retry_scheduled")
    assert [e["data"]["delay_ms"] for e in retry] == [700]
    available_at = dt.datetime.fromisoformat(retry[0]["data"]["available_at"])
    assert available_at - retry[0]["created_at"] >= dt.timedelta(milliseconds=690)
    (_, first), (_, second) = h.runs
    assert second - first >= 0.69, "the retry ran before the delay Retry asked for"


def test_throws_is_not_retried(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=5, throws=(KeyError,))
    def expected_failure():
        h.record(current_job().attempt)
        raise KeyError("missing")

    message = expected_failure.send()
    h.start(broker)
    broker.join(h.queue, timeout=20_000)
    row = broker.store.get(message.message_id)
    assert (row["status"], row["attempts"]) == ("failed", 1)
    events = broker.store.events_of(message.message_id)
    assert not of_type(events, "retry_scheduled")
    assert len(of_type(events, "failed")) == 1
    assert h.runs == [(1,)]


def test_retry_when_decides(h):
    broker = h.broker()

    def only_connection_errors(retries, exc):
        return isinstance(exc, ConnectionError) and retries < 2

    @dramatiq.actor(
        broker=broker, queue_name=h.queue, retry_when=only_connection_errors, min_backoff=10
    )
    def guarded(kind):
        h.record(kind, current_job().attempt)
        raise (ConnectionError if kind == "net" else ValueError)(kind)

    net = guarded.send("net")
    bad = guarded.send("bad")
    h.start(broker)
    broker.join(h.queue, timeout=20_000)
    assert broker.store.get(net.message_id)["attempts"] == 3
    assert broker.store.get(bad.message_id)["attempts"] == 1
    assert {broker.store.get(m.message_id)["status"] for m in (net, bad)} == {"failed"}


def stock_middleware(retries):
    """Dramatiq's default middleware, with its own Retries kept (as a user might)."""
    return [retries if m is StockRetries else m() for m in dramatiq.middleware.default_middleware]


def test_stock_retries_middleware_loses_and_duplicates_nothing(h, conn):
    retries = StockRetries(max_retries=3, min_backoff=10, max_backoff=40)
    broker = h.broker(middleware=stock_middleware(retries))
    assert retries in broker.middleware
    assert not any(isinstance(m, PgRetries) for m in broker.middleware)

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def flaky(n):
        attempt = current_job().attempt
        h.record(n, attempt)
        if attempt < 3:
            raise RuntimeError(f"{n} attempt {attempt}")

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=1)
    def hopeless():
        h.record("hopeless", current_job().attempt)
        raise RuntimeError("never")

    messages = [flaky.send(n) for n in range(5)]
    lost_cause = hopeless.send()
    h.start(broker, threads=3)
    broker.join(h.queue, timeout=30_000)

    rows = {r[0]: r[1:] for r in h.rows(broker, conn)}
    assert len(rows) == 6, f"the stock Retries middleware added rows: {rows}"
    for m in messages:
        assert rows[m.message_id] == ("succeeded", 3)
        events = broker.store.events_of(m.message_id)
        assert len(of_type(events, "retry_scheduled")) == 2
        assert len(of_type(events, "succeeded")) == 1
    assert rows[lost_cause.message_id] == ("failed", 2)
    assert sorted(h.runs, key=str) == sorted(
        [(n, a) for n in range(5) for a in (1, 2, 3)] + [("hopeless", 1), ("hopeless", 2)],
        key=str,
    ), "some attempt ran twice or never"
    # The stock middleware's bookkeeping travels with the rescheduled row.
    stored = broker.store.get(messages[0].message_id)["message"]
    assert stored["options"]["retries"] == 2


def test_a_retry_that_cannot_be_written_is_never_acked_as_a_success(h, monkeypatch):
    # A short lease and a fast reaper: the unwritten retry is recovered by lease expiry.
    broker = h.broker(lease_seconds=1.0, reaper_interval=0.2, backoff_base_ms=50, backoff_max_ms=50)
    real_reschedule = broker.store.reschedule
    refused = []

    def unreachable_for_attempt_1(attempt, *args, **kwargs):
        if attempt.attempt == 1:
            # Every try (the broker retries a few times) finds the server gone.
            refused.append(attempt)
            raise dramatiq.errors.ConnectionClosed(OSError("server went away"))
        return real_reschedule(attempt, *args, **kwargs)

    monkeypatch.setattr(broker.store, "reschedule", unreachable_for_attempt_1)

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=3, min_backoff=50)
    def fails_once():
        attempt = current_job().attempt
        h.record(attempt)
        if attempt == 1:
            raise ValueError("first attempt fails")

    message = fails_once.send()
    h.start(broker)
    broker.join(h.queue, timeout=20_000)

    assert refused, "the reschedule was never attempted"
    row = broker.store.get(message.message_id)
    assert (row["status"], row["attempts"]) == ("succeeded", 2), row
    types = [(e["type"], e["attempt"]) for e in broker.store.events_of(message.message_id)]
    assert ("succeeded", 1) not in types, f"the failed attempt was acked: {types}"
    assert ("timeout_requeued", 1) in types, types
    assert [attempt for (attempt,) in h.runs] == [1, 2]


def test_the_middleware_logs_through_the_loggers_own_methods(h):
    """Dramatiq's Retries calls ``Logger.info``/``Logger.warning`` on its logger, and so
    does this package's: code that watches those calls (Dramatiq's own tests patch
    ``logging.Logger.info``) sees its lines. An adapter around the logger would call
    ``Logger.log`` instead."""
    broker = h.broker()
    deterministic(broker)

    class Expected(Exception):
        pass

    @dramatiq.actor(broker=broker, queue_name=h.queue, throws=Expected, max_retries=3)
    def expected():
        raise Expected("as planned")

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=1, min_backoff=10)
    def unexpected():
        raise ValueError("nope")

    with (
        patch("logging.Logger.info") as info,
        patch("logging.Logger.warning") as warning,
    ):
        first, second = expected.send(), unexpected.send()
        h.start(broker)
        broker.join(h.queue, timeout=20_000)
        info_lines = [call.args[0] for call in info.mock_calls if call.args]
        warning_lines = [call.args[0] for call in warning.mock_calls if call.args]
    assert "Aborting message %r." in info_lines
    assert RETRYING_LINE in info_lines
    assert "Retries exceeded for message %r." in warning_lines
    assert broker.store.get(first.message_id)["status"] == "failed"
    assert broker.store.get(second.message_id)["attempts"] == 2


def test_a_retry_is_written_after_every_middleware_ran(h):
    """The row goes back to its queue when Dramatiq acks the message: a middleware whose
    ``after_process_message`` runs after the Retries middleware's still sees the attempt
    running, and the next attempt cannot start during it."""
    broker = h.broker()
    seen: list[tuple[int, str, int]] = []

    class Watcher(Middleware):
        def after_process_message(self, broker, message, *, result=None, exception=None):
            row = broker.store.get(message.message_id)
            seen.append((message.attempt.attempt, row["status"], row["attempts"]))

    # First in the list: its after-hook runs last.
    broker.add_middleware(Watcher(), before=AgeLimit)

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=1, min_backoff=1)
    def flaky():
        if current_job().attempt == 1:
            raise ValueError("first attempt fails")

    message = flaky.send()
    h.start(broker, threads=2)
    broker.join(h.queue, timeout=20_000)
    # Not (1, "queued", 1), nor (1, "running", 2): the next attempt already claimed.
    assert seen == [(1, "running", 1), (2, "running", 2)], seen
    row = broker.store.get(message.message_id)
    assert (row["status"], row["attempts"]) == ("succeeded", 2)
