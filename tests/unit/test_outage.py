"""The outage tracker's story, on a clock of the test's own: one line when the database
becomes unreachable, a reminder per interval, one line when it is back; nothing per
attempt; a lone lost connection is no outage."""

from __future__ import annotations

import logging
import os

import psycopg
import pytest
from dramatiq.errors import ConnectionClosed

from dramatiq_pg_broker.db import outage
from dramatiq_pg_broker.db.outage import Outage, QuietPoolLogs, describe, duration

REFUSED = psycopg.OperationalError(
    'connection failed: connection to server at "10.0.0.1", port 5432 failed: Connection '
    "refused\n\tIs the server running on that host and accepting TCP/IP connections?"
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def tracker(clock):
    return Outage(clock=clock)


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.DEBUG, logger="dramatiq_pg_broker.outage")

    def collect() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "dramatiq_pg_broker.outage"]

    return collect


def test_one_line_per_outage_a_reminder_per_interval_and_one_line_at_the_end(tracker, clock, lines):
    for _ in range(200):  # a pool and consumers retrying twice a second for 100 s
        tracker.connect_failed(REFUSED)
        clock.now += 0.5
    tracker.answered()
    tracker.answered()

    story = lines()
    assert len(story) == 3, story
    assert story[0].startswith("The database is unreachable"), story
    assert "Connection refused" in story[0] and "\n" not in story[0], story
    assert story[1].startswith("The database is still unreachable, for 1m00s now:"), story
    assert story[2] == "The database is reachable again; it was unreachable for 1m40s.", story
    assert not tracker.unreachable


def test_a_lost_connection_that_the_next_statement_replaces_is_no_outage(tracker, clock, lines):
    for _ in range(5):  # terminated backends, each replaced at once
        tracker.connection_lost(ConnectionClosed(REFUSED))
        clock.now += 0.2
        tracker.answered()
        clock.now += 10
    assert lines() == []


def test_connections_lost_for_longer_than_the_grace_are_an_outage_counted_from_the_first(
    tracker, clock, lines
):
    lost = psycopg.OperationalError("server closed the connection unexpectedly")
    tracker.connection_lost(lost)
    clock.now += outage.GRACE_SECONDS / 2
    tracker.connection_lost(lost)
    assert lines() == [], "announced before the grace ran out"
    clock.now += outage.GRACE_SECONDS
    tracker.connection_lost(lost)
    clock.now += 2.0
    tracker.answered()
    assert lines() == [
        "The database is unreachable (retrying quietly: a reminder every 1m00s while it "
        "lasts, a line when it is back): server closed the connection unexpectedly",
        "The database is reachable again; it was unreachable for 3.5s.",
    ]


def test_a_forked_child_forgets_its_parents_outage(tracker, monkeypatch, lines):
    tracker.connect_failed(REFUSED)
    monkeypatch.setattr(outage.forks, "pid", lambda: os.getpid() + 1)
    assert not tracker.unreachable
    tracker.answered()
    assert len(lines()) == 1, "the child told the end of an outage it never saw"


def test_describe_finds_the_drivers_error_and_keeps_it_on_one_line():
    wrapped = ConnectionClosed(REFUSED)
    wrapped.__cause__ = REFUSED
    assert describe(wrapped) == (
        'connection failed: connection to server at "10.0.0.1", port 5432 failed: '
        "Connection refused Is the server running on that host and accepting TCP/IP "
        "connections?"
    )


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.04, "0.0s"), (4.25, "4.2s"), (65, "1m05s"), (3725, "1h02m")]
)
def test_durations_read_as_a_person_writes_them(seconds, text):
    assert duration(seconds) == text


def _pool_record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("psycopg.pool", logging.WARNING, "pool.py", 1, msg, args, None)


