"""Which driver errors the broker treats as a lost connection (retried on a new one), and
what each tells the process's outage tracker."""

from __future__ import annotations

import psycopg
import pytest
from dramatiq.errors import ConnectionClosed
from psycopg_pool import PoolTimeout

from dramatiq_pg_broker import db
from dramatiq_pg_broker.db import outage


class Recorder(outage.Outage):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def connect_failed(self, error: BaseException, began_at: float | None = None) -> None:
        self.calls.append("connect_failed")

    def connection_lost(self, error: BaseException) -> None:
        self.calls.append("connection_lost")


@pytest.fixture
def tracker(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(outage, "tracker", recorder)
    return recorder


@pytest.mark.parametrize(
    ("error", "told"),
    [
        # A server that refuses to write (a standby): unusable at once, as a refused connect.
        (psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT"), ["connect_failed"]),
        (
            psycopg.OperationalError("server closed the connection unexpectedly"),
            ["connection_lost"],
        ),
        (psycopg.errors.AdminShutdown("terminating connection"), ["connection_lost"]),
        (psycopg.InterfaceError("the connection is closed"), ["connection_lost"]),
        # The pool's own failed attempts tell the tracker; a timeout adds nothing.
        (PoolTimeout("couldn't get a connection after 30.00 sec"), []),
    ],
)
def test_lost_connections_become_dramatiqs_and_tell_the_tracker(tracker, error, told):
    with pytest.raises(ConnectionClosed) as info:
        with db.translate_errors():
            raise error
    assert info.value.__cause__ is error
    assert tracker.calls == told


def test_errors_the_database_answered_are_left_alone(tracker):
    with pytest.raises(psycopg.errors.UniqueViolation):
        with db.translate_errors():
            raise psycopg.errors.UniqueViolation("duplicate key")
    assert tracker.calls == []


def test_a_refused_connection_is_told_at_once(tracker):
    with pytest.raises(ConnectionClosed):
        db.connect("postgresql://nobody@127.0.0.1:1/nowhere?connect_timeout=2")
    assert tracker.calls[0] == "connect_failed"
