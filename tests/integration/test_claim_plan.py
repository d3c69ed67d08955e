"""The claim statement keeps one plan for its session (a generic plan), against real
PostgreSQL: with a queue whose table has statistics (thousands of queued jobs, analyzed),
a plan made for the values at hand was estimated cheaper at every execution, and the claim
was planned at every call (0.7 ms a plan over the lanes)."""

from __future__ import annotations

import psycopg
from psycopg import sql

from dramatiq_pg_broker.jobs import JobStore

QUEUED = 5000
CLAIMS = 20


def test_a_queue_with_statistics_gets_a_claim_planned_once(
    store: JobStore, pg_url: str, schema: str
):
    queue = "claim-plan"
    with psycopg.connect(pg_url, autocommit=True) as db:
        db.execute(
            sql.SQL(
                "INSERT INTO {}.jobs (id, queue_name, actor_name, message, status, priority,"
                " available_at, max_attempts, created_at, updated_at)"
                " SELECT gen_random_uuid(), %s, 'a', '{{}}', 'queued', 0,"
                " now() - interval '1 hour', 21,"
                " now() - interval '1 hour' + i * interval '1 millisecond', now()"
                " FROM generate_series(1, %s) AS i ORDER BY random()"
            ).format(sql.Identifier(schema)),
            (queue, QUEUED),
        )
        db.execute(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(schema)))
        try:
            # A connection that prepares as the broker's pool does (psycopg's default: at
            # the sixth execution); the server then makes five custom plans before it
            # weighs the generic one.
            with psycopg.connect(pg_url, autocommit=True) as conn:
                claimed = [
                    len(store.claim(queue, 1, "worker-1", 60, conn=conn)) for _ in range(CLAIMS)
                ]
                plans = conn.execute(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                    " WHERE statement LIKE 'WITH RECURSIVE pause%%'"
                ).fetchall()
        finally:
            db.execute(
                sql.SQL("DELETE FROM {}.jobs WHERE queue_name = %s").format(sql.Identifier(schema)),
                (queue,),
            )
    assert claimed == [1] * CLAIMS
    prepared = CLAIMS - 5
    assert plans == [(prepared - 5, 5)], "generic and custom plans of the prepared claim"
