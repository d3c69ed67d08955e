"""Reading a job in tests through the job store's own API (so that the tests follow the
tables wherever the store keeps them), on the store's pooled connections: only committed
rows are seen. And a job store of a test's own, with no job in it (:func:`emptied_store`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
from psycopg import sql

from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.errors import JobNotFound
from dramatiq_pg_broker.jobs import JobStore


@contextlib.contextmanager
def emptied_store(url: str, schema: str) -> Iterator[JobStore]:
    """A job store on its own pool (closed at the end), with the waiting, running and
    finished jobs of ``schema`` and their keys deleted first."""
    pool = ProcessPool(Settings.load(url=url, schema=schema))
    try:
        with pool.connection() as conn:
            conn.execute(
                f"TRUNCATE {schema}.jobs, {schema}.jobs_history, {schema}.job_keys CASCADE"
            )
        yield JobStore(pool, schema)
    finally:
        pool.close()


def status_of(store: JobStore, job_id: str) -> str | None:
    """A job's status, None if there is no such job."""
    try:
        return store.get(job_id)["status"]
    except JobNotFound:
        return None


def event_types(store: JobStore, job_id: str) -> list[str]:
    """A job's event types, oldest first."""
    return [event["type"] for event in store.events_of(job_id)]


def created_count(conn: psycopg.Connection, schema: str) -> int:
    """How many jobs were ever created in ``schema`` (their ``created`` events, which only
    retention deletes, days later): a send that left no job leaves this unchanged, whether
    or not workers ran other jobs meanwhile."""
    query = sql.SQL("SELECT count(*) FROM {} WHERE type = 'created'").format(
        sql.Identifier(schema, "job_events")
    )
    return conn.execute(query).fetchone()[0]


def tables_of(conn: psycopg.Connection, schema: str, job_id: str) -> list[tuple[str, str]]:
    """(table, status) of every row with this id, in ``jobs`` and in ``jobs_history``: more
    than one means the id has a second row."""
    return conn.execute(
        sql.SQL(
            "SELECT 'jobs', status FROM {s}.jobs WHERE id = %(id)s "
            "UNION ALL SELECT 'history', status FROM {s}.jobs_history WHERE id = %(id)s"
        ).format(s=sql.Identifier(schema)),
        {"id": job_id},
    ).fetchall()
