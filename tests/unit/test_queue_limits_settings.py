"""Queue limits without a database: the ``queue_limits`` setting in its three spellings,
and a worker process's view of its free threads and of the limited queues that wait for
one."""

from __future__ import annotations

import contextlib
import time

import pytest

from dramatiq_pg_broker import Settings
from dramatiq_pg_broker.control import limits as limits_module
from dramatiq_pg_broker.control.limits import HUNGER_SECONDS, QueueLimits
from dramatiq_pg_broker.db.core import BrokerConnectionError
from dramatiq_pg_broker.errors import ConfigurationError


def test_queue_limits_are_read_from_keywords_and_the_environment():
    assert Settings(queue_limits={"b": 2, "a": 5}).queue_limits == (("a", 5), ("b", 2))
    assert Settings(queue_limits=[("a", 1)]).queue_limits == (("a", 1),)
    env = Settings.load(environ={"DRAMATIQ_PG_QUEUE_LIMITS": "partner_api=5, reports.v2=2"})
    assert env.queue_limits == (("partner_api", 5), ("reports.v2", 2))
    assert Settings.load(environ={}).queue_limits == ()
    assert Settings(queue_limits={"a": 3}).public()["queue_limits"] == {"a": 3}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"a": 0}, "a queue limit must be a whole number from 1 to"),
        ({"a": -1}, "a queue limit must be a whole number from 1 to"),
        ({"a": True}, "a queue limit must be a whole number from 1 to"),
        ({"a": "3"}, "a queue limit must be a whole number from 1 to"),
        ({"a": 3_000_000_000}, "a queue limit must be a whole number from 1 to"),
        ({"9a": 3}, "is not a queue name"),
        ({"a\n": 3}, "is not a queue name"),
        ([("a", 1, 2)], "is not a queue name and a limit"),
        ("a", "a queue limit must be a whole number from 1 to"),
        ("a=x", "a queue limit must be a whole number from 1 to"),
        ("=3", "is not a queue name"),
    ],
)
def test_a_malformed_queue_limit_is_refused_in_a_sentence(value, says):
    with pytest.raises(ConfigurationError, match=f"^queue_limits: .*{says}.*write name=N"):
        if isinstance(value, str):
            Settings.load(environ={"DRAMATIQ_PG_QUEUE_LIMITS": value})
        else:
            Settings(queue_limits=value)


class _Ledger:
    def __init__(self, n: int) -> None:
        self.n = n

    def occupying(self) -> int:
        return self.n


class _Store:
    def __init__(self, log: list | None = None) -> None:
        self.reads = 0
        self.limits: dict[str, int] = {}
        self.log = [] if log is None else log

    def queue_limits(self) -> dict[str, int]:
        self.reads += 1
        self.log.append("read")
        return dict(self.limits)


class _Pool:
    """Connections that do nothing (the declared limits are written by apply_declared,
    which the tests replace)."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail

    @contextlib.contextmanager
    def connection(self):
        if self.fail:
            self.fail -= 1
            raise BrokerConnectionError("unreachable")
        yield self

    def transaction(self):
        return contextlib.nullcontext()


def test_free_threads_are_the_threads_less_what_runs_or_waits_for_one():
    limits = QueueLimits(store=_Store(), ledger=_Ledger(5), settings=Settings(), pool=_Pool())
    assert limits.free_threads() is None, "no worker booted: no thread bound"
    limits.worker_threads = 8
    assert limits.free_threads() == 3
    limits.ledger.n = 20
    assert limits.free_threads() == 0


def test_a_hungry_limited_queue_reserves_a_thread_until_fed_or_silent(monkeypatch):
    limits = QueueLimits(store=_Store(), ledger=_Ledger(0), settings=Settings(), pool=_Pool())
    assert limits.reserved() == 0
    limits.hungry("partner_api")
    limits.hungry("reports")
    assert limits.reserved() == 2
    limits.fed("reports")
    assert limits.reserved() == 1
    later = time.monotonic() + HUNGER_SECONDS + 0.1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert limits.reserved() == 0, "a queue that stopped saying so reserves nothing"


def test_the_limits_are_read_when_announced_or_a_second_old_while_busy(monkeypatch):
    store = _Store()
    limits = QueueLimits(
        store=store, ledger=_Ledger(0), settings=Settings(listen=True), pool=_Pool()
    )
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    assert limits.limit_of("a", busy=False) is None and store.reads == 1
    store.limits = {"a": 3}
    # An idle consumer of an unlimited queue, listening, reads nothing more...
    clock[0] += 5
    assert limits.limit_of("a", busy=False) is None and store.reads == 1
    # ...until a change is announced, or it claims work and the copy is a second old.
    limits.invalidate()
    assert limits.limit_of("a", busy=False) == 3 and store.reads == 2
    clock[0] += 0.5
    assert limits.limit_of("a", busy=True) == 3 and store.reads == 2
    store.limits = {}
    clock[0] += 0.6
    # A limited queue's copy is read again every second, busy or not.
    assert limits.limit_of("a", busy=False) is None and store.reads == 3
    # Two consumers that found the copy stale at once read it once.
    seen = limits._read_at
    clock[0] += 2
    limits.refresh(unless_read_since=seen)
    limits.refresh(unless_read_since=seen)
    assert store.reads == 4


def test_the_limits_declared_in_code_are_written_before_the_first_read(monkeypatch):
    """Every consumer reads the limits before its first claim: the first read of a process
    writes the declared ones first, once; a write that cannot reach the database is tried
    again at the next read, and nothing is read (nor claimed) before it succeeds."""
    log: list = []
    monkeypatch.setattr(
        limits_module,
        "apply_declared",
        lambda conn, schema, limits, *, by: log.append(("write", limits, by)) or sorted(limits),
    )
    store = _Store(log)
    limits = QueueLimits(
        store=store,
        ledger=_Ledger(0),
        settings=Settings(queue_limits={"partner_api": 1}),
        pool=_Pool(fail=1),
    )
    with pytest.raises(BrokerConnectionError):
        limits.limit_of("partner_api", busy=True)
    assert log == [], "read before the declared limits were written"
    store.limits = {"partner_api": 1}
    assert limits.limit_of("partner_api", busy=True) == 1
    assert [entry if entry == "read" else entry[0] for entry in log] == ["write", "read"]
    assert log[0][1] == {"partner_api": 1} and log[0][2].startswith("worker ")
    limits.invalidate()
    limits.limit_of("partner_api", busy=True)
    assert log[1:] == ["read", "read"], "written once a process"


def test_a_worker_without_declared_limits_writes_nothing(monkeypatch):
    monkeypatch.setattr(limits_module, "apply_declared", lambda *a, **k: pytest.fail("wrote"))
    limits = QueueLimits(store=_Store(), ledger=_Ledger(0), settings=Settings(), pool=_Pool(9))
    assert limits.limit_of("a", busy=True) is None
