"""The schema handshake against a real PostgreSQL: senders, workers, the CLI and the admin
API refuse a schema their code does not fit, in one line, and go on once it fits."""

from __future__ import annotations

import logging
import threading
import time

import dramatiq
import psycopg
import pytest
from falcon import testing
from psycopg import sql

import dramatiq_pg_broker
from admin_api import create_app
from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.cli import main
from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import handshake
from dramatiq_pg_broker.errors import CodeTooOld, MigrationsPending
from dramatiq_pg_broker.migrate import discover, migrate

from ..helpers import RELEASED, migrate_ahead


def declare(broker: PostgresBroker) -> dramatiq.Actor:
    return dramatiq.actor(lambda: None, actor_name="noop", queue_name="handshake", broker=broker)


def count_reads(monkeypatch) -> list[str]:
    calls: list[str] = []
    read_state = handshake.read_state

    def counted(conn, schema):
        calls.append(schema)
        return read_state(conn, schema)

    monkeypatch.setattr(handshake, "read_state", counted)
    return calls


def test_a_sender_is_refused_in_one_line_until_the_schema_is_migrated(pg_url, behind):
    broker = PostgresBroker(url=pg_url, schema=behind)
    noop = declare(broker)
    try:
        with pytest.raises(MigrationsPending) as info:
            noop.send()
        line = str(info.value)
        assert "\n" not in line
        assert f"schema {behind!r} is at migration 0009" in line
        assert "run `dramatiq-pg-broker migrate`" in line
        assert info.value.__cause__ is None, "the refusal should not be a wrapped SQL error"

        migrate(pg_url, behind)
        # A refusal is not remembered: the same process sends once the schema fits.
        assert noop.send().message_id
    finally:
        broker.close()


def test_the_handshake_is_one_read_per_process_not_per_message(pg_url, schema, monkeypatch):
    reads = count_reads(monkeypatch)
    broker = PostgresBroker(url=pg_url, schema=schema)
    noop = declare(broker)
    try:
        for _ in range(20):
            noop.send()
        with psycopg.connect(pg_url) as app, broker.transaction(app):
            noop.send()
        assert reads == [schema], f"the schema was read {len(reads)} times for 21 sends"
    finally:
        broker.close()


def test_code_the_schema_no_longer_admits_is_refused_with_what_to_upgrade(
    pg_url, empty_schema, tmp_path
):
    future = migrate_ahead(pg_url, empty_schema, tmp_path, "breaking")
    broker = PostgresBroker(url=pg_url, schema=empty_schema)
    try:
        with pytest.raises(CodeTooOld) as info:
            declare(broker).send()
        line = str(info.value)
        level = int(future[:4])
        assert "\n" not in line
        assert f"admits code of schema level {level:04d} or later" in line
        assert f"its migration {future} is breaking" in line
        assert f"dramatiq-pg-broker {dramatiq_pg_broker.__version__} applied it" in line
        assert f"this is {handshake.this_code().describe()}" in line
        assert f"to a release that ships migration {level:04d}" in line
    finally:
        broker.close()


def test_a_newer_compatible_schema_admits_the_code_and_says_so_once(
    pg_url, empty_schema, tmp_path, caplog
):
    future = migrate_ahead(pg_url, empty_schema, tmp_path, "compatible")
    caplog.set_level(logging.INFO, logger="dramatiq_pg_broker.handshake")
    broker = PostgresBroker(url=pg_url, schema=empty_schema)
    noop = declare(broker)
    try:
        noop.send()
        noop.send()
    finally:
        broker.close()
    notes = [r.getMessage() for r in caplog.records if "does not ship" in r.getMessage()]
    assert len(notes) == 1, notes
    assert future in notes[0] and "none is breaking for it, so it runs" in notes[0]


def test_migrate_records_each_headers_kind_and_the_applying_version(pg_url, empty_schema, tmp_path):
    future = migrate_ahead(pg_url, empty_schema, tmp_path, "breaking")
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT version, compatibility, reason, code_version FROM {}.schema_migrations "
                "ORDER BY version"
            ).format(sql.Identifier(empty_schema))
        ).fetchall()
        state = handshake.read_state(conn, empty_schema)
    released = [r for r in rows if r[0] <= RELEASED]
    assert all(r[1:] == (None, None, None) for r in released), released
    recorded = {r[0]: r[1:] for r in rows if r[0] > RELEASED}
    assert recorded[10][0] == "compatible" and recorded[10][1].startswith("Only adds")
    assert recorded[int(future[:4])] == (
        "breaking",
        "A later release's change, made up by the test.",
        dramatiq_pg_broker.__version__,
    )
    assert state.min_code_level == int(future[:4])


# -- the worker: waits at boot, or stops ----------------------------------------------------


