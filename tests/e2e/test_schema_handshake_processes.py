"""The schema handshake in real processes: a ``dramatiq`` worker started before the
migration waits and says so once, then proceeds; a worker whose code the schema no longer
admits stops with one line; gunicorn boots against a schema behind its code and serves once
it is migrated.

A schema newer than this code is made with a migrations folder holding one more, breaking,
migration (the seam named in :mod:`dramatiq_pg_broker.db.handshake`): this release then plays
the part of an earlier release that can check, with no change to its code.
"""

from __future__ import annotations

import contextlib
import json
import signal

import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.db import handshake
from dramatiq_pg_broker.migrate import migrate

from ..helpers import migrate_ahead
from .servers import HEALTH_REQUEST, free_port, raw_request, start_gunicorn, stop
from .worker_actors import create_executions_table, declare
from .workers import WorkerProcess, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: The ``dramatiq`` command forwards its workers' logs, and its own signals, only once they
#: booted or this many milliseconds passed (its ``--worker-fork-timeout``, 30 s by default);
#: a worker waiting for a migration has not booted.
FORK_TIMEOUT = ("--worker-fork-timeout", "1000")


def log_lines(worker: WorkerProcess) -> list[str]:
    return worker.log_path.read_text(errors="replace").splitlines()


@contextlib.contextmanager
def waiting_worker(pg_url: str, schema: str, tmp_path):
    """A ``dramatiq`` worker on ``schema`` (behind its code), once it said that it waits for
    a migration; its process group is killed afterwards."""
    worker = WorkerProcess(pg_url, schema, tmp_path / "worker.log", options=FORK_TIMEOUT)
    try:
        wait_for(
            lambda: any("waits for a migration" in line for line in log_lines(worker)),
            60,
            "the worker to say that it waits for the migration",
            on_timeout=worker.log_tail,
        )
        yield worker
    finally:
        worker.kill_group()


def status_of(pg_url: str, schema: str, job_id: str) -> str:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        # Before migration 0012 every job is in jobs; from it on, all_jobs holds both.
        (upgraded,) = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".all_jobs',)
        ).fetchone()
        query = sql.SQL("SELECT status FROM {}.{} WHERE id = %s").format(
            sql.Identifier(schema), sql.Identifier("all_jobs" if upgraded else "jobs")
        )
        return conn.execute(query, (job_id,)).fetchone()[0]


def test_a_worker_started_before_the_migration_waits_says_so_once_and_proceeds(
    pg_url, behind, conn, tmp_path
):
    schema = behind
    create_executions_table(conn, schema)
    # A job queued by the released code, which fits the schema as it is: written as that
    # release writes it (this code's sends need the pending migration's tables).
    sender = PostgresBroker(url=pg_url, schema=schema)
    message = declare(sender)["quick"].message()
    sender.close()
    job = message.message_id
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.jobs (id, queue_name, actor_name, message_bytes, max_attempts) "
            "VALUES (%s, %s, %s, %s, 21)"
        ).format(sql.Identifier(schema)),
        (job, message.queue_name, message.actor_name, message.encode()),
    )

    with waiting_worker(pg_url, schema, tmp_path) as worker:
        assert worker.proc.poll() is None, "the waiting worker exited"
        assert status_of(pg_url, schema, job) == "queued", "the waiting worker claimed a job"

        # Forced: the job above stands for one the released code sent just before it
        # stopped, which a breaking migration would otherwise count as live work.
        migrate(pg_url, schema, force=True)
        wait_for(
            lambda: status_of(pg_url, schema, job) == "succeeded",
            handshake.WAIT_SECONDS + 30,
            "the worker to proceed and run the job after the migration",
            on_timeout=worker.log_tail,
        )
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.log_tail()
    lines = log_lines(worker)
    waits = [line for line in lines if "waits for a migration" in line]
    assert len(waits) == 1, waits
    assert "run `dramatiq-pg-broker migrate`" in waits[0] and "[WARNING]" in waits[0]
    assert any("this worker proceeds" in line for line in lines), lines
    assert not [line for line in lines if "[ERROR]" in line or "[CRITICAL]" in line], lines
    assert "Traceback" not in "\n".join(lines)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_waiting_worker_stops_at_once_and_cleanly(pg_url, behind, tmp_path, signum):
    """Stopped before the schema fits, the worker never registered: its shutdown writes
    nothing (nor fails writing), and says only that it stopped."""
    with waiting_worker(pg_url, behind, tmp_path) as worker:
        worker.signal(signum)
        assert worker.wait(10) == 0, worker.log_tail()
    lines = log_lines(worker)
    assert any("Stopped while waiting for the schema" in line for line in lines), lines
    assert not [line for line in lines if "[ERROR]" in line or "[CRITICAL]" in line], lines
    assert "Traceback" not in "\n".join(lines), "\n".join(lines)


def test_a_worker_the_schema_no_longer_admits_stops_with_one_line(pg_url, empty_schema, tmp_path):
    future = migrate_ahead(pg_url, empty_schema, tmp_path, "breaking")
    level = int(future[:4])

    worker = WorkerProcess(pg_url, empty_schema, tmp_path / "worker.log")
    try:
        code = worker.wait(60)
    finally:
        worker.kill_group()
    lines = log_lines(worker)
    assert code == handshake.EXIT_CODE_TOO_OLD, "\n".join(lines)
    ours = [line for line in lines if "dramatiq_pg_broker" in line]
    assert len(ours) == 1, ours
    assert "[CRITICAL]" in ours[0]
    assert f"its migration {future} is breaking" in ours[0]
    assert f"ships migration {level:04d}" in ours[0]
    assert "Traceback" not in "\n".join(lines)


def test_gunicorn_boots_against_a_schema_behind_its_code_and_serves_once_migrated(
    pg_url, behind, tmp_path
):
    port = free_port()
    log = tmp_path / "gunicorn.log"
    process = start_gunicorn(pg_url, behind, port, log, ADMIN_API_WORKERS="1")

    def health() -> tuple[int, dict] | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            status, _, body = raw_request(port, HEALTH_REQUEST)
            return status, json.loads(body)
        return None

    try:
        refused = wait_for(health, 60, "gunicorn to answer", on_timeout=log.read_text)
        assert refused[0] == 503, refused
        assert refused[1]["schema"] == "migrations_pending"
        assert "run `dramatiq-pg-broker migrate`" in refused[1]["detail"]
        for _ in range(3):
            assert health()[0] == 503
        assert process.poll() is None, "gunicorn stopped"

        migrate(pg_url, behind)
        ok = health()
        assert ok[0] == 200 and ok[1]["schema"] == "ok", ok
    finally:
        stop(process)
    text = log.read_text()
    assert text.count("The admin API cannot use the database") == 1, text
    assert "Worker failed to boot" not in text and "Traceback" not in text, text