def test_pool_warnings_per_attempt_are_lowered_for_our_pools_only():
    quiet = QuietPoolLogs("dramatiq-pg-broker-")
    pool_logger = logging.getLogger("psycopg.pool")
    level = pool_logger.level
    pool_logger.setLevel(logging.INFO)
    try:
        ours = _pool_record("error connecting in %r: %s", "dramatiq-pg-broker-42", "refused")
        theirs = _pool_record("error connecting in %r: %s", "app-pool", "refused")
        other = _pool_record("rolling back returned connection: %s", "conn")
        assert quiet.filter(ours) is False, "our pool's attempt warning was kept"
        assert quiet.filter(theirs) is True and theirs.levelno == logging.WARNING
        assert quiet.filter(other) is True and other.levelno == logging.WARNING
        with outage.quiet_pool():
            discarded = _pool_record("discarding broken connection: %s", "conn")
            assert quiet.filter(discarded) is False

        pool_logger.setLevel(logging.DEBUG)
        ours = _pool_record("error connecting in %r: %s", "dramatiq-pg-broker-42", "refused")
        assert quiet.filter(ours) is True and ours.levelname == "DEBUG", (
            "with psycopg.pool at DEBUG the line is kept, as DEBUG"
        )
    finally:
        pool_logger.setLevel(level)


TOO_MANY = psycopg.OperationalError(
    'connection failed: connection to server at "10.0.0.1", port 5432 failed: FATAL:  '
    "sorry, too many clients already"
)


@pytest.mark.parametrize(
    "error",
    [
        TOO_MANY,
        psycopg.OperationalError(
            "connection failed: FATAL:  remaining connection slots are reserved for roles "
            "with the SUPERUSER attribute"
        ),
        ConnectionClosed(psycopg.OperationalError("FATAL:  too many connections for role x")),
        psycopg.OperationalError("ERROR:  no more connections allowed (max_client_conn)"),
    ],
)
def test_a_refusal_for_want_of_slots_is_saturation(error):
    assert outage.is_saturation(error)
    assert not outage.is_saturation(REFUSED)


def test_a_saturated_server_is_no_outage_and_is_told_once_a_minute_with_a_count(
    tracker, clock, lines
):
    """Processes that take turns at the last connection slots: refusals, and statements
    answered in between on the connections they have. No "unreachable", no "reachable
    again 0.0s": one warning, then one a minute with the number refused."""
    for _ in range(100):  # 50 s: a refusal and an answered statement every half second
        tracker.connect_failed(TOO_MANY)
        tracker.answered()
        clock.now += 0.5
    story = lines()
    assert len(story) == 1, story
    assert story[0].startswith("The database refused a connection: it has no free connection")
    assert "saturated, not down" in story[0] and "too many clients" in story[0]
    assert not tracker.unreachable
    for _ in range(40):  # 20 s more: past the minute since the first warning
        tracker.connect_failed(TOO_MANY)
        clock.now += 0.5
    story = lines()
    assert len(story) == 2, story
    assert story[1].startswith("The database refused 120 more connection(s) for want of"), story
    assert "in the last 1m00s" in story[1], story
    assert not tracker.unreachable
    tracker.answered()
    assert len(lines()) == 2, "saturation ends with no 'reachable again' line"


def test_saturation_leaves_an_outage_as_it_is(tracker, clock, lines):
    tracker.connect_failed(REFUSED)
    clock.now += 5
    tracker.connect_failed(TOO_MANY)
    assert tracker.unreachable
    clock.now += 5
    tracker.answered()
    story = lines()
    assert story[0].startswith("The database is unreachable")
    assert story[-1] == "The database is reachable again; it was unreachable for 10.0s."


