"""An actor whose one effect, a row of an application table, commits with the job's
success (``current_job().complete_in()``), declared on whichever broker it is given: the
``dramatiq`` subprocesses import :mod:`tests.e2e.exactly_once_app`, the test process
declares it on its own broker to send messages."""

from __future__ import annotations

import random
import threading
import time

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker, current_job

QUEUE = "e2e_exactly_once"
TABLE = "exactly_once_effects"

#: The application's connection of each worker thread (not in autocommit mode: the block
#: begins a transaction on it and commits it).
_local = threading.local()


def create_table(conn, schema: str) -> None:
    """The application's table; no constraint, so that a duplicate would be counted."""
    conn.execute(
        sql.SQL("CREATE TABLE {} (job_id uuid NOT NULL, n integer NOT NULL)").format(
            sql.Identifier(schema, TABLE)
        )
    )


def declare(broker: PostgresBroker) -> dramatiq.Actor:
    insert = sql.SQL("INSERT INTO {} (job_id, n) VALUES (%s, %s)").format(
        sql.Identifier(broker.settings.schema, TABLE)
    )

    @dramatiq.actor(broker=broker, queue_name=QUEUE, actor_name="insert_once", max_retries=50)
    def insert_once(n: int, hold_ms: float) -> None:
        conn = getattr(_local, "conn", None)
        if conn is None or conn.closed:
            conn = _local.conn = psycopg.connect(broker.settings.url)
        job = current_job()
        with job.complete_in(conn):
            conn.execute(insert, (job.id, n))
            # Widen the window between the effect and its commit, where a kill lands.
            time.sleep(random.uniform(0, hold_ms) / 1000)
        # And the one after the commit, before the worker's ack: a kill there must not run
        # the job (and its effect) again.
        time.sleep(random.uniform(0, hold_ms) / 1000)

    return insert_once
