"""Migrations against a real PostgreSQL: apply, re-apply, race, refuse edited files."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker.errors import MigrationChecksumError, MigrationError
from dramatiq_pg_broker.migrate import discover, migrate, migrations_dir, status

REPO = Path(__file__).resolve().parents[2]


def tables_in(url: str, schema: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,)
        ).fetchall()
    return {r[0] for r in rows}


def recorded_versions(url: str, schema: str) -> list[int]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            sql.SQL("SELECT version FROM {}.schema_migrations ORDER BY version").format(
                sql.Identifier(schema)
            )
        ).fetchall()
    return [r[0] for r in rows]


def test_migrations_create_the_schema_in_an_empty_database(pg_url, empty_schema):
    applied = migrate(pg_url, empty_schema)

    files = discover()
    assert [m.version for m in applied] == [m.version for m in files]
    assert {"jobs", "job_events", "schema_migrations"} <= tables_in(pg_url, empty_schema)
    assert recorded_versions(pg_url, empty_schema) == [m.version for m in files]
    assert all(s.state == "applied" for s in status(pg_url, empty_schema))


def test_a_second_run_is_a_no_op(pg_url, empty_schema):
    migrate(pg_url, empty_schema)
    with psycopg.connect(pg_url) as conn:
        before = conn.execute(
            sql.SQL("SELECT version, applied_at FROM {}.schema_migrations ORDER BY 1").format(
                sql.Identifier(empty_schema)
            )
        ).fetchall()

    assert migrate(pg_url, empty_schema) == []

    with psycopg.connect(pg_url) as conn:
        after = conn.execute(
            sql.SQL("SELECT version, applied_at FROM {}.schema_migrations ORDER BY 1").format(
                sql.Identifier(empty_schema)
            )
        ).fetchall()
    assert after == before


def test_status_lists_pending_migrations_before_migrating(pg_url, empty_schema):
    states = status(pg_url, empty_schema)
    assert states and all(s.state == "pending" for s in states)


def _copy_migrations(tmp_path: Path) -> Path:
    target = tmp_path / "migrations"
    shutil.copytree(migrations_dir(), target)
    return target


def test_two_concurrent_migrators_apply_each_file_once(pg_url, empty_schema, tmp_path):
    directory = _copy_migrations(tmp_path)
    # A slow migration widens the window in which both migrators are inside migrate(); a
    # table with a primary key makes a second application fail loudly.
    (directory / "9000_slow_probe.sql").write_text(
        "-- compatibility: compatible\n-- A probe table nothing else reads.\n"
        "SELECT pg_sleep(0.5);\n"
        "CREATE TABLE probe (id integer PRIMARY KEY);\n"
        "INSERT INTO probe VALUES (1);\n"
    )
    barrier = threading.Barrier(2)
    results: list[list] = []
    errors: list[BaseException] = []

    def run() -> None:
        barrier.wait()
        try:
            results.append(migrate(pg_url, empty_schema, directory=directory))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)

    assert not errors, f"a concurrent migrator failed: {errors!r}"
    applied = sorted(m.version for batch in results for m in batch)
    expected = sorted(m.version for m in discover(directory))
    assert applied == expected, f"each file must be applied exactly once, got {applied}"
    assert sorted(len(batch) for batch in results)[0] == 0, "the second migrator found work"
    with psycopg.connect(pg_url) as conn:
        count = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.probe").format(sql.Identifier(empty_schema))
        ).fetchone()[0]
    assert count == 1


def test_an_edited_released_migration_is_refused_by_name(pg_url, empty_schema, tmp_path):
    directory = _copy_migrations(tmp_path)
    migrate(pg_url, empty_schema, directory=directory)
    first = sorted(directory.glob("0001_*.sql"))[0]
    first.write_text(first.read_text() + "\n-- an innocent-looking edit\n")

    with pytest.raises(MigrationChecksumError) as excinfo:
        migrate(pg_url, empty_schema, directory=directory)

    assert first.name in str(excinfo.value)
    states = {s.version: s.state for s in status(pg_url, empty_schema, directory=directory)}
    assert states[1] == "changed"


def test_a_failing_migration_is_rolled_back_and_named(pg_url, empty_schema, tmp_path):
    directory = _copy_migrations(tmp_path)
    (directory / "9001_broken.sql").write_text(
        "-- compatibility: compatible\n-- A table nothing else reads.\n"
        "CREATE TABLE half_done (id integer);\nSELECT no_such_function();\n"
    )

    with pytest.raises(MigrationError, match="9001_broken.sql"):
        migrate(pg_url, empty_schema, directory=directory)

    assert "half_done" not in tables_in(pg_url, empty_schema)
    assert 9001 not in recorded_versions(pg_url, empty_schema)


def test_misnamed_migration_files_are_refused(tmp_path):
    (tmp_path / "1_bad name.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match="misnamed"):
        discover(tmp_path)


def run_module(url: str, schema: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m dramatiq_pg_broker *args`` in a process of its own, run from the
    repository's root and configured by its environment alone."""
    env = {"DRAMATIQ_PG_URL": url, "DRAMATIQ_PG_SCHEMA": schema, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_broker", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_cli_migrates_an_empty_database_twice(pg_url, empty_schema):
    first = run_module(pg_url, empty_schema, "migrate")
    second = run_module(pg_url, empty_schema, "migrate")
    report = run_module(pg_url, empty_schema, "status")

    assert first.returncode == 0, first.stderr
    assert "applying 0001_jobs ... done in" in first.stdout
    assert first.stderr == "", "migrate printed log lines besides its one line per migration"
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout
    assert report.returncode == 0, report.stderr
    assert "0 pending" in report.stdout


def test_the_cli_reports_an_unreachable_database_in_a_sentence(empty_schema):
    unreachable = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2"
    result = run_module(unreachable, empty_schema, "migrate")
    assert result.returncode == 2
    assert "error: cannot connect to the database" in result.stderr
    assert "Traceback" not in result.stderr
