"""The doctor's report without a database: levels and exit codes, the lines it prints, its
formatting of ages and sizes, and its thresholds as the command's options."""

from __future__ import annotations

import datetime as dt

import pytest

from dramatiq_pg_broker.health.doctor import (
    Finding,
    Report,
    Thresholds,
    age,
    check_snapshot,
    render,
    size,
)

NOW = dt.datetime(2026, 12, 6, tzinfo=dt.timezone.utc)


def report(*levels: str) -> Report:
    return Report(tuple(Finding(f"c{n}", level, "t") for n, level in enumerate(levels)), NOW)


@pytest.mark.parametrize(
    ("levels", "level", "code"),
    [
        ((), "ok", 0),
        (("ok", "ok"), "ok", 0),
        # A check that could not look is not "all is well".
        (("ok", "skipped"), "warning", 1),
        (("skipped", "skipped"), "warning", 1),
        (("ok", "warning", "skipped"), "warning", 1),
        (("problem", "skipped"), "problem", 2),
        (("problem", "warning", "ok"), "problem", 2),
    ],
)
def test_the_worst_finding_decides_the_exit_status(levels, level, code):
    assert report(*levels).level == level
    assert report(*levels).exit_code == code


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (None, "-"),
        (0.4, "0s"),
        (45, "45s"),
        (60, "1m"),
        (150, "2m 30s"),
        (3600, "1h"),
        (3 * 3600 + 5 * 60 + 9, "3h 5m"),
        (2 * 86400 + 4 * 3600, "2d 4h"),
    ],
)
def test_ages(seconds, shown):
    assert age(seconds) == shown


@pytest.mark.parametrize(
    ("n", "shown"),
    [(None, "-"), (0, "0 bytes"), (992, "992 bytes"), (40 * 1024, "40 kB"), (3 << 20, "3.0 MB")],
)
def test_sizes(n, shown):
    assert size(n) == shown


def test_render_puts_details_and_advice_under_their_finding():
    findings = (
        Finding("snapshot", "problem", "pid 1 holds it", ("a detail",), "end it"),
        Finding("hot_table", "ok", "fine"),
    )
    lines = render(Report(findings, NOW))
    assert lines[0].startswith("PROBLEM  snapshot") and lines[0].endswith("pid 1 holds it")
    assert lines[1].strip() == "a detail" and lines[2].strip() == "-> end it"
    assert lines[3].startswith("OK       hot_table")
    assert lines[-1] == "problem: 1 ok, 1 problem"


def test_render_wraps_at_a_terminal_s_width_and_not_when_piped():
    long = "word " * 60
    finding = Finding("snapshot", "warning", long.strip(), advice=long.strip())
    one = render(Report((finding,), NOW))
    assert len(one) == 3  # title, advice, summary
    wrapped = render(Report((finding,), NOW), width=80)
    assert len(wrapped) > 3 and all(len(line) <= 80 for line in wrapped)
    assert wrapped[1].startswith(" " * 28) and any(
        line.lstrip().startswith("-> ") for line in wrapped
    )


def test_every_threshold_is_documented_and_has_a_default():
    documented = Thresholds.documented()
    assert {name for name, _, _ in documented} == set(Thresholds.__dataclass_fields__)
    for name, default, doc in documented:
        assert doc and default >= 0, name
    assert Thresholds().snapshot_warning_seconds < Thresholds().snapshot_problem_seconds


class _Holders:
    """What check_snapshot reads of an examination: the holders, oldest horizon first."""

    schema = "jobs_schema"
    thresholds = Thresholds()

    def __init__(self, *holders: tuple) -> None:
        self._holders = list(holders)

    def holders(self) -> list[tuple]:
        return self._holders

    def blind(self, what: str) -> tuple[str, ...]:
        return ()

    def hot_table(self) -> None:
        return None


def _slot(name: str, xids: int) -> tuple:
    return ("replication slot", None, name, None, None, "inactive", None, xids, "logical")


def _session(pid: int, seconds: float, xids: int) -> tuple:
    return ("session", pid, "report", "app", "10.0.0.9", "idle in transaction", seconds, xids, "q")


def test_a_session_held_for_hours_behind_a_younger_slot_decides_the_snapshot_finding():
    # The slot holds the oldest horizon, by a few transactions (below the warning): the
    # session behind it has held its snapshot for two hours, a problem.
    finding = check_snapshot(_Holders(_slot("idle_slot", 900), _session(4242, 7200, 850)))
    assert finding.level == "problem"
    assert finding.title.startswith("pid 4242 (report,"), finding.title
    assert "pg_terminate_backend(4242)" in finding.advice
    assert any("idle_slot" in line for line in finding.details), finding.details
    assert finding.figures["horizon_xid_age"] == 900


def test_among_holders_of_one_level_the_oldest_horizon_is_named():
    finding = check_snapshot(_Holders(_session(1, 400, 90), _session(2, 4000, 80)))
    assert finding.level == "problem" and finding.title.startswith("pid 1 ")
    finding = check_snapshot(_Holders(_session(1, 70, 90), _session(2, 650, 80)))
    assert finding.level == "problem" and finding.title.startswith("pid 2 ")
