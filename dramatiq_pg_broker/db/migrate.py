"""Schema migrations: numbered SQL files applied in order, recorded with their checksums.

Files live in the top-level ``migrations/`` folder, shipped inside the package as
``dramatiq_pg_broker/migrations`` (``DRAMATIQ_PG_MIGRATIONS_DIR`` overrides it), and are
named ``NNNN_description.sql``. Each file runs with ``search_path`` set to the broker's
schema and is recorded in ``<schema>.schema_migrations`` with the SHA-256 of its bytes, in
the same transaction: its own, or, from the first pending breaking migration on, one for
all of the run (:func:`units`). Every statement waits at most 50 ms for a lock, and a
transaction that timed out is tried again until it gets them (:func:`migrate_locked`);
a migration whose header says ``-- transaction: none`` (one concurrent index build or
drop) runs alone, outside a transaction (:func:`parse_transaction`).

- Running :func:`migrate` twice is a no-op.
- Two migrators started at once are serialised by an advisory lock held only while
  migrating (on its own connection, never in the job path), so each file is applied once.
- A released file whose checksum changed is refused, naming the file: a change to the
  schema is a new file, never an edit.
- A run that would apply a *breaking* migration first looks for live work of processes
  whose code does not ship it (:func:`live_work`: live leases, sends and claims of the
  last :data:`LIVE_WORK_SECONDS`, except those of code of that schema level or a later
  one, by the level a claim's owner carries or a registered worker recorded) and refuses
  with :class:`~.errors.LiveWorkFound`, saying what it saw, unless forced; it looks again
  in the transaction that applies it, once that transaction holds its tables (it may have
  waited minutes for them). A fresh database has none.

The compatibility contract: every file from :data:`CONTRACT_FROM` (0010) on starts with a
header, a first line ``-- compatibility: compatible`` or ``-- compatibility: breaking`` and
a second comment line saying why::

    -- compatibility: compatible
    -- Adds a table that the previous release never reads.

*Compatible*: every release the schema still admits (each one since the last breaking
migration) keeps working beside the new one, and nothing it does breaks an invariant the
migration adds. *Breaking*: the processes of earlier releases must stop; applying it raises
the schema's minimum code level to its own version, and code that does not ship it refuses
the schema at start (see :mod:`.handshake`). A file from 0010 on without the header is
refused by :func:`discover`, so neither ``migrate`` nor a worker runs with it; 0001-0009,
released (in 0.1.0) before the contract, carry none and are recorded without one.
``schema_migrations`` records each header (``compatibility``, ``reason``) and the package
version that applied the file (``code_version``), from migration 0010 on, which adds those
columns.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from psycopg import sql

from ..errors import LiveWorkFound, MigrationChecksumError, MigrationError
from .locks import BRIEF_HOLDER_MS, LOCK_TIMEOUT_MS
from .queries import Queries

logger = logging.getLogger("dramatiq_pg_broker.migrate")

_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_HEADER_RE = re.compile(r"^-- compatibility: *(\S*)\s*$")
_TRANSACTION_RE = re.compile(r"^-- transaction: *(\S*)\s*$")
#: The statements a migration outside a transaction may hold (one of them): those that
#: PostgreSQL refuses in a transaction and whose locks no send or claim waits for (SHARE
#: UPDATE EXCLUSIVE on the table). The index's name is the last group.
_ALONE_RE = re.compile(
    r"^\s*(CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+(?:IF\s+NOT\s+EXISTS\s+)?"
    r"|DROP\s+INDEX\s+CONCURRENTLY\s+(?:IF\s+EXISTS\s+)?)"
    r"(\w+)\b[^;]*;?\s*$",
    re.IGNORECASE | re.DOTALL,
)

#: The first migration under the compatibility contract (see the module docstring).
CONTRACT_FROM = 10
#: The header's two kinds.
COMPATIBLE = "compatible"
BREAKING = "breaking"

#: Seconds back in which a send or a claim counts as live work before a breaking migration.
LIVE_WORK_SECONDS = 30.0

# Namespace of the advisory lock that serialises migrators: the first half of the key is
# fixed, the second is the schema's hash, so two schemas migrate independently.
_LOCK_NAMESPACE = 0x64717067  # "dqpg"


@dataclasses.dataclass(frozen=True)
class Migration:
    """One migration file."""

    version: int
    name: str
    path: Path
    checksum: str
    #: ``compatible`` or ``breaking``; None for the files released before the contract.
    compatibility: str | None = None
    #: Why, as the header's second line says.
    reason: str | None = None
    #: False for a migration whose header says ``-- transaction: none`` (see
    #: :func:`parse_transaction`).
    transactional: bool = True

    @property
    def filename(self) -> str:
        return self.path.name

    @property
    def breaking(self) -> bool:
        return self.compatibility == BREAKING

    def read(self) -> str:
        return self.path.read_text("utf-8")


@dataclasses.dataclass(frozen=True)
class MigrationState:
    """A migration as the database sees it: applied (with when) or pending."""

    version: int
    name: str
    applied_at: dt.datetime | None
    checksum_ok: bool = True
    #: False for a migration the database has and this code does not ship: the database
    #: is newer than the code.
    known: bool = True

    @property
    def state(self) -> str:
        if not self.known:
            return "unknown"
        if self.applied_at is None:
            return "pending"
        return "applied" if self.checksum_ok else "changed"


def migrations_dir() -> Path:
    """The folder of migration files: ``DRAMATIQ_PG_MIGRATIONS_DIR`` if set, else the
    package's ``migrations`` folder (in a checkout, a link to the top-level
    ``migrations/``; in an installed wheel, a copy of it)."""
    configured = os.environ.get("DRAMATIQ_PG_MIGRATIONS_DIR")
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parent.parent / "migrations"


def parse_header(filename: str, text: str) -> tuple[str | None, str | None]:
    """The compatibility header of a migration file: ``(compatibility, reason)``, or
    ``(None, None)`` when the file has none.

    Raises:
      MigrationError: the first line starts a header that is not one of the two kinds, or
        the line after it is not a comment saying why.
    """
    lines = text.splitlines()
    match = _HEADER_RE.match(lines[0]) if lines else None
    if match is None:
        return None, None
    kind = match.group(1)
    if kind not in (COMPATIBLE, BREAKING):
        raise MigrationError(
            f"migration {filename} says `compatibility: {kind}`: the header's kind is "
            f"{COMPATIBLE!r} or {BREAKING!r}"
        )
    reason = lines[1][2:].strip() if len(lines) > 1 and lines[1].startswith("--") else ""
    if not reason:
        raise MigrationError(
            f"migration {filename} has no reason under its compatibility header: its second "
            "line must be a comment saying why it is " + kind
        )
    return kind, reason


def parse_transaction(filename: str, text: str) -> bool:
    """Whether a migration runs in a transaction: yes, unless the line after its header's
    reason says ``-- transaction: none``. Such a migration holds one statement that
    PostgreSQL refuses in a transaction block, of the kinds whose locks no send or claim
    waits for: ``CREATE [UNIQUE] INDEX CONCURRENTLY`` or ``DROP INDEX CONCURRENTLY`` (see
    :func:`migrate_locked` for how it is run).

    Raises:
      MigrationError: the line names another value, or the file holds anything else than
        one such statement.
    """
    lines = text.splitlines()
    match = _TRANSACTION_RE.match(lines[2]) if len(lines) > 2 else None
    if match is None:
        return True
    if match.group(1) != "none":
        raise MigrationError(
            f"migration {filename} says `transaction: {match.group(1)}`: the only value is "
            "`none` (leave the line out for a migration that runs in a transaction)"
        )
    if _alone_statement(text) is None:
        raise MigrationError(
            f"migration {filename} runs outside a transaction, so it must hold exactly one "
            "CREATE [UNIQUE] INDEX CONCURRENTLY or DROP INDEX CONCURRENTLY statement (their "
            "locks hold up no send or claim); put anything else in a migration of its own"
        )
    return False


def _alone_statement(text: str) -> re.Match | None:
    """The one statement of a migration outside a transaction (comments left out)."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    return _ALONE_RE.match(body)


