"""Fixtures of the integration tests (real PostgreSQL, the module's schema): a job store, a
broker, a queue and an actor of the test's own, in-process workers, the admin API."""

from __future__ import annotations

import functools
import uuid

import dramatiq
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.jobs import JobStore

from .harness import Harness, start_worker, stop_workers


@pytest.fixture(scope="module")
def store(pg_url, schema):
    """The job store on the module's schema."""
    store = JobStore(ProcessPool(Settings(url=pg_url, schema=schema)), schema)
    yield store
    store.pool.close()


@pytest.fixture
def run(pg_url, schema, capsys):
    """``run(*args)`` runs the ``dramatiq-pg-broker`` command on the module's schema and
    returns its exit code, stdout and stderr."""
    from dramatiq_pg_broker import cli

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = cli.main(["--url", pg_url, "--schema", schema, *args])
        except SystemExit as e:  # argparse's own errors exit from parse_args
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def queue():
    """A queue name of the test's own."""
    return f"q_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def broker(pg_url, schema):
    """A broker on the module's schema, polling every 0.1 s. ``broker.start_worker(threads=1)``
    starts an in-process worker (see
    :func:`~.harness.start_worker`); workers are stopped and the broker closed afterwards."""
    previous = dramatiq.broker.global_broker
    broker = PostgresBroker(url=pg_url, schema=schema, poll_interval=0.1)
    workers: list[dramatiq.Worker] = []
    broker.start_worker = functools.partial(start_worker, broker, workers)
    yield broker
    stop_workers(workers)
    broker.close()
    dramatiq.broker.global_broker = previous


@pytest.fixture
def task(broker, queue):
    """An actor of the test's queue that does nothing with its one argument."""

    @dramatiq.actor(broker=broker, queue_name=queue, actor_name=f"task_{queue}")
    def task(n):
        pass

    return task


@pytest.fixture
def app_table(conn, schema):
    """``app_table(name)``: an application's own table ``name`` (one int column ``n``)
    next to the broker's, emptied; returns its INSERT statement (one parameter)."""

    def make(name: str) -> sql.Composed:
        table = sql.Identifier(schema, name)
        conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (n int)").format(table))
        conn.execute(sql.SQL("TRUNCATE {}").format(table))
        return sql.SQL("INSERT INTO {} VALUES (%s)").format(table)

    return make


@pytest.fixture
def h(pg_url, schema):
    """A :class:`~.harness.Harness`: brokers, a queue and in-process workers."""
    harness = Harness(pg_url, schema)
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def admin_settings() -> dict:
    """Settings of the module's admin API (:func:`env`); a module overrides this fixture to
    change them (``cors_origins``, ``trusted_proxies`` ...)."""
    return {}


@pytest.fixture(scope="module")
def env(pg_url, schema, admin_settings):
    """The admin API on the module's schema, with a user and a token per role (see
    :class:`~.admin_support.AdminEnv`)."""
    from .admin_support import AdminEnv

    env = AdminEnv(pg_url, schema, **admin_settings)
    yield env
    env.close()
