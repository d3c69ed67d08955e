"""Actors for the worker tests, declared on whichever broker they are given.

The ``dramatiq`` subprocesses import :mod:`tests.e2e.worker_app`, which declares them on a
broker configured from ``DRAMATIQ_PG_*``; the test process declares the same actors on its
own broker to send messages. Every execution is recorded as rows of an ``executions`` table
in the broker's schema (created by the test), so the test can count how often each job ran,
in which process and attempt, even when a process is killed.
"""

from __future__ import annotations

import os
import signal
import time

import dramatiq
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker, current_job

QUEUE = "e2e"
#: The queue the operator-control tests pause.
PAUSABLE = "e2e_pausable"

EXECUTIONS_DDL = """
CREATE TABLE {}.executions (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id   uuid        NOT NULL,
    attempt  integer     NOT NULL,
    pid      integer     NOT NULL,
    phase    text        NOT NULL CHECK (phase IN ('start', 'finish')),
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


def create_executions_table(conn, schema: str) -> None:
    conn.execute(sql.SQL(EXECUTIONS_DDL).format(sql.Identifier(schema)))


def record(phase: str) -> None:
    job = current_job()
    broker = dramatiq.get_broker()
    statement = sql.SQL(
        "INSERT INTO {}.executions (job_id, attempt, pid, phase) VALUES (%s, %s, %s, %s)"
    ).format(sql.Identifier(broker.settings.schema))
    with broker.pool.connection() as conn:
        conn.execute(statement, (job.id, job.attempt, os.getpid(), phase))


def record_patiently(phase: str, timeout: float = 120.0) -> None:
    """:func:`record`, retried while the database is unreachable."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return record(phase)
        except dramatiq.errors.BrokerError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def declare(broker: PostgresBroker) -> dict[str, dramatiq.Actor]:
    """Declare the test actors on ``broker``; returns them by name."""

    @dramatiq.actor(broker=broker, queue_name=QUEUE, priority=0, max_retries=3, min_backoff=100)
    def hang_first(seconds: float) -> None:
        """Hangs ``seconds`` on its first attempt (the one a test kills), quick after."""
        record("start")
        if current_job().attempt == 1:
            time.sleep(seconds)
        record("finish")

    @dramatiq.actor(broker=broker, queue_name=QUEUE, priority=0, max_retries=3)
    def slow(seconds: float) -> None:
        record("start")
        time.sleep(seconds)
        record("finish")

    @dramatiq.actor(broker=broker, queue_name=QUEUE, priority=10, max_retries=3)
    def quick(seconds: float = 0.0) -> None:
        record("start")
        time.sleep(seconds)
        record("finish")

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=0)
    def steady(seconds: float = 0.0) -> None:
        """No retries: a failure of any kind would leave the job failed. Its records wait
        out a database outage, so that only the broker's own handling is on trial."""
        record_patiently("start")
        time.sleep(seconds)
        record_patiently("finish")

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=0)
    def die_at_once() -> None:
        """A poison message: kills its own worker process as soon as it starts. (50 ms
        after: a process killed before it told the ``dramatiq`` main process it booted
        leaves that process waiting 30 s, its ``--worker-fork-timeout``. The worker writes
        a start 100 ms after the actor began at the earliest.)"""
        record("start")
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=3, min_backoff=100)
    def nap(seconds: float) -> None:
        """Blocked in a system call (time.sleep), where no exception can reach it; retried
        after 100 ms if it fails, so that a retry of an aborted job would show at once."""
        record("start")
        time.sleep(seconds)
        record("finish")

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=3, min_backoff=100)
    def spin(seconds: float) -> None:
        """A busy loop of Python instructions, for ``seconds``."""
        record("start")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pass
        record("finish")

    @dramatiq.actor(broker=broker, queue_name=PAUSABLE, max_retries=0)
    def tick() -> None:
        record("start")
        record("finish")

    return {
        "nap": nap,
        "spin": spin,
        "tick": tick,
        "hang_first": hang_first,
        "slow": slow,
        "quick": quick,
        "steady": steady,
        "die_at_once": die_at_once,
    }