def discover(directory: Path | None = None) -> list[Migration]:
    """List the migration files in version order.

    Raises:
      MigrationError: the folder is missing, a file name does not follow
        ``NNNN_description.sql``, two files share a version, or a file from
        :data:`CONTRACT_FROM` on lacks its compatibility header.
    """
    directory = directory or migrations_dir()
    if not directory.is_dir():
        raise MigrationError(f"migrations folder {directory} does not exist")
    found: dict[int, Migration] = {}
    for path in sorted(directory.iterdir()):
        if path.suffix != ".sql":
            continue
        match = _FILE_RE.match(path.name)
        if not match:
            raise MigrationError(
                f"migration file {path.name} is misnamed: use NNNN_description.sql"
            )
        version = int(match.group(1))
        if version in found:
            raise MigrationError(
                f"migration files {found[version].filename} and {path.name} share version {version}"
            )
        data = path.read_bytes()
        text = data.decode("utf-8")
        compatibility, reason = parse_header(path.name, text)
        if compatibility is None and version >= CONTRACT_FROM:
            raise MigrationError(
                f"migration {path.name} has no compatibility header: from "
                f"{CONTRACT_FROM:04d} on, a migration's first line is `-- compatibility: "
                f"{COMPATIBLE}` or `-- compatibility: {BREAKING}` and its second a comment "
                "saying why (see the upgrading guide)"
            )
        found[version] = Migration(
            version=version,
            name=match.group(2),
            path=path,
            checksum=hashlib.sha256(data).hexdigest(),
            compatibility=compatibility,
            reason=reason,
            transactional=compatibility is None or parse_transaction(path.name, text),
        )
    return [found[v] for v in sorted(found)]


