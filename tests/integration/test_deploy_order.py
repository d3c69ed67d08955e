"""Deploys that do not hurt, against a real PostgreSQL: a send made while ``migrate`` runs
waits for it (bounded by ``migration_wait_seconds``) instead of failing, and a breaking
migration refuses to start while processes that cannot check the schema show live work,
unless forced; on an empty database ``migrate`` prints one quiet line per migration."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker, send_async
from dramatiq_pg_broker.cli import main
from dramatiq_pg_broker.db.handshake import this_code
from dramatiq_pg_broker.errors import LiveWorkFound, MigrationsPending
from dramatiq_pg_broker.migrate import discover, lock_key, migrate, migrate_locked

from ..helpers import wait_for


def declare(broker: PostgresBroker) -> dramatiq.Actor:
    return dramatiq.actor(lambda: None, actor_name="noop", queue_name="deploy", broker=broker)


def waiting_for_the_lock(conn: psycopg.Connection, schema: str) -> bool:
    """Whether another session waits for the schema's migration lock (a waiting sender)."""
    namespace, key = lock_key(schema)
    return conn.execute(
        "SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 2)",
        (namespace, key & 0xFFFFFFFF),
    ).fetchone()[0]


class Migrator:
    """A ``migrate`` played by the test: a connection of its own that holds the schema's
    migration lock, and applies the pending migrations while it holds it."""

    def __init__(self, url: str, schema: str) -> None:
        self.schema = schema
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute("SELECT pg_advisory_lock(%s, %s)", lock_key(schema))

    def apply(self) -> None:
        migrate_locked(self.conn, self.schema, discover())

    def release(self) -> None:
        self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", lock_key(self.schema))

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def noop_broker(pg_url, behind):
    """``noop_broker(**options)``: a broker on the ``behind`` schema that waits up to 60 s for a
    running migration unless told otherwise, and a do-nothing actor of it; the broker is
    closed afterwards."""
    brokers: list[PostgresBroker] = []

    def make(**options) -> tuple[PostgresBroker, dramatiq.Actor]:
        options.setdefault("migration_wait_seconds", 60)
        broker = PostgresBroker(url=pg_url, schema=behind, **options)
        brokers.append(broker)
        return broker, declare(broker)

    yield make
    for broker in brokers:
        broker.close()


@pytest.fixture
def migrator(pg_url, behind):
    """A :class:`Migrator` holding the ``behind`` schema's migration lock until the test
    ends (or it releases the lock)."""
    migrator = Migrator(pg_url, behind)
    yield migrator
    migrator.close()


def send_sync(broker, noop) -> str:
    return noop.send().message_id


def send_from_asyncio(broker, noop) -> str:
    return asyncio.run(send_async(noop)).message_id


def send_in_async_transaction(broker, noop) -> str:
    async def run() -> str:
        async with await psycopg.AsyncConnection.connect(broker.pool.url) as conn:
            async with broker.transaction(conn):
                message = noop.send()
        return message.message_id

    return asyncio.run(run())


@pytest.mark.parametrize(
    "send", [send_sync, send_from_asyncio, send_in_async_transaction], ids=lambda f: f.__name__
)
def test_a_send_made_while_migrate_runs_waits_for_it_then_sends(
    noop_broker, migrator, behind, conn, send
):
    broker, noop = noop_broker()
    outcome: dict = {}

    def sender() -> None:
        try:
            outcome["id"] = send(broker, noop)
        except BaseException as e:  # reported by the assertions below
            outcome["error"] = e
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=sender, daemon=True)
    try:
        thread.start()
        wait_for(
            lambda: waiting_for_the_lock(conn, behind) or "error" in outcome,
            20,
            "the send to wait for the migration lock",
        )
        assert "error" not in outcome, f"the send failed instead of waiting: {outcome}"
        migrator.apply()
        assert thread.is_alive() and not outcome, "the send went on while migrate held its lock"
        released = time.monotonic()
        migrator.release()
        thread.join(30)
        assert not thread.is_alive(), "the send did not finish after the migration"
        assert "error" not in outcome, f"the send failed after the migration: {outcome}"
        assert outcome["at"] >= released
        (count,) = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.jobs WHERE id = %s").format(sql.Identifier(behind)),
            (outcome["id"],),
        ).fetchone()
        assert count == 1, "the send that waited wrote no job"
    finally:
        migrator.close()  # a send still waiting goes on: it ends before the broker closes
        thread.join(30)


