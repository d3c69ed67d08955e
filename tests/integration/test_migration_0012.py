"""Migration 0012 on a database that already holds history: finished jobs move to the
partitioned jobs_history, events to the partitioned job_events, unfinished jobs stay where
the claim finds them, and nothing is lost or changed on the way.

The big case holds 200,000 finished jobs in ``make test``, enough to show whether the
migration keeps its bulk path in a fifth of the time a million takes;
``DRAMATIQ_PG_MIGRATION_ROWS=1000000`` runs it on the million whose time the upgrading
guide quotes. It prints how long the migration took.
"""

from __future__ import annotations

import os
import time

import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker.migrate import migrate

#: Finished jobs in the big case.
ROWS = int(os.environ.get("DRAMATIQ_PG_MIGRATION_ROWS", "200000"))
#: The most the migration may take per finished job: 300 s for a million (measured: 24.9 s
#: for a million on a 2-core machine, see the upgrading guide). Far more means it lost its
#: bulk path (indexes built per row, rows in DEFAULT partitions).
MOST_SECONDS_PER_ROW = 300 / 1_000_000
#: Events of each finished job: 2 (created, and its end), or 3 (a claimed one between, as a
#: job that ran once has; the figure the upgrading guide quotes for 200,000 jobs).
EVENTS_PER_JOB = int(os.environ.get("DRAMATIQ_PG_MIGRATION_EVENTS", "2"))


def _fill(conn, schema: str, finished: int, events: int = 2) -> None:
    """``finished`` finished jobs over the last 20 days (succeeded, failed, cancelled, in
    the proportions 90/8/2), each with its created and final events (and a claimed one
    between with ``events=3``), and a few unfinished jobs, written as the release before
    0012 wrote them. The indexes that back no constraint are built after the rows are in,
    with their own definitions, as a bulk load would: a million rows are written in a
    fraction of the time, and the migration meets the same indexes."""
    q = sql.Identifier(schema)
    indexes = conn.execute(
        """
        SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid)
        FROM pg_index AS i
        WHERE i.indrelid IN (%(jobs)s::regclass, %(events)s::regclass)
          AND NOT EXISTS (SELECT FROM pg_constraint AS c WHERE c.conindid = i.indexrelid)
        """,
        {"jobs": f'"{schema}".jobs', "events": f'"{schema}".job_events'},
    ).fetchall()
    for name, _ in indexes:
        conn.execute(f"DROP INDEX {name}")
    conn.execute(
        sql.SQL(
            """
            INSERT INTO {q}.jobs (id, queue_name, actor_name, message, message_bytes, status,
                                  attempts, max_attempts, failures, idempotency_key,
                                  last_error, created_at, updated_at, started_at, finished_at)
            SELECT md5(n::text)::uuid, 'q' || (n %% 4), 'a' || (n %% 7),
                   jsonb_build_object('args', jsonb_build_array(n)), convert_to(n::text, 'UTF8'),
                   s.status, CASE WHEN s.status = 'cancelled' THEN 0 ELSE 1 END, 3,
                   CASE WHEN s.status = 'failed' THEN 1 ELSE 0 END,
                   CASE WHEN n %% 100 = 0 THEN 'key-' || n END,
                   CASE WHEN s.status = 'failed' THEN 'boom' END,
                   t.at - interval '1 second', t.at, t.at - interval '1 second', t.at
            FROM generate_series(1, %(n)s) AS n
            CROSS JOIN LATERAL (SELECT CASE WHEN n %% 50 = 0 THEN 'cancelled'
                                            WHEN n %% 50 < 5 THEN 'failed'
                                            ELSE 'succeeded' END AS status) AS s
            CROSS JOIN LATERAL (SELECT now() - (n %% 20) * interval '1 day'
                                       - (n %% 86400) * interval '1 second' AS at) AS t
            """
        ).format(q=q),
        {"n": finished},
    )
    conn.execute(
        sql.SQL(
            """
            INSERT INTO {q}.job_events (job_id, type, attempt, created_at)
            SELECT id, e.type, e.attempt, CASE e.type WHEN 'created' THEN created_at
                                                      WHEN 'claimed' THEN started_at
                                                      ELSE finished_at END
            FROM {q}.jobs
            CROSS JOIN LATERAL (VALUES ('created', 0),
                                       ('claimed', 1),
                                       (CASE status WHEN 'succeeded' THEN 'succeeded'
                                                    WHEN 'failed' THEN 'failed'
                                                    ELSE 'cancelled' END, attempts))
                    AS e (type, attempt)
            WHERE e.type <> 'claimed' OR (%(events)s >= 3 AND status <> 'cancelled')
            ORDER BY created_at
            """
        ).format(q=q),
        {"events": events},
    )
    conn.execute(
        sql.SQL(
            """
            INSERT INTO {q}.jobs (id, queue_name, actor_name, message, status, available_at,
                                  attempts, max_attempts, idempotency_key, locked_by,
                                  locked_until, started_at, started)
            VALUES ('00000000-0000-0000-0000-00000000000a', 'q0', 'a0', '{{}}', 'queued',
                    now() + interval '1 hour', 0, 3, 'waiting-key', NULL, NULL, NULL, false),
                   ('00000000-0000-0000-0000-00000000000b', 'q1', 'a1', '{{}}', 'running',
                    now(), 1, 3, NULL, 'host:1:1:x', now() + interval '1 minute', now(), true)
            """
        ).format(q=q)
    )
    conn.execute(
        sql.SQL(
            "INSERT INTO {q}.job_events (job_id, type, attempt) "
            "SELECT id, 'created', 0 FROM {q}.jobs WHERE status IN ('queued', 'running')"
        ).format(q=q)
    )
    for _, definition in indexes:
        conn.execute(definition)


