"""Reclaimer: an opportunistic pass that fails is logged, never raised; a lost server is
the outage's to tell (once, by the process), not a warning of every pass that met it."""

from __future__ import annotations

import logging

import psycopg
import pytest
from dramatiq.errors import ConnectionClosed

from dramatiq_pg_broker.db.core import Reclaimer


def _failing(error: Exception):
    def prune(batch: int) -> int:
        raise error

    return prune


@pytest.mark.parametrize(
    "error",
    [
        ConnectionClosed(psycopg.OperationalError("server closed the connection")),
        psycopg.OperationalError("terminating connection due to unexpected postmaster exit"),
    ],
    ids=["broker connection error", "psycopg connection error"],
)
def test_a_pass_that_meets_a_lost_server_warns_nothing(error, caplog):
    reclaimer = Reclaimer(_failing(error), batch=10, interval=60, what="results")
    with caplog.at_level(logging.DEBUG, logger="dramatiq_pg_broker.db"):
        reclaimer.maybe_run()
    levels = [r.levelno for r in caplog.records if "Reclaiming expired results" in r.message]
    assert levels == [logging.DEBUG]
    assert reclaimer.next_run > 0  # the next pass waits its interval


def test_a_pass_that_fails_otherwise_is_a_warning(caplog):
    reclaimer = Reclaimer(_failing(ValueError("bad row")), batch=10, interval=60, what="results")
    with caplog.at_level(logging.DEBUG, logger="dramatiq_pg_broker.db"):
        reclaimer.maybe_run()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == ["Reclaiming expired results failed: bad row"]