def test_many_sending_threads_wait_on_one_connection(noop_broker, migrator, pg_url, behind, conn):
    """Eight threads send in their own transactions while migrate runs (each checks the
    schema through the broker's pool of two connections, which a caller waits for at most
    1 s): one thread waits for the lock on one connection, the others wait for it without
    asking the pool, and all of them send once the migration is in, though it held the lock
    longer than the pool's timeout."""
    broker, noop = noop_broker(pool_max_size=2, pool_timeout=1, enqueue_retries=0)
    results: list = []
    barrier = threading.Barrier(8)

    def sender() -> None:
        barrier.wait()
        try:
            with psycopg.connect(pg_url) as app, broker.transaction(app):
                results.append(noop.send().message_id)
        except BaseException as e:  # reported by the assertions below
            results.append(e)

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    wait_for(lambda: waiting_for_the_lock(conn, behind), 20, "a send to wait for the lock")
    # Held past the pool's timeout on purpose: a thread that waited for a pooled
    # connection instead would fail with a connection error (no retries here).
    time.sleep(1.5)
    assert not results, f"sends ended while migrate held its lock: {results}"
    (waiting,) = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND objid = %s::bigint::oid",
        (lock_key(behind)[1] & 0xFFFFFFFF,),
    ).fetchone()
    assert waiting == 1, f"{waiting} connections wait for the migration lock, not one"
    migrator.apply()
    migrator.release()
    for thread in threads:
        thread.join(30)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert len(results) == 8


def test_a_send_past_migration_wait_seconds_raises_saying_it_waited(noop_broker, migrator):
    _, noop = noop_broker(migration_wait_seconds=0.5)
    started = time.monotonic()
    with pytest.raises(MigrationsPending) as info:
        noop.send()
    took = time.monotonic() - started
    assert 0.5 <= took < 10, f"the send gave up after {took:.2f}s, not after 0.5s"
    line = str(info.value)
    assert "waited 0.5 s" in line and "migration_wait_seconds" in line, line
    assert "run `dramatiq-pg-broker migrate`" in line, line


def test_without_a_running_migration_a_send_refuses_at_once(noop_broker):
    _, noop = noop_broker()
    started = time.monotonic()
    with pytest.raises(MigrationsPending) as info:
        noop.send()
    assert time.monotonic() - started < 5
    assert "waited" not in str(info.value)


# -- a breaking migration and live work ------------------------------------------------------


@pytest.fixture
def before_0012(pg_url, empty_schema):
    """A schema at 0011: the breaking 0012 pending."""
    migrate(pg_url, empty_schema, target=11)
    return empty_schema


def add_running_job(conn, schema: str, owner: str) -> None:
    """A job running under ``owner``'s live lease, sent an hour ago (so that only the lease
    is live work)."""
    conn.execute(
        sql.SQL(
            """
            INSERT INTO {q}.jobs (id, queue_name, actor_name, message, status, attempts,
                                  max_attempts, locked_by, locked_until, started_at, started,
                                  created_at, updated_at)
            VALUES (gen_random_uuid(), 'q', 'a', '{{}}', 'running', 1, 3, %s,
                    now() + interval '1 minute', now() - interval '5 seconds', true,
                    now() - interval '1 hour', now())
            """
        ).format(q=sql.Identifier(schema)),
        (owner,),
    )


def cli(url: str, schema: str, *args: str) -> list[str]:
    return ["--url", url, "--schema", schema, *args]


def applied(conn, schema: str) -> int:
    return conn.execute(
        sql.SQL("SELECT max(version) FROM {}.schema_migrations").format(sql.Identifier(schema))
    ).fetchone()[0]


