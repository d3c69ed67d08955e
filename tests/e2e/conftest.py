"""Fixtures for the tests that run real ``dramatiq`` worker processes."""

from __future__ import annotations

import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker

from .clusters import cluster_factory
from .worker_actors import create_executions_table, declare
from .workers import worker_starter


@pytest.fixture
def start_worker(pg_url, schema, tmp_path):
    """Start real worker processes on the module's schema; all are stopped afterwards."""
    yield from worker_starter(pg_url, schema, tmp_path)


@pytest.fixture
def new_cluster():
    """Make throwaway PostgreSQL clusters of the test's own (see :mod:`.clusters`): the
    fixture's value makes one and starts it; every one is removed afterwards."""
    yield from cluster_factory()


@pytest.fixture
def recorded_actors(pg_url, schema, conn):
    """``(broker, actors)``: the actors of :mod:`.worker_actors` (by name), declared on a
    broker of the module's schema to send their messages, with an empty ``executions``
    table and none of the module's earlier jobs left; the broker is closed afterwards."""
    schema_id = sql.Identifier(schema)
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}.executions").format(schema_id))
    conn.execute(
        sql.SQL("TRUNCATE {0}.jobs, {0}.jobs_history, {0}.job_keys CASCADE").format(schema_id)
    )
    create_executions_table(conn, schema)
    broker = PostgresBroker(url=pg_url, schema=schema)
    yield broker, declare(broker)
    broker.close()