def _lock_key(schema: str) -> int:
    digest = hashlib.sha256(schema.encode()).digest()
    return int.from_bytes(digest[:4], "big", signed=True)


def lock_key(schema: str) -> tuple[int, int]:
    """The two keys of the advisory lock a migrator of ``schema`` holds while it migrates
    (``pg_advisory_lock(namespace, key)``): how a sender tells that a migration runs (see
    :func:`.handshake.wait_for_migration`)."""
    return _LOCK_NAMESPACE, _lock_key(schema)


def _ensure_table(conn: psycopg.Connection, schema: str) -> None:
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    conn.execute(
        sql.SQL(
            """
            CREATE TABLE IF NOT EXISTS {}.schema_migrations (
                version     integer     PRIMARY KEY,
                name        text        NOT NULL,
                checksum    text        NOT NULL,
                applied_at  timestamptz NOT NULL DEFAULT now()
            )
            """
        ).format(sql.Identifier(schema))
    )


def _applied(conn: psycopg.Connection, schema: str) -> dict[int, tuple[str, str, dt.datetime]]:
    exists = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL",
        (sql.Identifier(schema).as_string(conn) + ".schema_migrations",),
    ).fetchone()[0]
    if not exists:
        return {}
    rows = conn.execute(
        sql.SQL("SELECT version, name, checksum, applied_at FROM {}.schema_migrations").format(
            sql.Identifier(schema)
        )
    ).fetchall()
    return {version: (name, checksum, at) for version, name, checksum, at in rows}


def _check_checksums(
    migrations: list[Migration], applied: dict[int, tuple[str, str, dt.datetime]]
) -> None:
    for migration in migrations:
        record = applied.get(migration.version)
        if record is not None and record[1] != migration.checksum:
            raise MigrationChecksumError(
                f"migration {migration.filename} was changed after it was applied "
                f"(checksum {migration.checksum[:12]}, applied {record[1][:12]}): released "
                "migrations must not be edited; restore the file and put the change in a new "
                "numbered migration"
            )


@dataclasses.dataclass(frozen=True)
class LiveWork:
    """What :func:`live_work` saw of processes whose code does not ship the breaking
    migration :attr:`level`."""

    #: Live leases (running jobs whose lease has not expired) of such processes.
    leases: int = 0
    #: Their owners (``host:pid``), and whether each is a registered worker (of a lower
    #: schema level) rather than an unregistered process.
    owners: tuple[tuple[str, bool], ...] = ()
    #: Seconds since the oldest of those leases' attempts started, and until the last of
    #: them expires.
    oldest_lease_age: float | None = None
    leases_expire_in: float | None = None
    #: Sends (jobs created) and claims (attempts started) of the last ``window`` seconds,
    #: and how long ago the latest of each was.
    sends: int = 0
    latest_send_age: float | None = None
    claims: int = 0
    latest_claim_age: float | None = None
    window: float = LIVE_WORK_SECONDS
    #: The schema level the work was held to: the breaking migration about to be applied.
    level: int | None = None

    def __bool__(self) -> bool:
        return bool(self.leases or self.sends or self.claims)

    def describe(self) -> str:
        """What was seen, in one line."""
        parts = []
        if self.leases:
            unregistered = [o for o, registered in self.owners if not registered]
            registered = [o for o, registered in self.owners if registered]
            whose = []
            if unregistered:
                whose.append(
                    f"{len(unregistered)} process(es) not in the worker registry "
                    f"({_few(unregistered)})"
                )
            if registered:
                whose.append(
                    f"{len(registered)} registered worker(s) of a lower schema level "
                    f"({_few(registered)})"
                )
            parts.append(
                f"{self.leases} live lease(s) held by {' and '.join(whose)}, the oldest "
                f"claimed {_seconds(self.oldest_lease_age, 0)} ago, the last expiring in "
                f"{_seconds(self.leases_expire_in, 0)}"
            )
        if self.sends:
            parts.append(
                f"{self.sends} send(s) in the last {self.window:g} s (the latest "
                f"{_seconds(self.latest_send_age)} ago)"
            )
        if self.claims:
            parts.append(
                f"{self.claims} claim(s) in the last {self.window:g} s by code of a lower "
                f"schema level (the latest {_seconds(self.latest_claim_age)} ago)"
            )
        line = "; ".join(parts)
        if line and self.level is not None:
            line += f" (code below schema level {self.level:04d})"
        return line