def _snapshot(conn, schema: str, table: str):
    q = sql.Identifier(schema)
    return conn.execute(
        sql.SQL(
            "SELECT count(*), count(DISTINCT id), "
            "sum(hashtext(id::text || status || coalesce(last_error, '') || attempts "
            "|| finished_at::text || coalesce(idempotency_key, '') || message::text)) "
            "FROM {q}.{t} WHERE finished_at IS NOT NULL"
        ).format(q=q, t=sql.Identifier(table))
    ).fetchone()


def _events(conn, schema: str):
    q = sql.Identifier(schema)
    return conn.execute(
        sql.SQL(
            "SELECT count(*), max(id), sum(hashtext(job_id::text || type || created_at::text)) "
            "FROM {q}.job_events"
        ).format(q=q)
    ).fetchone()


def _migrate_and_check(pg_url, schema, tmp_path, finished: int, events: int = 2) -> float:
    migrate(pg_url, schema, target=11)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        _fill(conn, schema, finished, events)
        jobs_before = _snapshot(conn, schema, "jobs")
        events_before = _events(conn, schema)
    assert jobs_before[0] == finished

    started = time.monotonic()
    # Forced: the fixture's running job stands for a worker killed before the deploy, whose
    # lease is still live (migrate would refuse it: see test_deploy_order).
    applied = migrate(pg_url, schema, target=12, force=True)
    took = time.monotonic() - started
    assert [m.version for m in applied] == [12]
    print(
        f"migration 0012 moved {finished} finished jobs ({events_before[0]} events) in {took:.1f}s"
    )

    q = sql.Identifier(schema)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert _snapshot(conn, schema, "jobs_history") == jobs_before
        assert _snapshot(conn, schema, "all_jobs") == jobs_before
        assert _events(conn, schema) == events_before
        unfinished = conn.execute(
            sql.SQL("SELECT id::text, status FROM {q}.jobs ORDER BY id").format(q=q)
        ).fetchall()
        assert unfinished == [
            ("00000000-0000-0000-0000-00000000000a", "queued"),
            ("00000000-0000-0000-0000-00000000000b", "running"),
        ]
        # Finished rows landed in their day's partition, not in the DEFAULT ones.
        (in_default,) = conn.execute(
            sql.SQL(
                "SELECT (SELECT count(*) FROM {q}.jobs_history_succeeded_default) "
                "+ (SELECT count(*) FROM {q}.job_events_default)"
            ).format(q=q)
        ).fetchone()
        assert in_default == 0
        # New events continue the old ids.
        conn.execute(
            sql.SQL(
                "INSERT INTO {q}.job_events (job_id, type) "
                "VALUES ('00000000-0000-0000-0000-00000000000a', 'progress')"
            ).format(q=q)
        )
        newest_id = sql.SQL("SELECT max(id) FROM {q}.job_events").format(q=q)
        (newest,) = conn.execute(newest_id).fetchone()
        assert newest == events_before[1] + 1
    return took


