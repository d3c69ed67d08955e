"""An actor whose one effect, a row of an application table, commits with the job's
success (``current_job().complete_in()``), declared on whichever broker it is given: the
``dramatiq`` subprocesses import :mod:`tests.e2e.exactly_once_app`, the test process
declares it on its own broker to send messages."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker, current_job

QUEUE = "e2e_exactly_once"
TABLE = "exactly_once_effects"
#: The isolation level of the actor's transactions (psycopg's name, e.g. REPEATABLE_READ);
#: the connection's default when unset.
ISOLATION_ENV = "EXACTLY_ONCE_ISOLATION"

#: The application's connection of each worker thread (not in autocommit mode: the block
#: begins a transaction on it and commits it).
_local = threading.local()


def create_table(conn, schema: str) -> None:
    """The application's table; no constraint, so that a duplicate would be counted."""
    conn.execute(
        sql.SQL("CREATE TABLE {} (job_id uuid NOT NULL, n integer NOT NULL)").format(
            sql.Identifier(schema, TABLE)
        )
    )


def declare(broker: PostgresBroker) -> dramatiq.Actor:
    insert = sql.SQL("INSERT INTO {} (job_id, n) VALUES (%s, %s)").format(
        sql.Identifier(broker.settings.schema, TABLE)
    )

    @dramatiq.actor(broker=broker, queue_name=QUEUE, actor_name="insert_once", max_retries=50)
    def insert_once(n: int, hold_ms: float) -> None:
        conn = getattr(_local, "conn", None)
        if conn is None or conn.closed:
            conn = _local.conn = psycopg.connect(broker.settings.url)
            level = os.environ.get(ISOLATION_ENV)
            if level:
                conn.isolation_level = psycopg.IsolationLevel[level]
        job = current_job()
        with job.complete_in(conn):
            conn.execute(insert, (job.id, n))
            # Widen the window between the effect and its commit, where a kill lands.
            time.sleep(random.uniform(0, hold_ms) / 1000)
        # And the one after the commit, before the worker's ack: a kill there must not run
        # the job (and its effect) again.
        time.sleep(random.uniform(0, hold_ms) / 1000)

    return insert_once


# -- application code as it is written (test_exactly_once_app_code) ---------------------------

APP_QUEUE = "e2e_exactly_once_app"
APP_EFFECTS = "app_code_effects"
APP_STEPS = "app_code_steps"


def create_app_tables(conn, schema: str) -> None:
    """The effects of the app-code actors (job, kind), and what their pipelines and
    callbacks did (kind, value); no constraint, so that a duplicate is counted."""
    for ddl, table in (
        ("CREATE TABLE {} (job_id uuid NOT NULL, kind text NOT NULL)", APP_EFFECTS),
        ("CREATE TABLE {} (kind text NOT NULL, value text)", APP_STEPS),
    ):
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(schema, table)))
        conn.execute(sql.SQL(ddl).format(sql.Identifier(schema, table)))


def declare_app_code(broker: PostgresBroker) -> dict[str, dramatiq.Actor]:
    """The actors of test_exactly_once_app_code, declared on ``broker``; returns them by
    name. The broker needs the Results middleware (the test reads a result)."""
    schema = broker.settings.schema
    insert = sql.SQL("INSERT INTO {} (job_id, kind) VALUES (%s, %s)").format(
        sql.Identifier(schema, APP_EFFECTS)
    )
    step = sql.SQL("INSERT INTO {} (kind, value) VALUES (%s, %s)").format(
        sql.Identifier(schema, APP_STEPS)
    )
    sa_url = "postgresql+psycopg://" + broker.settings.url.split("://", 1)[1]
    options = {"broker": broker, "queue_name": APP_QUEUE, "max_retries": 2, "min_backoff": 100}

    def record(kind: str, value: object) -> None:
        with psycopg.connect(broker.settings.url, autocommit=True) as conn:
            conn.execute(step, (kind, None if value is None else str(value)))

    @dramatiq.actor(**options)
    def commits_inside(kind: str) -> None:
        """SQLAlchemy's habit: commit() inside the block."""
        import sqlalchemy as sa
        from sqlalchemy.orm import Session

        job = current_job()
        engine = sa.create_engine(sa_url, poolclass=sa.pool.NullPool)
        text = sa.text(insert.as_string().replace("%s", ":a", 1).replace("%s", ":b", 1))
        try:
            with Session(engine) if kind == "session" else engine.connect() as obj:
                with job.complete_in(obj):
                    obj.execute(text, {"a": job.id, "b": f"commit-{kind}"})
                    obj.commit()
        finally:
            engine.dispose()

    @dramatiq.actor(**options)
    def strict_block(level: str, joined: bool, hold: float) -> None:
        """A block at REPEATABLE READ or SERIALIZABLE that outlasts the worker's writes to
        the job's row (its start after 0.1 s, lease renewals)."""
        job = current_job()
        with psycopg.connect(broker.settings.url) as conn:
            conn.isolation_level = psycopg.IsolationLevel[level]
            with conn.transaction() if joined else contextlib.nullcontext():
                with job.complete_in(conn):
                    conn.execute(insert, (job.id, f"{level}-{'joins' if joined else 'begins'}"))
                    time.sleep(hold)

    @dramatiq.actor(**options, store_results=True)
    def raises_after() -> str:
        job = current_job()
        with psycopg.connect(broker.settings.url) as conn, job.complete_in(conn):
            conn.execute(insert, (job.id, "raises-after"))
        raise RuntimeError("after the block")

    @dramatiq.actor(**options)
    def next_step(value: object) -> None:
        record("next", value)

    @dramatiq.actor(**options)
    def on_ok(message: dict, result: object) -> None:
        record("success", result)

    @dramatiq.actor(**options)
    def on_ko(message: dict, exception: dict) -> None:
        record("failure", exception["type"])

    @dramatiq.actor(**options)
    def holds_after(hold: float) -> None:
        """Its success written, it holds the application's transaction a while."""
        job = current_job()
        with psycopg.connect(broker.settings.url, application_name="holder") as conn:
            with conn.transaction():
                with job.complete_in(conn):
                    conn.execute(insert, (job.id, "holds-after"))
                time.sleep(hold)

    return {
        actor.actor_name: actor
        for actor in (
            commits_inside,
            strict_block,
            raises_after,
            next_step,
            on_ok,
            on_ko,
            holds_after,
        )
    }