def test_migrate_refuses_a_breaking_migration_under_live_leases_of_an_unregistered_process(
    pg_url, before_0012, conn, capsys
):
    add_running_job(conn, before_0012, "old-host:4242:MainThread:abcd")

    with pytest.raises(LiveWorkFound) as info:
        migrate(pg_url, before_0012)
    line = str(info.value)
    assert "0012_partitioned_history.sql is breaking" in line, line
    assert "1 live lease(s)" in line and "old-host:4242" in line, line
    assert "not in the worker registry" in line and "--force" in line, line
    assert applied(conn, before_0012) == 11, "migrate applied something while refusing"

    assert main(cli(pg_url, before_0012, "migrate")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: migration 0012_partitioned_history.sql is breaking"), err
    assert applied(conn, before_0012) == 11

    assert main(cli(pg_url, before_0012, "migrate", "--force")) == 0
    out = capsys.readouterr().out
    assert re.search(r"^applying 0012_partitioned_history \.\.\. done in \d+\.\d s$", out, re.M)
    assert applied(conn, before_0012) == discover()[-1].version


def test_migrate_check_says_that_migrate_would_refuse(pg_url, before_0012, conn, capsys):
    add_running_job(conn, before_0012, "old-host:4242:MainThread:abcd")
    assert main(cli(pg_url, before_0012, "migrate", "--check")) == 1
    out = capsys.readouterr().out
    assert "`migrate` would refuse 0012_partitioned_history.sql now" in out, out
    assert "1 live lease(s)" in out, out


def test_migrate_refuses_while_an_earlier_release_sends(pg_url, before_0012, conn):
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.jobs (id, queue_name, actor_name, message, max_attempts) "
            "VALUES (gen_random_uuid(), 'q', 'a', '{{}}', 3)"
        ).format(sql.Identifier(before_0012))
    )
    with pytest.raises(LiveWorkFound, match=r"1 send\(s\) in the last 30 s"):
        migrate(pg_url, before_0012)


def test_leases_of_code_that_ships_the_breaking_migration_are_not_live_work(
    pg_url, before_0012, conn
):
    """A lease whose owner ends with a schema level at or above the pending breaking
    migration comes from code that ships it (from 0022 on, every claim's owner does):
    here this code's own level, at or above every breaking migration it ships (0028)."""
    level = this_code().level
    add_running_job(conn, before_0012, f"new-host:77:MainThread:ef012345:L{level:04d}")
    assert [m.version for m in migrate(pg_url, before_0012)][0] == 12


def test_two_builds_of_one_version_are_told_apart_by_schema_level(
    pg_url, empty_schema, conn, tmp_path
):
    """Live work is judged by schema level, not package version: before a breaking
    migration 0023, a registered worker of this very version whose code stops at 0022
    (another build) holds live leases; one whose code ships 0023 does not count."""
    from dramatiq_pg_broker import __version__

    from ..helpers import migrations_ahead

    migrate(pg_url, empty_schema)
    folder, name = migrations_ahead(tmp_path, "breaking", "CREATE TABLE future_probe (id int);\n")
    level = int(name[:4])
    for host, worker_level in (("older-build", level - 1), ("newer-build", level)):
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.workers (id, host, pid, version, schema_level, expires_at) "
                "VALUES (%s, %s, 77, %s, %s, now() + interval '1 minute')"
            ).format(sql.Identifier(empty_schema)),
            (f"{host}:77:ab", host, __version__, worker_level),
        )
        add_running_job(conn, empty_schema, f"{host}:77:MainThread:ef012345:L{level - 1:04d}")
    with pytest.raises(LiveWorkFound) as info:
        migrate(pg_url, empty_schema, directory=folder)
    line = str(info.value)
    assert "1 live lease(s) held by 1 registered worker(s) of a lower schema level" in line, line
    assert "(older-build:77)" in line and "newer-build" not in line, line
    assert f"(code below schema level {level:04d})" in line, line
    conn.execute(
        sql.SQL("DELETE FROM {}.jobs WHERE locked_by LIKE 'older-build:%%'").format(
            sql.Identifier(empty_schema)
        )
    )
    assert [m.version for m in migrate(pg_url, empty_schema, directory=folder)] == [level]


def test_migrate_on_an_empty_database_prints_one_quiet_line_per_migration(
    pg_url, empty_schema, capsys, caplog
):
    caplog.set_level(logging.INFO)
    assert main(cli(pg_url, empty_schema, "migrate")) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    names = [f"{m.version:04d}_{m.name}" for m in discover()]
    assert len(lines) == len(names), captured.out
    for line, name in zip(lines, names):
        assert re.fullmatch(rf"applying {name} \.\.\. done in \d+\.\d s", line), line
    assert "breaking" not in captured.out and "stop" not in captured.out
    assert captured.err == ""
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("dramatiq_pg_broker")]
    assert logged == [], logged


def test_the_django_command_passes_force(monkeypatch):
    pytest.importorskip("django")
    from dramatiq_pg_broker.contrib.django.management.commands import dramatiq_pg_migrate

    calls = []
    monkeypatch.setattr(dramatiq_pg_migrate, "run_cli", calls.append)
    command = dramatiq_pg_migrate.Command()
    parser = command.create_parser("manage.py", "dramatiq_pg_migrate")
    options = vars(parser.parse_args(["--force"]))
    command.handle(**options)
    assert calls == [["migrate", "--force"]]
