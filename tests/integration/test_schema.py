"""The database itself rejects every invalid job shape (not just the code)."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb


@pytest.fixture
def insert(conn, schema):
    table = sql.SQL("{}.jobs").format(sql.Identifier(schema))

    def insert_job(**fields):
        row = {
            "id": str(uuid.uuid4()),
            "queue_name": "default",
            "actor_name": "an_actor",
            "message": Jsonb({"args": []}),
            **fields,
        }
        columns = sql.SQL(", ").join(sql.Identifier(c) for c in row)
        values = sql.SQL(", ").join(sql.Placeholder(c) for c in row)
        conn.execute(sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(table, columns, values), row)
        return row["id"]

    return insert_job


def test_a_plain_queued_job_is_accepted(insert, conn, schema):
    job_id = insert()
    status, attempts, max_attempts = conn.execute(
        sql.SQL("SELECT status, attempts, max_attempts FROM {}.jobs WHERE id = %s").format(
            sql.Identifier(schema)
        ),
        (job_id,),
    ).fetchone()
    assert (status, attempts, max_attempts) == ("queued", 0, 21)


@pytest.mark.parametrize(
    ("shape", "fields", "constraint"),
    [
        (
            "running without locked_by",
            {"status": "running", "locked_until": "2030-01-01", "started_at": "2030-01-01"},
            "jobs_running_shape",
        ),
        (
            "running without locked_until",
            {"status": "running", "locked_by": "w", "started_at": "2030-01-01"},
            "jobs_running_shape",
        ),
        ("succeeded without finished_at", {"status": "succeeded"}, "jobs_terminal_shape"),
        (
            "failed still locked",
            {"status": "failed", "finished_at": "2030-01-01", "locked_by": "w"},
            "jobs_terminal_shape",
        ),
        (
            "queued with a lock",
            {"locked_by": "w", "locked_until": "2030-01-01"},
            "jobs_queued_shape",
        ),
        ("queued and finished", {"finished_at": "2030-01-01"}, "jobs_queued_shape"),
        ("negative attempts", {"attempts": -1}, "jobs_counts_in_range"),
        (
            "more failures than attempts",
            {"attempts": 1, "failures": 1, "interruptions": 1},
            "jobs_counts_in_range",
        ),
        ("a queued row that started", {"started": True}, "jobs_started_shape"),
        ("max_attempts of zero", {"max_attempts": 0}, "jobs_max_attempts_positive"),
        ("unknown status", {"status": "paused"}, "jobs_status_check"),
        ("no message at all", {"message": None}, "jobs_message_stored"),
        ("blank actor name", {"actor_name": ""}, "jobs_actor_name_check"),
    ],
)
def test_invalid_shapes_are_rejected_by_the_database(insert, shape, fields, constraint):
    with pytest.raises(psycopg.errors.CheckViolation) as excinfo:
        insert(**fields)
    assert excinfo.value.diag.constraint_name == constraint, shape


def test_many_jobs_without_an_idempotency_key_are_fine(insert):
    for _ in range(5):
        insert(idempotency_key=None)


def test_two_jobs_with_the_same_idempotency_key_are_not(insert):
    insert(idempotency_key="order-42")
    with pytest.raises(psycopg.errors.UniqueViolation) as excinfo:
        insert(idempotency_key="order-42")
    assert excinfo.value.diag.constraint_name == "jobs_idempotency_key_scoped_uq"


def test_the_same_idempotency_key_for_two_actors_or_scopes_is_two_jobs(insert):
    insert(idempotency_key="order-43", actor_name="a")
    insert(idempotency_key="order-43", actor_name="b")
    insert(idempotency_key="order-43", actor_name="a", idempotency_scope="member:1")


def test_deleting_a_job_deletes_its_events(insert, conn, schema):
    job_id = insert()
    s = sql.Identifier(schema)
    conn.execute(
        sql.SQL("INSERT INTO {}.job_events (job_id, type) VALUES (%s, 'created')").format(s),
        (job_id,),
    )
    conn.execute(sql.SQL("DELETE FROM {}.jobs WHERE id = %s").format(s), (job_id,))
    left = conn.execute(
        sql.SQL("SELECT count(*) FROM {}.job_events WHERE job_id = %s").format(s), (job_id,)
    ).fetchone()[0]
    assert left == 0


def test_one_statement_deleting_many_jobs_deletes_their_events_and_no_others(insert, conn, schema):
    """The events follow their jobs through a statement-level trigger (no foreign key
    checks every event row): whatever statement deletes jobs, their events go with them."""
    s = sql.Identifier(schema)
    doomed = f"doomed_{uuid.uuid4().hex[:8]}"
    gone = [insert(queue_name=doomed) for _ in range(3)]
    kept = insert(queue_name="kept")
    for job_id in [*gone, kept]:
        conn.execute(
            sql.SQL("INSERT INTO {}.job_events (job_id, type) VALUES (%s, 'created')").format(s),
            (job_id,),
        )
    conn.execute(sql.SQL("DELETE FROM {}.jobs WHERE queue_name = %s").format(s), (doomed,))
    counts = dict(
        conn.execute(
            sql.SQL(
                "SELECT job_id::text, count(*) FROM {}.job_events "
                "WHERE job_id = ANY(%s::uuid[]) GROUP BY 1"
            ).format(s),
            ([*gone, kept],),
        ).fetchall()
    )
    assert counts == {kept: 1}


def test_the_claim_and_reaper_indexes_are_partial(conn, schema):
    rows = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %s", (schema,)
    ).fetchall()
    indexes = dict(rows)
    assert "WHERE (status = 'queued'::text)" in indexes["jobs_claim_order_idx"]
    assert "(queue_name, priority, available_at, created_at, id)" in indexes["jobs_claim_order_idx"]
    assert "WHERE (status = 'running'::text)" in indexes["jobs_lease_expiry_idx"]
    assert "(job_id, id)" in indexes["job_events_job_id_idx"]


def test_the_queue_table_has_aggressive_autovacuum(conn, schema):
    options = conn.execute(
        "SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
        (f'"{schema}".jobs',),
    ).fetchone()[0]
    assert "autovacuum_vacuum_scale_factor=0.01" in options


def test_sending_before_migrating_says_to_migrate(pg_url):
    import dramatiq

    from dramatiq_pg_broker import PostgresBroker, SchemaMissing

    broker = PostgresBroker(url=pg_url, schema="never_migrated_schema")
    actor = dramatiq.actor(lambda: None, actor_name="nothing", broker=broker)
    try:
        with pytest.raises(SchemaMissing, match="dramatiq-pg-broker migrate"):
            actor.send()
    finally:
        broker.close()
