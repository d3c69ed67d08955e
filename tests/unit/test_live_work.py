"""What migrate says it saw before a breaking migration (migrate.LiveWork), without a
database."""

from __future__ import annotations

from dramatiq_pg_broker.migrate import LiveWork


def test_nothing_seen_is_false_and_says_nothing():
    assert not LiveWork()
    assert LiveWork().describe() == ""


def test_each_kind_of_live_work_is_described_with_counts_and_ages():
    seen = LiveWork(
        leases=3,
        owners=(("old-host:1", False), ("old-host:2", False), ("w:3", True)),
        oldest_lease_age=12.4,
        leases_expire_in=28.0,
        sends=5,
        latest_send_age=0.42,
        claims=2,
        latest_claim_age=1.0,
        level=23,
    )
    line = seen.describe()
    assert "3 live lease(s) held by 2 process(es) not in the worker registry" in line
    assert (
        "(old-host:1, old-host:2) and 1 registered worker(s) of a lower schema level (w:3)" in line
    )
    assert "the oldest claimed 12 s ago, the last expiring in 28 s" in line
    assert "5 send(s) in the last 30 s (the latest 0.4 s ago)" in line
    assert "2 claim(s) in the last 30 s by code of a lower schema level" in line
    assert "(the latest 1.0 s ago)" in line
    assert line.endswith("(code below schema level 0023)"), line


def test_unknown_ages_do_not_break_the_line():
    line = LiveWork(leases=1, owners=(("h:1", False),)).describe()
    assert "the oldest claimed ? ago, the last expiring in ?" in line