def test_0012_moves_history_and_events_and_keeps_unfinished_jobs(pg_url, empty_schema, tmp_path):
    _migrate_and_check(pg_url, empty_schema, tmp_path, 5_000, events=3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_0012_on_many_finished_jobs(pg_url, empty_schema, tmp_path):
    took = _migrate_and_check(pg_url, empty_schema, tmp_path, ROWS, EVENTS_PER_JOB)
    most = ROWS * MOST_SECONDS_PER_ROW
    assert took < most, (
        f"migration 0012 took {took:.0f}s for {ROWS} finished jobs (at most {most:.0f}s)"
    )


def test_an_upgrade_without_events_ends_with_empty_default_partitions(pg_url, empty_schema):
    """Finished jobs over 10 days and no events (events turned off, or pruned): 0012 starts
    its daily partitions at the later of the oldest finished job and the oldest event (here
    today), so the older days' rows land in the DEFAULT partitions (released: it cannot
    change). The first maintenance run's `default` step moves them into their days'
    partitions, in batches; nothing is lost, nothing is left in DEFAULT."""
    from dramatiq_pg_broker.config import Settings
    from dramatiq_pg_broker.db import ProcessPool
    from dramatiq_pg_broker.retention import RetentionPolicy, prune

    schema = empty_schema
    q = sql.Identifier(schema)
    migrate(pg_url, schema, target=11)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        _fill(conn, schema, 10_000)
        conn.execute(sql.SQL("DELETE FROM {q}.job_events").format(q=q))
        conn.execute(
            sql.SQL("DELETE FROM {q}.jobs WHERE finished_at < now() - interval '10 days'").format(
                q=q
            )
        )
        jobs_before = _snapshot(conn, schema, "jobs")
    migrate(pg_url, schema, force=True)  # the fill stands for stopped old processes
    defaults = sql.SQL(
        "SELECT (SELECT count(*) FROM {q}.jobs_history_succeeded_default)"
        " + (SELECT count(*) FROM {q}.jobs_history_failed_default)"
        " + (SELECT count(*) FROM {q}.jobs_history_cancelled_default)"
    ).format(q=q)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        (in_default,) = conn.execute(defaults).fetchone()
    assert in_default > 1000, "0012 put the older days in DEFAULT (the case this covers)"

    pool = ProcessPool(Settings.load(url=pg_url, schema=schema))
    try:
        policy = RetentionPolicy(succeeded=None, failed=None, cancelled=None)  # keep all
        report = prune(pool, schema, policy, batch=1000, rest=False)
    finally:
        pool.close()
    assert not report.failed and report.complete, report.steps
    assert sum(report.moved.values()) == in_default
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute(defaults).fetchone() == (0,)
        assert _snapshot(conn, schema, "all_jobs") == jobs_before
        days = conn.execute(
            sql.SQL("SELECT count(DISTINCT tableoid) FROM {q}.jobs_history_succeeded").format(q=q)
        ).fetchone()[0]
    assert days >= 10
