"""Unique jobs with a real ``dramatiq`` worker process (issue 46, item 6): while the
worker runs a unique job, a send of the same call returns that job; once the worker has
ended it (succeeded, or failed for good), the key is free and the next send makes a new
job."""

from __future__ import annotations

import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker

from .unique_app import QUEUE, create_gates_table
from .workers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def sender(pg_url, schema, conn):
    """A broker in the test process with a stand-in of the worker's unique actor."""
    import dramatiq

    create_gates_table(conn, schema)
    broker = PostgresBroker(url=pg_url, schema=schema)
    actor = dramatiq.actor(
        lambda name, fail=False: None,
        broker=broker,
        queue_name=QUEUE,
        actor_name="gated",
        unique=True,
        max_retries=0,
    )
    yield actor
    broker.close()


def state(conn, schema, job_id: str) -> tuple[str, bool] | None:
    row = conn.execute(
        sql.SQL("SELECT status, started FROM {} WHERE id = %s").format(
            sql.Identifier(schema, "all_jobs")
        ),
        (job_id,),
    ).fetchone()
    return None if row is None else (row[0], row[1])


def keys(conn, schema) -> list[str]:
    query = sql.SQL(
        "SELECT job_id::text FROM {} WHERE actor_name = 'gated' AND idempotency_scope = 'unique'"
    ).format(sql.Identifier(schema, "job_keys"))
    return [r[0] for r in conn.execute(query).fetchall()]


@pytest.mark.parametrize("fail, end", [(False, "succeeded"), (True, "failed")])
def test_a_running_unique_job_is_returned_until_the_worker_ends_it(
    pg_url, schema, conn, sender, start_worker, fail, end
):
    worker = start_worker(app="tests.e2e.unique_app", threads=2)
    worker.wait_ready(120)
    name = f"{end}-gate"
    first = sender.send(name, fail)
    wait_for(
        lambda: state(conn, schema, first.message_id) == ("running", True),
        60,
        "the worker to start the unique job",
        on_timeout=worker.log_tail,
    )
    assert sender.send(name, fail).message_id == first.message_id
    assert keys(conn, schema) == [first.message_id]

    conn.execute(
        sql.SQL("INSERT INTO {} VALUES (%s)").format(sql.Identifier(schema, "unique_gates")),
        (name,),
    )
    wait_for(
        lambda: state(conn, schema, first.message_id)[0] == end,
        60,
        f"the worker to end the unique job {end}",
        on_timeout=worker.log_tail,
    )
    assert keys(conn, schema) == [], "the worker's ending left the key held"
    second = sender.send(name, fail)
    assert second.message_id != first.message_id
    wait_for(
        lambda: state(conn, schema, second.message_id)[0] == end,
        60,
        "the second job to run through the open gate",
        on_timeout=worker.log_tail,
    )
