"""The worker registry: a worker process records itself when it boots, its heartbeat
refreshes the row (jobs in flight included), a clean exit removes it, silence expires it;
the actors and queues it declared outlive it."""

from __future__ import annotations

import os
import socket
import threading

import dramatiq
import pytest
from psycopg import sql

from dramatiq_pg_broker import __version__, current_job
from dramatiq_pg_broker.control.workers import actor_queue, list_actors, list_workers

from ..helpers import wait_for

pytestmark = pytest.mark.timeout(60)


def registered(broker, worker_id):
    with broker.pool.connection() as conn:
        return next(
            (w for w in list_workers(conn, broker.settings.schema) if w["id"] == worker_id), None
        )


def test_a_worker_registers_refreshes_and_deregisters(h):
    broker = h.broker(lease_seconds=1.5)  # a heartbeat every 0.5 s
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"{h.queue}.hold")
    def hold():
        h.record("start", current_job().id)
        release.wait(10)

    worker = h.start(broker)
    worker_id = broker.presence.worker_id
    row = wait_for(lambda: registered(broker, worker_id), 5, "the worker's row")
    assert (row["host"], row["pid"], row["version"]) == (
        socket.gethostname(),
        os.getpid(),
        __version__,
    )
    assert row["queues"] == [h.queue] and row["actors"] == [f"{h.queue}.hold"]
    assert row["expires_at"] > row["heartbeat_at"]

    job_id = hold.send().message_id
    wait_for(lambda: h.ran("start", job_id), 10, "the job running")
    beat = wait_for(
        lambda: (r := registered(broker, worker_id)) and r["in_flight"] == 1 and r,
        5,
        "a heartbeat reporting the job in flight",
    )
    assert beat["heartbeat_at"] > row["heartbeat_at"]
    release.set()

    worker.stop(timeout=10_000)
    h.workers.remove(worker)
    assert registered(broker, worker_id) is None, "a clean exit leaves no row"
    # What it declared outlives it: jobs can still be created for its actors.
    with broker.pool.connection() as conn:
        assert actor_queue(conn, broker.settings.schema, f"{h.queue}.hold") == h.queue
        actors = {a["actor_name"]: a for a in list_actors(conn, broker.settings.schema)}
    assert actors[f"{h.queue}.hold"]["live_workers"] == 0


def test_a_silent_worker_expires(h, pg_url, schema):
    broker = h.broker()
    with broker.pool.connection() as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.workers (id, host, pid, expires_at)"
                " VALUES ('gone:1:x', 'gone', 1, now() - interval '1 second'),"
                " ('live:2:y', 'live', 2, now() + interval '1 minute')"
            ).format(sql.Identifier(schema))
        )
        ids = [w["id"] for w in list_workers(conn, schema)]
    assert "live:2:y" in ids and "gone:1:x" not in ids


def test_a_job_created_through_the_api_takes_the_declared_actors_max_retries(h, pg_url, schema):
    """A worker records the options it declared each actor with (migration 0014); the admin
    API, which holds no actor code, creates the actor's jobs with them: an actor declared
    with max_retries=0 gets a row of one attempt, not the global default's 21."""
    from .admin_support import AdminEnv

    broker = h.broker()

    @dramatiq.actor(
        broker=broker,
        queue_name=h.queue,
        actor_name=f"{h.queue}.once",
        max_retries=0,
        priority=7,
        retry_when=lambda retries, exc: False,  # not JSON: not recorded
    )
    def once():
        pass

    @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name=f"{h.queue}.plain")
    def plain():
        pass

    h.start(broker)
    worker_id = broker.presence.worker_id
    wait_for(lambda: registered(broker, worker_id), 5, "the worker's row")
    with broker.pool.connection() as conn:
        options = dict(
            conn.execute(
                sql.SQL("SELECT actor_name, options FROM {}.actors").format(sql.Identifier(schema))
            ).fetchall()
        )
    assert options[f"{h.queue}.once"] == {"priority": 7, "max_retries": 0}
    assert options[f"{h.queue}.plain"] == {"priority": 0}

    api = AdminEnv(pg_url, schema, admin_adhoc_actors=False)
    try:
        job = api.create_job(actor_name=f"{h.queue}.once")
        assert (job["max_attempts"], job["priority"]) == (1, 7)
        assert job["queue_name"] == h.queue
        # What the request says wins over the declaration.
        asked = api.create_job(actor_name=f"{h.queue}.once", max_retries=2, priority=1)
        assert (asked["max_attempts"], asked["priority"]) == (3, 1)
        # An actor declared without max_retries keeps the global default.
        default = api.create_job(actor_name=f"{h.queue}.plain")
        assert default["max_attempts"] == api.settings.max_attempts
    finally:
        api.close()
