"""The actors of the failover test, declared on whichever broker they are given, with
Dramatiq's Results middleware on this package's results backend.

Each run of ``work`` records itself as one row of a ``runs`` table in the broker's schema
(created by the test), under an id of its own, so that the test counts runs, not rows: the
record is retried while the database fails over, and a retry whose first try committed
(its reply lost with the old primary) adds nothing.
"""

from __future__ import annotations

import os
import time
import uuid

import dramatiq
from dramatiq.results import Results
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker, current_job
from dramatiq_pg_broker.results import PostgresBackend

QUEUE = "failover"

RUNS_DDL = """
CREATE TABLE {}.runs (
    run_id  uuid        PRIMARY KEY,
    job_id  uuid        NOT NULL,
    pid     integer     NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

#: How long a run keeps trying to record itself while the database is unreachable.
RECORD_PATIENCE_SECONDS = 60.0


def create_runs_table(conn, schema: str) -> None:
    conn.execute(sql.SQL(RUNS_DDL).format(sql.Identifier(schema)))


def record_run() -> None:
    job = current_job()
    broker = dramatiq.get_broker()
    statement = sql.SQL(
        "INSERT INTO {}.runs (run_id, job_id, pid) VALUES (%s, %s, %s) "
        "ON CONFLICT (run_id) DO NOTHING"
    ).format(sql.Identifier(broker.settings.schema))
    params = (uuid.uuid4(), job.id, os.getpid())
    deadline = time.monotonic() + RECORD_PATIENCE_SECONDS
    while True:
        try:
            with broker.pool.connection() as conn:
                conn.execute(statement, params)
            return
        except dramatiq.errors.BrokerConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def declare(broker: PostgresBroker) -> dict[str, dramatiq.Actor]:
    """Declare the test's actors on ``broker`` (and its results backend); returns them by
    name."""
    broker.add_middleware(Results(backend=PostgresBackend(broker=broker)))

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=0)
    def work(seconds: float) -> None:
        """No retries: a failure of any kind would leave the job failed."""
        record_run()
        time.sleep(seconds)

    @dramatiq.actor(broker=broker, queue_name=QUEUE, max_retries=0, store_results=True)
    def answer() -> int:
        return 42

    return {"work": work, "answer": answer}
