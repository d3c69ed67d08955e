"""Which days of history a send probes by name (see dramatiq_pg_broker.history.probe)."""

from __future__ import annotations

import datetime as dt

import pytest

from dramatiq_pg_broker.history.probe import HistoryProbe


def ms(text: str) -> int:
    return int(dt.datetime.fromisoformat(text).replace(tzinfo=dt.timezone.utc).timestamp() * 1000)


@pytest.mark.parametrize(
    ("sent_at", "now", "days"),
    [
        # A message sent now, in the middle of a UTC day: that day only.
        ("2026-12-01T12:00", "2026-12-01T12:00:01", ["2026-12-01"]),
        # In the last hour of a day, a finish may be dated tomorrow by a server clock an
        # hour ahead: both days.
        ("2026-12-01T23:30", "2026-12-01T23:30", ["2026-12-01", "2026-12-02"]),
        # A message built in the morning and sent at noon: still today only.
        ("2026-12-01T08:00", "2026-12-01T12:00", ["2026-12-01"]),
        # A message from a clock ahead of this one: today and tomorrow.
        ("2026-12-01T23:50", "2026-12-01T22:00", ["2026-12-01", "2026-12-02"]),
    ],
)
def test_a_message_of_today_probes_its_days_by_name(sent_at, now, days):
    probe = HistoryProbe("s")
    assert [str(day) for day in probe.days(ms(sent_at), ms(now))] == days


@pytest.mark.parametrize(
    ("sent_at", "now"),
    [
        # In the first hour of a day, yesterday's jobs may collide: yesterday's partitions
        # could be dropped by a retention shorter than a day, so the parent is read.
        ("2026-12-02T00:30", "2026-12-02T00:30"),
        # A message sent again two days after it was built.
        ("2026-11-29T12:00", "2026-12-01T12:00"),
        # No usable timestamp.
        (None, "2026-12-01T12:00"),
    ],
)
def test_other_messages_probe_the_parent(sent_at, now):
    probe = HistoryProbe("s")
    assert probe.days(None if sent_at is None else ms(sent_at), ms(now)) == ()


def test_a_message_stamped_ahead_of_this_clock_still_probes_today():
    probe = HistoryProbe("s")
    days = probe.days(ms("2026-12-01T13:30"), ms("2026-12-01T12:00"))
    assert [str(day) for day in days] == ["2026-12-01"]
    # Stamped days ahead: the parent, whose bound says what it always said.
    assert probe.days(ms("2026-12-04T12:00"), ms("2026-12-01T12:00")) == ()
