"""``dramatiq tests.e2e.unique_app``: a unique actor on a broker from ``DRAMATIQ_PG_*``,
which runs until the test opens its gate (a row of ``unique_gates``), then returns or
raises."""

from __future__ import annotations

import os
import time

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker

QUEUE = "unique_e2e"

broker = PostgresBroker()
dramatiq.set_broker(broker)


def create_gates_table(conn, schema: str) -> None:
    conn.execute(
        sql.SQL("CREATE TABLE IF NOT EXISTS {} (name text PRIMARY KEY)").format(
            sql.Identifier(schema, "unique_gates")
        )
    )


@dramatiq.actor(queue_name=QUEUE, unique=True, max_retries=0)
def gated(name: str, fail: bool = False) -> None:
    """Waits (60 s at most) for the gate ``name`` to open, then returns, or raises if
    ``fail``."""
    query = sql.SQL("SELECT 1 FROM {} WHERE name = %s").format(
        sql.Identifier(os.environ["DRAMATIQ_PG_SCHEMA"], "unique_gates")
    )
    deadline = time.monotonic() + 60
    with psycopg.connect(os.environ["DRAMATIQ_PG_URL"], autocommit=True) as conn:
        while conn.execute(query, (name,)).fetchone() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {name} never opened")
            time.sleep(0.05)
    if fail:
        raise RuntimeError(f"gate {name}: failing as asked")