def test_the_reminder_interval_is_a_setting_a_minute_by_default(clock, lines, monkeypatch):
    from dramatiq_pg_broker.config import Settings
    from dramatiq_pg_broker.db import ProcessPool

    assert Settings().outage_reminder_seconds == 60.0
    monkeypatch.setattr(outage, "tracker", Outage(clock=clock))
    ProcessPool(Settings.load({"DRAMATIQ_PG_OUTAGE_REMINDER_SECONDS": "5"}))
    tracker = outage.tracker
    assert tracker.reminder_seconds == 5.0
    for _ in range(25):  # 12 s of failed attempts, twice a second
        tracker.connect_failed(REFUSED)
        clock.now += 0.5
    tracker.answered()

    story = lines()
    assert "a reminder every 5.0s while it lasts" in story[0], story
    assert story[1:] == [
        f"The database is still unreachable, for {seconds} now: connection failed: "
        'connection to server at "10.0.0.1", port 5432 failed: Connection refused Is the '
        "server running on that host and accepting TCP/IP connections?"
        for seconds in ("5.0s", "10.0s")
    ] + ["The database is reachable again; it was unreachable for 12.5s."], story


def test_a_server_shutting_down_is_one_outage_though_an_old_connection_answers(
    tracker, clock, lines
):
    """A server shutting down refuses new connections at once, but a connection it has
    not closed yet may still answer: that answer is no end (it once read as three outages
    in 60 ms). A connection opened after the refusals ends it, counted from the first."""
    opened_long_ago = clock.now - 60
    for _ in range(3):
        tracker.connect_failed(REFUSED)
        clock.now += 0.01
        tracker.answered(opened_long_ago)
        clock.now += 0.01
    assert tracker.unreachable
    clock.now += 3.0
    tracker.connect_failed(REFUSED)
    clock.now += 0.3
    tracker.answered(clock.now - 0.01)
    story = lines()
    assert len(story) == 2, story
    assert story[0].startswith("The database is unreachable"), story
    assert story[1] == "The database is reachable again; it was unreachable for 3.4s.", story


def test_an_old_connection_ends_an_outage_once_no_attempt_failed_for_the_grace(
    tracker, clock, lines
):
    """A connection attempt that failed for a moment while the pool's connections kept
    working: their answers end the outage once the grace has passed without another
    failed attempt (and an answer whose connection is not known ends it at once)."""
    opened_long_ago = clock.now - 60
    tracker.connect_failed(REFUSED)
    clock.now += outage.GRACE_SECONDS / 2
    tracker.answered(opened_long_ago)
    assert tracker.unreachable
    clock.now += outage.GRACE_SECONDS
    tracker.answered(opened_long_ago)
    assert not tracker.unreachable
    assert lines()[-1] == "The database is reachable again; it was unreachable for 1.5s."
    tracker.connect_failed(REFUSED)
    tracker.answered()
    assert not tracker.unreachable


def test_an_attempt_that_began_before_the_end_and_fails_after_it_starts_no_outage(
    tracker, clock, lines
):
    """A server starting up answers a connection while an attempt begun a moment earlier
    still fails ("the database system is starting up"): that late failure is the outage
    that just ended, not a new one (it once read as an outage of 0.4 s). An attempt that
    begins after the end and fails starts one."""
    starting_up = psycopg.OperationalError("FATAL:  the database system is starting up")
    tracker.connect_failed(REFUSED, clock.now)
    clock.now += 3.0
    began = clock.now
    clock.now += 0.1
    tracker.answered(clock.now)
    clock.now += 0.01
    tracker.connect_failed(starting_up, began)
    assert not tracker.unreachable
    assert len(lines()) == 2, lines()
    clock.now += 5.0
    tracker.connect_failed(REFUSED, clock.now)
    assert tracker.unreachable


def test_a_refusal_to_write_holds_back_no_answer_of_an_older_connection(tracker, clock, lines):
    """A standby's refusal to write (a LISTEN during recovery, say) came over a connection
    the server accepted: the answer of a connection opened before it, from the primary
    the pool was led back to, ends the outage at once (within the grace too)."""
    opened = clock.now
    clock.now += 0.2
    standby = psycopg.errors.ReadOnlySqlTransaction("cannot execute LISTEN during recovery")
    tracker.connect_failed(ConnectionClosed(standby))
    assert tracker.unreachable
    clock.now += 0.1
    tracker.answered(opened)
    assert not tracker.unreachable
    assert lines()[-1] == "The database is reachable again; it was unreachable for 0.1s."