def test_a_worker_waits_for_the_migration_then_proceeds(pg_url, behind, monkeypatch, caplog):
    monkeypatch.setattr(handshake, "WAIT_SECONDS", 0.2)
    reads = count_reads(monkeypatch)
    caplog.set_level(logging.INFO, logger="dramatiq_pg_broker")
    broker = PostgresBroker(url=pg_url, schema=behind, poll_interval=0.1)
    ran = threading.Event()
    dramatiq.actor(ran.set, actor_name="mark", queue_name="handshake", broker=broker)
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    booted = threading.Event()

    def boot():
        worker.start()
        booted.set()

    thread = threading.Thread(target=boot, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while len(reads) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(reads) >= 4, f"the waiting worker checked {len(reads)} times in 20 s"
        assert not booted.is_set(), "the worker booted against a schema behind its code"
        waits = [r for r in caplog.records if "waits for a migration" in r.getMessage()]
        assert len(waits) == 1, [r.getMessage() for r in caplog.records]
        assert "run `dramatiq-pg-broker migrate`" in waits[0].getMessage()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

        migrate(pg_url, behind)
        assert booted.wait(20), "the worker did not proceed after the migration"
        # The boot may return before the gate opens (its wait is bounded); the gate opens
        # at the next check after the migration's commit.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
            "this worker proceeds" in r.getMessage() for r in caplog.records
        ):
            time.sleep(0.05)
        assert any("this worker proceeds" in r.getMessage() for r in caplog.records)
        broker.actors["mark"].send()
        assert ran.wait(20), "the worker did not run a job after proceeding"
    finally:
        if booted.is_set():
            worker.stop()
        broker.close()


def test_a_worker_the_schema_no_longer_admits_stops_in_one_line(
    pg_url, empty_schema, tmp_path, caplog
):
    future = migrate_ahead(pg_url, empty_schema, tmp_path, "breaking")
    broker = PostgresBroker(url=pg_url, schema=empty_schema)
    worker = dramatiq.Worker(broker, worker_threads=1)
    try:
        with pytest.raises(SystemExit) as info:
            worker.start()
        assert info.value.code == handshake.EXIT_CODE_TOO_OLD
    finally:
        broker.close()
    lines = [r for r in caplog.records if r.name.startswith("dramatiq_pg_broker")]
    assert len(lines) == 1 and lines[0].levelno == logging.CRITICAL, lines
    assert future in lines[0].getMessage() and not lines[0].exc_info


# -- the CLI --------------------------------------------------------------------------------


def cli(pg_url: str, schema: str, *args: str) -> list[str]:
    return ["--url", pg_url, "--schema", schema, *args]


def test_migrate_check_exits_1_listing_pending_migrations_then_0(pg_url, behind, capsys):
    assert main(cli(pg_url, behind, "migrate", "--check")) == 1
    out = capsys.readouterr().out
    pending = [m for m in discover() if m.version > RELEASED]
    assert f"{len(pending)} migration(s) pending" in out, out
    assert "0010_schema_handshake.sql (compatible:" in out

    assert main(cli(pg_url, behind, "migrate")) == 0
    capsys.readouterr()
    assert main(cli(pg_url, behind, "migrate", "--check")) == 0
    assert "is up to date" in capsys.readouterr().out


def test_operator_commands_refuse_a_schema_behind_the_code_in_one_line(pg_url, behind, capsys):
    assert main(cli(pg_url, behind, "jobs", "list")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert (
        captured.err.startswith("error: schema ") and "dramatiq-pg-broker migrate" in captured.err
    )


@pytest.mark.parametrize(
    ("kind", "says", "code"),
    [
        pytest.param(
            "compatible",
            [
                "{future:<35} unknown",
                "1 unknown to this code",
                "the database is newer than this code",
            ],
            0,
            id="newer-compatible",
        ),
        pytest.param(
            "breaking",
            [
                "minimum code level: {level} (set by the breaking migration {future})",
                "this code may not use the schema",
            ],
            2,
            id="no-longer-admitted",
        ),
    ],
)
def test_status_check_and_commands_on_a_database_newer_than_the_code(
    pg_url, empty_schema, tmp_path, capsys, kind, says, code
):
    """``status`` says what the newer schema means for this code; ``migrate --check`` and
    the operator commands go on (exit 0) while the schema admits the code, and exit 2
    saying what to upgrade once it does not."""
    future = migrate_ahead(pg_url, empty_schema, tmp_path, kind)
    assert main(cli(pg_url, empty_schema, "status")) == 0
    out = capsys.readouterr().out
    for line in says:
        assert line.format(future=future, level=future[:4]) in out, out
    assert main(cli(pg_url, empty_schema, "migrate", "--check")) == code
    if code:
        assert "upgrade dramatiq-pg-broker" in capsys.readouterr().err
    assert main(cli(pg_url, empty_schema, "jobs", "list")) == code


# -- the admin API --------------------------------------------------------------------------


def test_the_admin_api_answers_503_with_the_line_until_migrated(pg_url, behind, caplog):
    app = create_app(Settings(url=pg_url, schema=behind))
    client = testing.TestClient(app)
    caplog.set_level(logging.INFO, logger="admin_api")

    for _ in range(3):
        refused = client.simulate_get("/api/jobs", headers={"Authorization": "Bearer nope"})
        assert refused.status_code == 503, refused.text
        assert refused.json["error"] == "unavailable"
        assert "run `dramatiq-pg-broker migrate`" in refused.json["message"]
    health = client.simulate_get("/api/health")
    assert health.status_code == 503
    assert health.json["schema"] == "migrations_pending"
    assert "is at migration 0009" in health.json["detail"]
    assert client.simulate_get("/api/docs").status_code == 200, "the docs need no database"
    logged = [r for r in caplog.records if "cannot use the database" in r.getMessage()]
    assert len(logged) == 1, "the refusal should be logged once, not per request"

    migrate(pg_url, behind)
    assert client.simulate_get("/api/health").status_code == 200
    assert client.simulate_get("/api/jobs").status_code == 401