def _seconds(value: float | None, digits: int = 1) -> str:
    return "?" if value is None else f"{value:.{digits}f} s"


def _few(items: list[str]) -> str:
    return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def live_work(
    conn: psycopg.Connection,
    schema: str,
    *,
    level: int | None = None,
    window: float = LIVE_WORK_SECONDS,
) -> LiveWork:
    """The live work of processes whose code does not ship the breaking migration
    ``level`` (default: this code's schema level): live leases, and sends and claims of the
    last ``window`` seconds. Work counts by schema level, not package version (two builds
    of one version may ship different migrations): a lease or a claim is left out when its
    owner ends with a schema level of ``level`` or more (every claim from migration 0022 on
    does, see :func:`..attempt.claiming.new_owner_id`) or belongs to a live registered
    worker of such a level (whose code ships the migration, and claims nothing while it is
    pending). A process whose code ships the pending migration cannot send or claim while
    it is pending, so every send seen comes from older code. Reads the ``jobs`` table as
    every release since 0.1.0 has it; nothing when it does not exist (a fresh database).
    """
    from .handshake import this_code

    queries = Queries(schema, "migrate.sql")
    level = this_code().level if level is None else level
    if not _exists(conn, schema, "jobs"):
        return LiveWork(window=window, level=level)
    safe: list[str] = []
    registered: set[str] = set()
    if _exists(conn, schema, "workers"):
        try:
            with conn.transaction():  # a savepoint inside a migration's transaction
                rows = conn.execute(queries["registered_workers"]).fetchall()
        except psycopg.errors.UndefinedColumn:
            rows = conn.execute(queries["registered_workers_before_0022"]).fetchall()
        for owner, worker_level in rows:
            registered.add(owner)
            if worker_level is not None and worker_level >= level:
                safe.append(owner)
    params = {"safe": safe, "window": window, "level": level}
    owners = conn.execute(queries["live_leases"], params).fetchall()
    sends, send_age = conn.execute(queries["recent_sends"], params).fetchone()
    claims, claim_age = conn.execute(queries["recent_claims"], params).fetchone()
    return LiveWork(
        leases=sum(row[1] for row in owners),
        owners=tuple((row[0], row[0] in registered) for row in owners),
        oldest_lease_age=max((row[2] for row in owners), default=None),
        leases_expire_in=max((row[3] for row in owners), default=None),
        sends=sends,
        latest_send_age=send_age,
        claims=claims,
        latest_claim_age=claim_age,
        window=window,
        level=level,
    )


def _exists(conn: psycopg.Connection, schema: str, table: str) -> bool:
    name = sql.Identifier(schema, table).as_string(conn)
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()[0]


def refusal_message(breaking: Migration, seen: LiveWork) -> str:
    """Why ``migrate`` refuses to apply ``breaking`` while ``seen``."""
    return (
        f"migration {breaking.filename} is breaking, and the database shows live work of "
        f"processes whose code does not ship it: {seen.describe()}. Stop every process of "
        "the earlier release first (see the upgrading guide); if they are stopped already "
        "(a killed worker's leases stay live until they expire), wait, or run `migrate "
        "--force`"
    )


