"""Actors for the workflow tests, declared on whichever broker they are given.

The ``dramatiq`` subprocesses import :mod:`tests.e2e.workflow_app`; the test process
declares the same actors on its own broker to build the workflows. Each run of an actor is
recorded in a ``wf_runs`` table of the broker's schema (created by the test): its tag, the
arguments it was given, its job, attempt and process, when it started and when it
finished, so that a test can tell the order of the steps and how often each ran to its end,
even when a process is killed.
"""

from __future__ import annotations

import json
import os
import time

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker, current_job

QUEUE = "wf_e2e"

RUNS_DDL = """
CREATE TABLE {0}.wf_runs (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tag      text        NOT NULL,
    args     jsonb       NOT NULL,
    job_id   uuid        NOT NULL,
    attempt  integer     NOT NULL,
    pid      integer     NOT NULL,
    phase    text        NOT NULL CHECK (phase IN ('start', 'finish')),
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE {0}.wf_flags (tag text PRIMARY KEY)
"""


def create_tables(conn, schema: str) -> None:
    conn.execute(
        sql.SQL("DROP TABLE IF EXISTS {0}.wf_runs, {0}.wf_flags").format(sql.Identifier(schema))
    )
    conn.execute(sql.SQL(RUNS_DDL).format(sql.Identifier(schema)))


def _record(tag: str, args, phase: str) -> None:
    job = current_job()
    broker = dramatiq.get_broker()
    statement = sql.SQL(
        "INSERT INTO {}.wf_runs (tag, args, job_id, attempt, pid, phase)"
        " VALUES (%s, %s, %s, %s, %s, %s)"
    ).format(sql.Identifier(broker.settings.schema))
    with broker.pool.connection() as conn:
        conn.execute(
            statement, (tag, json.dumps(list(args)), job.id, job.attempt, os.getpid(), phase)
        )


def _flag(tag: str) -> bool:
    broker = dramatiq.get_broker()
    statement = sql.SQL("SELECT 1 FROM {}.wf_flags WHERE tag = %s").format(
        sql.Identifier(broker.settings.schema)
    )
    with broker.pool.connection() as conn:
        return conn.execute(statement, (tag,)).fetchone() is not None


def declare(broker: PostgresBroker) -> dict[str, dramatiq.Actor]:
    """Declare the workflow test actors on ``broker``; returns them by name."""

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=0)
    def wf_step(tag, *piped, ms=50, exact=False):
        """Records its start, sleeps ``ms``, records its finish; returns its tag. With
        ``exact``, the finish commits with the job's success (``complete_in``): a kill
        can never leave it recorded with the job still to run again."""
        _record(tag, piped, "start")
        deadline = time.monotonic() + ms / 1000
        while time.monotonic() < deadline:
            time.sleep(0.01)  # short sleeps: an abort interrupts it between two
        if not exact:
            _record(tag, piped, "finish")
            return tag
        job = current_job()
        statement = sql.SQL(
            "INSERT INTO {}.wf_runs (tag, args, job_id, attempt, pid, phase)"
            " VALUES (%s, %s, %s, %s, %s, 'finish')"
        ).format(sql.Identifier(broker.settings.schema))
        with psycopg.connect(broker.settings.url) as conn, job.complete_in(conn):
            conn.execute(
                statement, (tag, json.dumps(list(piped)), job.id, job.attempt, os.getpid())
            )
            # Widen the window between the finish and its commit, where a kill lands.
            time.sleep(0.02)
        time.sleep(0.02)  # and the one after it, before the worker's ack
        return tag

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=0)
    def wf_fan(tag, count, *piped):
        """Spawns ``count`` wf_step children, then returns its tag."""
        _record(tag, piped, "start")
        current_job().spawn(*(wf_step.message(f"{tag}.{i}", ms=300) for i in range(count)))
        _record(tag, piped, "finish")
        return tag

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=1, min_backoff=10)
    def wf_flaky(tag, *piped):
        """Fails (each of its two attempts) until the flag ``tag`` is set."""
        _record(tag, piped, "start")
        if not _flag(tag):
            raise RuntimeError(f"{tag} is not flagged")
        _record(tag, piped, "finish")
        return tag

    return {"wf_step": wf_step, "wf_fan": wf_fan, "wf_flaky": wf_flaky}
