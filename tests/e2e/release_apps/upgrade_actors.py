"""Actors of the upgrade tests, run by workers of the previous release and of this one.

Self-contained: it imports dramatiq, psycopg and whichever ``dramatiq_pg_broker`` the
running interpreter has installed, and the workers of both releases run with this folder
(not the checkout) as their working directory, so that the previous release's processes
never import this checkout's package. Every run of an actor is recorded as rows of an
``upgrade_runs`` table in the broker's schema (created by the test), with the release that
ran it.
"""

from __future__ import annotations

import os
import time

import dramatiq
from psycopg import sql

import dramatiq_pg_broker
from dramatiq_pg_broker import PostgresBroker, current_job

#: Which release this interpreter runs: "new" has the schema handshake, "old" predates it.
RELEASE = "new" if hasattr(dramatiq_pg_broker, "SchemaVersionError") else "old"
QUEUE = "upgrade"

RUNS_DDL = """
CREATE TABLE {}.upgrade_runs (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id   uuid        NOT NULL,
    actor    text        NOT NULL,
    attempt  integer     NOT NULL,
    release  text        NOT NULL,
    pid      integer     NOT NULL,
    phase    text        NOT NULL CHECK (phase IN ('start', 'finish')),
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


def create_runs_table(conn, schema: str) -> None:
    conn.execute(sql.SQL(RUNS_DDL).format(sql.Identifier(schema)))


def record(phase: str) -> None:
    job = current_job()
    broker = dramatiq.get_broker()
    statement = sql.SQL(
        "INSERT INTO {}.upgrade_runs (job_id, actor, attempt, release, pid, phase) "
        "VALUES (%s, %s, %s, %s, %s, %s)"
    ).format(sql.Identifier(broker.settings.schema))
    with broker.pool.connection() as conn:
        conn.execute(
            statement,
            (job.id, job.message.actor_name, job.attempt, RELEASE, os.getpid(), phase),
        )


def declare(broker: PostgresBroker) -> dict[str, dramatiq.Actor]:
    """Declare the actors on ``broker``; returns them by name."""

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=3)
    def work(n: int = 0, seconds: float = 0.0) -> None:
        record("start")
        time.sleep(seconds)
        record("finish")

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=0)
    def doomed() -> None:
        """A dead letter at its first failure."""
        record("start")
        raise RuntimeError("doomed on purpose")

    @dramatiq.actor(
        broker=broker, queue_name=QUEUE, max_retries=3, min_backoff=6000, max_backoff=6000
    )
    def flaky() -> None:
        """Fails its first attempt, then waits 6 s for its retry."""
        record("start")
        if current_job().attempt == 1:
            raise RuntimeError("flaky on purpose")
        record("finish")

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=3)
    def hang_first(seconds: float) -> None:
        """Hangs on its first attempt (the one a test kills), quick after."""
        record("start")
        if current_job().attempt == 1:
            time.sleep(seconds)
        record("finish")

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=0)
    def once() -> None:
        """No retries: any failure or charged interruption would leave it failed."""
        record("start")
        record("finish")

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=3)
    def keyed_a(tag: str) -> None:
        record("start")
        record("finish")

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=3)
    def keyed_b(tag: str) -> None:
        record("start")
        record("finish")

    return {
        actor.actor_name: actor
        for actor in (work, doomed, flaky, hang_first, once, keyed_a, keyed_b)
    }