def migrate(
    url: str,
    schema: str = "dramatiq",
    *,
    directory: Path | None = None,
    target: int | None = None,
    force: bool = False,
    report: Callable[[Migration, float | None], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> list[Migration]:
    """Apply every pending migration, in order, and return the ones applied (see
    :func:`migrate_locked` for the transactions, and how they wait for their locks).

    Parameters:
      url(str): the database URL.
      schema(str): the schema to create and migrate.
      directory(Path): the migration files; the top-level ``migrations/`` by default.
      target(int): stop after this version (tests use it to check upgrades).
      force(bool): apply a breaking migration even while :func:`live_work` sees work of
        processes whose code does not ship it (it is logged).
      report: called with each migration and None as it starts, then with the seconds it
        took once its statements ran (a migration applied with others counts once their
        transaction commits: a transaction tried again reports its migrations again);
        without it, each applied migration is logged (INFO).
      say: called with a line when a migration waits for a lock (whom for), and when it
        got it after waiting; without it, logged (WARNING).

    Raises:
      LiveWorkFound: a pending migration is breaking and live work was seen (not forced).
      MigrationChecksumError: an applied file was edited.
      MigrationError: a file failed to apply (its transaction is rolled back).
    """
    migrations = discover(directory)
    if target is not None:
        migrations = [m for m in migrations if m.version <= target]
    with psycopg.connect(url, autocommit=True) as conn:
        # Held on this connection only, for the length of the migration; the job path
        # takes no advisory locks.
        conn.execute("SELECT pg_advisory_lock(%s, %s)", (_LOCK_NAMESPACE, _lock_key(schema)))
        try:
            return migrate_locked(
                conn, schema, migrations, force=force, report=report, say=say, url=url
            )
        finally:
            if not conn.closed:
                conn.execute(
                    "SELECT pg_advisory_unlock(%s, %s)", (_LOCK_NAMESPACE, _lock_key(schema))
                )


def migrate_locked(
    conn: psycopg.Connection,
    schema: str,
    migrations: list[Migration],
    *,
    force: bool = False,
    report: Callable[[Migration, float | None], None] | None = None,
    say: Callable[[str], None] | None = None,
    url: str | None = None,
) -> list[Migration]:
    """:func:`migrate`'s work, on ``conn`` (autocommit), which holds the schema's
    migration lock (:func:`lock_key`).

    How the pending migrations are applied (:func:`units`): each one before the first
    breaking one in a transaction of its own, every one from the first breaking one on in
    one transaction, so that no process ever sees the schema between a breaking migration
    and those that complete it; such a transaction locks, first, the tables its files name
    (:func:`_lock_unit`), and looks for live work again once it holds them. Every
    statement of a transaction waits at most :data:`~.locks.LOCK_TIMEOUT_MS` for a lock
    (``lock_timeout``): a send or a claim then never queues longer behind a migration's
    lock request, whatever reader holds the table. A statement that times out (or is chosen
    as a deadlock's victim) rolls the whole transaction back, with every migration in it,
    and the transaction is run again from
    its start once the long holders of the schema's locks it met have let go (or after a
    pause): until it gets its locks, however long that takes, saying whom it waits for
    (:class:`_Waits`). A migration outside a transaction (:func:`parse_transaction`) runs
    alone, as it is, without the lock timeout (its locks hold up no send or claim), saying
    whom it waits for while it waits; an index it failed to build is dropped.

    Parameters:
      say: called with a line when the run waits for a lock, and when it got it after
        waiting; without it, those lines are logged (WARNING).
      url: the database URL, for the second connection that watches a migration outside
        a transaction while it waits (without it, such a migration waits silently).
    """
    done: list[Migration] = []
    _ensure_table(conn, schema)
    applied = _applied(conn, schema)
    _check_checksums(migrations, applied)
    pending = [m for m in migrations if m.version not in applied]
    breaking = next((m for m in pending if m.breaking), None)
    recheck: Callable[[], None] | None = None
    if breaking is not None:
        # The code still running must ship every breaking migration of the run.
        level = [m for m in pending if m.breaking][-1].version

        def recheck() -> None:
            seen = live_work(conn, schema, level=level)
            if seen and not force:
                raise LiveWorkFound(refusal_message(breaking, seen))

        seen = live_work(conn, schema, level=level)
        if seen and not force:
            raise LiveWorkFound(refusal_message(breaking, seen))
        if seen:
            logger.warning(
                "Applying the breaking migration %s despite live work (forced): %s.",
                breaking.filename,
                seen.describe(),
            )
    tell = say or _log_line
    for unit in units(pending):
        if unit[0].transactional:
            # Looked at again in the transaction that applies a breaking migration, once it
            # holds its tables: it may come long after the first look (it waits for its
            # locks), and work that began meanwhile would run beside it.
            again = recheck if any(m.breaking for m in unit) else None
            took = _apply_together(conn, schema, unit, report, tell, again)
        else:
            took = [_apply_alone(conn, schema, unit[0], report, tell, url)]
        for migration, seconds in zip(unit, took):
            if report is None:
                logger.info(
                    "Applied migration %s to schema %s in %.1f s.",
                    migration.filename,
                    schema,
                    seconds,
                )
        if len(unit) > 1:
            logger.debug(
                "Migrations %s to %s committed together: no process saw the schema between them.",
                unit[0].filename,
                unit[-1].filename,
            )
        done.extend(unit)
    return done


def units(pending: list[Migration]) -> list[list[Migration]]:
    """How :func:`migrate_locked` applies ``pending``, one transaction per list: each
    migration before the first breaking one alone, every one from the first breaking one on
    together (a migration outside a transaction among them runs alone, between two such
    transactions).

    A breaking migration's refusals of older code may come in a later migration of the
    same release (0022 completes what 0012 left open: the claims and sends of 0.1.0):
    committed apart, the schema would stand between them for as long as the migrations
    in between take, and an older process still connected could claim there.
    """
    result: list[list[Migration]] = []
    together = False
    group: list[Migration] = []
    for migration in pending:
        if not migration.transactional:
            if group:
                result.append(group)
                group = []
            result.append([migration])
            continue
        together = together or migration.breaking
        if together:
            group.append(migration)
        else:
            result.append([migration])
    if group:
        result.append(group)
    return result


def _log_line(line: str) -> None:
    logger.warning("%s.", line)


def _apply_together(
    conn: psycopg.Connection,
    schema: str,
    unit: list[Migration],
    report: Callable[[Migration, float | None], None] | None,
    say: Callable[[str], None],
    recheck: Callable[[], None] | None = None,
) -> list[float]:
    """Apply ``unit`` in one transaction under the short lock timeout, again from its start
    until it gets its locks; the seconds each migration took in the try that committed.

    A unit of several migrations, or of a breaking one, first locks every table and view of
    the schema that its files name (:func:`_lock_unit`): a lock that times out then costs
    nothing but the try, never the data its first migrations moved. ``recheck`` (the
    live-work check of a breaking unit) runs once those locks are held, before anything
    is changed.

    Raises:
      LiveWorkFound: ``recheck`` saw live work (nothing was applied).
    """
    waits = _Waits(conn, schema, unit, say)
    while True:
        took: list[float] = []
        current = unit[0]
        try:
            with conn.transaction():
                conn.execute(
                    "SELECT set_config('lock_timeout', %s, true)", (f"{LOCK_TIMEOUT_MS}ms",)
                )
                conn.execute(
                    sql.SQL("SET LOCAL search_path TO {}, public").format(sql.Identifier(schema))
                )
                if len(unit) > 1 or unit[0].breaking:
                    _lock_unit(conn, schema, unit)
                if recheck is not None:
                    recheck()
                for current in unit:
                    if report is not None:
                        report(current, None)
                    started = time.monotonic()
                    conn.execute(current.read())
                    _record(conn, schema, current)
                    took.append(time.monotonic() - started)
                    if report is not None:
                        report(current, took[-1])
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as e:
            # Rolled back, every migration of the unit with it: nothing of it stays.
            waits.lost(current, e)
            continue
        except psycopg.Error as e:
            raise MigrationError(
                f"migration {current.filename} failed and was rolled back: {e}"
            ) from e
        waits.done()
        return took


def _lock_unit(conn: psycopg.Connection, schema: str, unit: list[Migration]) -> list[str]:
    """Lock (ACCESS EXCLUSIVE, in name order, each statement waiting at most the lock
    timeout) every table and view of ``schema`` whose name one of ``unit``'s files holds as
    a word; returns their names. A table a migration creates is not there yet, and needs
    no lock; a name a file mentions only in a comment is locked too, which costs nothing
    but the wait for it."""
    text = "\n".join(migration.read() for migration in unit)
    queries = Queries(schema, "migrate.sql")
    names = [row[0] for row in conn.execute(queries["schema_relations"], {"schema": schema})]
    touched = [n for n in names if re.search(rf"\b{re.escape(n)}\b", text, re.IGNORECASE)]
    if touched:
        relations = sql.SQL(", ").join(sql.Identifier(schema, name) for name in touched)
        conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(relations))
    return touched


def _apply_alone(
    conn: psycopg.Connection,
    schema: str,
    migration: Migration,
    report: Callable[[Migration, float | None], None] | None,
    say: Callable[[str], None],
    url: str | None,
) -> float:
    """Apply a migration outside a transaction: its one statement as it is (no lock
    timeout: it waits for every transaction older than it whatever lock_timeout says, and
    holds up no send or claim), watched by :class:`_Watch` while it runs, then recorded.
    An invalid index of the name it builds (left by a build that failed, here or in an
    earlier run) is dropped first, and after a failure.

    Raises:
      MigrationError: the statement failed (the migration is not recorded: the next run
        tries it again).
    """
    text = migration.read()
    match = _alone_statement(text)
    assert match is not None  # parse_transaction checked it
    builds = match.group(1).upper().lstrip().startswith("CREATE")
    index = match.group(2)
    if builds:
        _drop_if_invalid(conn, schema, index)
    if report is not None:
        report(migration, None)
    started = time.monotonic()
    with _Watch(url, conn, schema, migration, say):
        try:
            conn.execute(sql.SQL("SET search_path TO {}, public").format(sql.Identifier(schema)))
            conn.execute(text)
        except psycopg.Error as e:
            if builds and not conn.closed:
                _drop_if_invalid(conn, schema, index)
            raise MigrationError(f"migration {migration.filename} failed: {e}") from e
        finally:
            if not conn.closed:
                conn.execute("RESET search_path")
    _record(conn, schema, migration)
    took = time.monotonic() - started
    if report is not None:
        report(migration, took)
    return took


def _drop_if_invalid(conn: psycopg.Connection, schema: str, index: str) -> None:
    queries = Queries(schema, "migrate.sql")
    invalid = {row[0] for row in conn.execute(queries["invalid_indexes"], {"schema": schema})}
    if index in invalid:
        logger.warning("Dropping the invalid index %s.%s a failed build left.", schema, index)
        conn.execute(
            sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(sql.Identifier(schema, index))
        )


#: Seconds between two lines saying that a migration still waits for a lock.
WAIT_REPORT_SECONDS = 10.0
#: The longest pause between two tries of a transaction that lost its lock while a long
#: holder stays (each try makes sends and claims queue for at most the lock timeout).
RETRY_EVERY_SECONDS = 2.0
#: The pause between two tries when no long holder was seen (brief holders: the hot path).
RETRY_PAUSE = (0.02, 0.1)
#: How often a run waiting for long holders to let go looks at them.
HOLDERS_POLL_SECONDS = 0.1


def _holder(row: tuple) -> str:
    """One lock holder (a row of ``lock_holders`` or ``blocking_sessions``), in words."""
    pid, relation, mode, state, kind, seconds, query = row
    if pid is None:
        return f"a prepared transaction holding {mode} on {relation}"
    what = state or "no session"
    if kind and kind != "client backend":
        what = kind
    age = f" for {seconds:.1f} s" if seconds is not None else ""
    holds = f", holding {mode} on {relation}" if relation else ""
    last = f"; its last statement: {query}" if query else ""
    return f"server process {pid} ({what}{age}{holds}{last})"


class _Waits:
    """What a transaction of migrations does each time it loses its lock: find the long
    holders of the schema's locks, say whom it waits for (at once when a long holder is
    there, then every :data:`WAIT_REPORT_SECONDS`), and wait until they let go (at most
    :data:`RETRY_EVERY_SECONDS`) before the next try."""

    def __init__(
        self,
        conn: psycopg.Connection,
        schema: str,
        unit: list[Migration],
        say: Callable[[str], None],
    ) -> None:
        self.conn = conn
        self.schema = schema
        self.unit = unit
        self.say = say
        self.queries = Queries(schema, "migrate.sql")
        self.started: float | None = None
        self.said: float | None = None
        self.tries = 0

    def holders(self) -> list[tuple]:
        return self.conn.execute(
            self.queries["lock_holders"], {"schema": self.schema, "brief_ms": BRIEF_HOLDER_MS}
        ).fetchall()

    def lost(self, migration: Migration, error: psycopg.Error) -> None:
        now = time.monotonic()
        self.started = self.started or now
        self.tries += 1
        holders = self.holders()
        if holders and (self.said is None or now - self.said >= WAIT_REPORT_SECONDS):
            self.said = now
            verb = "waits" if self.tries == 1 else f"still waits ({now - self.started:.0f} s)"
            self.say(
                f"migration {migration.filename} {verb} for a lock "
                f"({type(error).__name__}; sends and claims go on meanwhile): "
                + "; ".join(_holder(row) for row in holders[:3])
                + (f" and {len(holders) - 3} more" if len(holders) > 3 else "")
                + "; it tries again once they let go"
            )
        if not holders:
            time.sleep(random.uniform(*RETRY_PAUSE))
            return
        pids = {row[0] for row in holders}
        deadline = time.monotonic() + RETRY_EVERY_SECONDS
        while time.monotonic() < deadline:
            time.sleep(HOLDERS_POLL_SECONDS)
            if not pids & {row[0] for row in self.holders()}:
                return

    def done(self) -> None:
        if self.said is not None and self.started is not None:
            self.say(
                f"migration {self.unit[0].filename} got its locks after waiting "
                f"{time.monotonic() - self.started:.1f} s ({self.tries + 1} tries)"
            )


class _Watch:
    """While a migration outside a transaction runs on ``conn``, a thread with a
    connection of its own looks every :data:`HOLDERS_POLL_SECONDS` at whom it waits for,
    and says so once it has waited a second, then every :data:`WAIT_REPORT_SECONDS`.
    Without a URL it does nothing."""

    def __init__(
        self,
        url: str | None,
        conn: psycopg.Connection,
        schema: str,
        migration: Migration,
        say: Callable[[str], None],
    ) -> None:
        self.url = url
        self.pid = conn.info.backend_pid
        self.migration = migration
        self.say = say
        self.queries = Queries(schema, "migrate.sql")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _Watch:
        if self.url is not None:
            self._thread = threading.Thread(
                target=self._run, name="dramatiq-pg-migration-watch", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                blocked_since: float | None = None
                said: float | None = None
                while not self._stop.wait(HOLDERS_POLL_SECONDS):
                    rows = conn.execute(
                        self.queries["blocking_sessions"], {"pid": self.pid}
                    ).fetchall()
                    now = time.monotonic()
                    if not rows:
                        blocked_since = None
                        continue
                    blocked_since = blocked_since or now
                    due = now - blocked_since >= 1.0 and (
                        said is None or now - said >= WAIT_REPORT_SECONDS
                    )
                    if due:
                        said = now
                        self.say(
                            f"migration {self.migration.filename} waits "
                            f"({now - blocked_since:.0f} s) for "
                            + "; ".join(_holder(row) for row in rows[:3])
                            + " (it runs outside a transaction: sends and claims go on)"
                        )
        except psycopg.Error as e:
            logger.debug("Could not watch migration %s: %s", self.migration.filename, e)


def _record(conn: psycopg.Connection, schema: str, migration: Migration) -> None:
    """Record an applied migration (in its transaction). A file with a header is from 0010
    on, which added the columns for it, so they exist by the time it is recorded."""
    if migration.compatibility is None:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)"
            ).format(sql.Identifier(schema)),
            (migration.version, migration.name, migration.checksum),
        )
        return
    from ..version import __version__

    conn.execute(
        sql.SQL(
            "INSERT INTO {}.schema_migrations "
            "(version, name, checksum, compatibility, reason, code_version) "
            "VALUES (%s, %s, %s, %s, %s, %s)"
        ).format(sql.Identifier(schema)),
        (
            migration.version,
            migration.name,
            migration.checksum,
            migration.compatibility,
            migration.reason,
            __version__,
        ),
    )


def status(
    url: str, schema: str = "dramatiq", *, directory: Path | None = None
) -> list[MigrationState]:
    """Report every migration as applied, pending, changed (its checksum differs) or
    unknown (applied, but not among this code's files: the database is newer), in version
    order."""
    migrations = discover(directory)
    with psycopg.connect(url, autocommit=True) as conn:
        applied = _applied(conn, schema)
    states = []
    for migration in migrations:
        record = applied.get(migration.version)
        states.append(
            MigrationState(
                version=migration.version,
                name=migration.name,
                applied_at=record[2] if record else None,
                checksum_ok=record is None or record[1] == migration.checksum,
            )
        )
    shipped = {m.version for m in migrations}
    for version, (name, _, applied_at) in applied.items():
        if version not in shipped:
            states.append(MigrationState(version, name, applied_at, known=False))
    return sorted(states, key=lambda state: state.version)
