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
            # Every send says its status (0022: the column's default refuses one that
            # does not).
            "status": "queued",
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
        # jobs_unfinished refuses every terminal row; migration 0021 dropped the checks it
        # implies (jobs_terminal_shape, jobs_status_check), which history keeps.
        ("succeeded without finished_at", {"status": "succeeded"}, "jobs_unfinished"),
        (
            "failed still locked",
            {"status": "failed", "finished_at": "2030-01-01", "locked_by": "w"},
            "jobs_unfinished",
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
        ("unknown status", {"status": "paused"}, "jobs_unfinished"),
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


def test_two_jobs_with_the_same_idempotency_key_are_not(conn, schema):
    """A key is held by job_keys' primary key (0012), which every send registers before it
    stores the job; jobs itself cannot hold a unique index without its lane (0028)."""
    keys = sql.SQL(
        "INSERT INTO {}.job_keys (actor_name, idempotency_scope, idempotency_key, job_id)"
        " VALUES ('a', '', 'order-42', gen_random_uuid())"
    ).format(sql.Identifier(schema))
    conn.execute(keys)
    with pytest.raises(psycopg.errors.UniqueViolation) as excinfo:
        conn.execute(keys)
    assert excinfo.value.diag.constraint_name == "job_keys_pkey"


def test_the_same_idempotency_key_for_two_actors_or_scopes_is_two_jobs(insert):
    insert(idempotency_key="order-43", actor_name="a")
    insert(idempotency_key="order-43", actor_name="b")
    insert(idempotency_key="order-43", actor_name="a", idempotency_scope="member:1")


def test_a_finished_job_has_no_place_in_the_jobs_table(insert):
    """Since 0012 the jobs table holds unfinished jobs only: a writer that would leave a
    finished row there (an older release's outcome) is refused, not silently kept."""
    with pytest.raises(psycopg.errors.CheckViolation) as excinfo:
        insert(status="succeeded", finished_at="2030-01-01")
    assert excinfo.value.diag.constraint_name == "jobs_unfinished"


def test_finished_jobs_land_in_their_status_and_day_or_in_a_default_partition(conn, schema):
    s = sql.Identifier(schema)
    (today,) = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()
    rows = {
        "succeeded": "now()",
        "failed": "now()",
        "cancelled": "'1999-01-01'::timestamptz",  # no partition for that day
    }
    placed = {}
    for status, finished_at in rows.items():
        job_id = str(uuid.uuid4())
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.jobs_history (id, queue_name, actor_name, message, status, "
                "finished_at) VALUES (%s, 'q', 'a', '{{}}', %s, " + finished_at + ")"
            ).format(s),
            (job_id, status),
        )
        placed[status] = conn.execute(
            sql.SQL("SELECT tableoid::regclass::text FROM {}.jobs_history WHERE id = %s").format(s),
            (job_id,),
        ).fetchone()[0]
    day = today.strftime("%Y%m%d")
    assert placed["succeeded"].endswith(f"jobs_history_succeeded_{day}")
    assert placed["failed"].endswith(f"jobs_history_failed_{day}")
    assert placed["cancelled"].endswith("jobs_history_cancelled_default")
    with pytest.raises(psycopg.errors.CheckViolation):
        # Nothing unfinished in history (no partition takes it).
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.jobs_history (id, queue_name, actor_name, message, status, "
                "finished_at) VALUES (%s, 'q', 'a', '{{}}', 'queued', now())"
            ).format(s),
            (str(uuid.uuid4()),),
        )


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
def test_history_keeps_the_terminal_shape_the_hot_table_dropped(conn, schema, status):
    """Migration 0021 dropped jobs_terminal_shape (and jobs_status_check) from the jobs
    table only, where jobs_unfinished implies them: history's partitions, where finished
    rows live, still refuse a finished row that keeps its lock (an unknown status finds
    no partition there)."""
    with pytest.raises(psycopg.errors.CheckViolation) as excinfo:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.jobs_history (id, queue_name, actor_name, message, status, "
                "finished_at, locked_by) VALUES (%s, 'q', 'a', '{{}}', %s, now(), 'w')"
            ).format(sql.Identifier(schema)),
            (str(uuid.uuid4()), status),
        )
    assert excinfo.value.diag.constraint_name == "jobs_terminal_shape", status


def test_the_hot_table_checks_each_shape_once(conn, schema):
    """The jobs table carries no check that jobs_unfinished implies (migration 0021): each
    check is prepared and evaluated at every send and claim."""
    names = {
        name
        for (name,) in conn.execute(
            "SELECT conname FROM pg_constraint WHERE contype = 'c' AND conrelid = %s::regclass",
            (f'"{schema}".jobs',),
        )
    }
    assert "jobs_unfinished" in names
    assert not names & {"jobs_status_check", "jobs_terminal_shape"}, names


def test_the_claim_and_reaper_indexes_are_partial(conn, schema):
    rows = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %s", (schema,)
    ).fetchall()
    indexes = dict(rows)
    assert "WHERE (status = 'queued'::text)" in indexes["jobs_claim_order_idx"]
    assert "(queue_name, priority, available_at, created_at, id)" in indexes["jobs_claim_order_idx"]
    assert "WHERE (status = 'running'::text)" in indexes["jobs_lease_expiry_idx"]
    assert "(job_id, id)" in indexes["job_events_job_id_idx"]


@pytest.mark.parametrize("lane", ["jobs_lane_0", "jobs_lane_1", "jobs_lane_2", "jobs_lane_long"])
def test_the_queue_table_has_aggressive_autovacuum(conn, schema, lane):
    options = conn.execute(
        "SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
        (f'"{schema}".{lane}',),
    ).fetchone()[0]
    assert "autovacuum_vacuum_scale_factor=0.01" in options
    assert "fillfactor=45" in options


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
