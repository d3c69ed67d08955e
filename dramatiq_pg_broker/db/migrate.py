"""Schema migrations: numbered SQL files applied in order, recorded with their checksums.

Files live in the top-level ``migrations/`` folder, shipped inside the package as
``dramatiq_pg_broker/migrations`` (``DRAMATIQ_PG_MIGRATIONS_DIR`` overrides it), and are
named ``NNNN_description.sql``. Each file runs in its own transaction with ``search_path``
set to the broker's schema, and is recorded in ``<schema>.schema_migrations`` with the
SHA-256 of its bytes.

- Running :func:`migrate` twice is a no-op.
- Two migrators started at once are serialised by an advisory lock held only while
  migrating (on its own connection, never in the job path), so each file is applied once.
- A released file whose checksum changed is refused, naming the file: a change to the
  schema is a new file, never an edit.
- A run that would apply a *breaking* migration first looks for live work of processes
  that cannot check the schema (:func:`live_work`: live leases, sends and claims of the
  last :data:`LIVE_WORK_SECONDS`, except those of registered workers of this release or a
  later one) and refuses with :class:`~.errors.LiveWorkFound`, saying what it saw, unless
  forced. A fresh database has none.

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
import re
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from psycopg import sql

from ..errors import LiveWorkFound, MigrationChecksumError, MigrationError

logger = logging.getLogger("dramatiq_pg_broker.migrate")

_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_HEADER_RE = re.compile(r"^-- compatibility: *(\S*)\s*$")

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
        compatibility, reason = parse_header(path.name, data.decode("utf-8"))
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
    """What :func:`live_work` saw of processes that cannot check the schema."""

    #: Live leases (running jobs whose lease has not expired) of such processes.
    leases: int = 0
    #: Their owners (``host:pid``), and whether each is a registered worker (of an
    #: earlier release) rather than an unregistered process.
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
                    f"{len(registered)} registered worker(s) of an earlier release "
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
                f"{self.claims} claim(s) in the last {self.window:g} s not made by a "
                f"registered worker of this release (the latest "
                f"{_seconds(self.latest_claim_age)} ago)"
            )
        return "; ".join(parts)


def _seconds(value: float | None, digits: int = 1) -> str:
    return "?" if value is None else f"{value:.{digits}f} s"


def _few(items: list[str]) -> str:
    return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def _release(version: str | None) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return tuple(int(part or 0) for part in match.groups()) if match else ()


def live_work(
    conn: psycopg.Connection, schema: str, *, window: float = LIVE_WORK_SECONDS
) -> LiveWork:
    """The live work of processes that cannot check the schema against a breaking
    migration: live leases, and sends and claims of the last ``window`` seconds, except
    those of live registered workers of this release or a later one (whose code ships the
    migrations this code ships, and who claim nothing while one is pending). A process of
    this release cannot send or claim while a migration it ships is pending, so every send
    seen comes from earlier code. Reads the ``jobs`` table as every release since 0.1.0
    has it; nothing when it does not exist (a fresh database).
    """
    from ..version import __version__
    from .queries import Queries

    queries = Queries(schema, "migrate.sql")
    if not _exists(conn, schema, "jobs"):
        return LiveWork(window=window)
    safe: list[str] = []
    registered: set[str] = set()
    if _exists(conn, schema, "workers"):
        ours = _release(__version__)
        for owner, version in conn.execute(queries["registered_workers"]).fetchall():
            registered.add(owner)
            if ours and _release(version) >= ours:
                safe.append(owner)
    params = {"safe": safe, "window": window}
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
    )


def _exists(conn: psycopg.Connection, schema: str, table: str) -> bool:
    name = sql.Identifier(schema, table).as_string(conn)
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()[0]


def refusal_message(breaking: Migration, seen: LiveWork) -> str:
    """Why ``migrate`` refuses to apply ``breaking`` while ``seen``."""
    return (
        f"migration {breaking.filename} is breaking, and the database shows live work of "
        f"processes that cannot check the schema: {seen.describe()}. Stop every process of "
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
) -> list[Migration]:
    """Apply every pending migration, in order, and return the ones applied.

    Parameters:
      url(str): the database URL.
      schema(str): the schema to create and migrate.
      directory(Path): the migration files; the top-level ``migrations/`` by default.
      target(int): stop after this version (tests use it to check upgrades).
      force(bool): apply a breaking migration even while :func:`live_work` sees work of
        processes that cannot check the schema (it is logged).
      report: called with each migration and None as it starts, then with the seconds it
        took once applied; without it, each applied migration is logged (INFO).

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
            return migrate_locked(conn, schema, migrations, force=force, report=report)
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
) -> list[Migration]:
    """:func:`migrate`'s work, on ``conn`` (autocommit), which holds the schema's
    migration lock (:func:`lock_key`)."""
    done: list[Migration] = []
    _ensure_table(conn, schema)
    applied = _applied(conn, schema)
    _check_checksums(migrations, applied)
    pending = [m for m in migrations if m.version not in applied]
    breaking = next((m for m in pending if m.breaking), None)
    if breaking is not None:
        seen = live_work(conn, schema)
        if seen and not force:
            raise LiveWorkFound(refusal_message(breaking, seen))
        if seen:
            logger.warning(
                "Applying the breaking migration %s despite live work (forced): %s.",
                breaking.filename,
                seen.describe(),
            )
    for migration in pending:
        if report is not None:
            report(migration, None)
        started = time.monotonic()
        try:
            with conn.transaction():
                conn.execute(
                    sql.SQL("SET LOCAL search_path TO {}, public").format(sql.Identifier(schema))
                )
                conn.execute(migration.read())
                _record(conn, schema, migration)
        except psycopg.Error as e:
            raise MigrationError(
                f"migration {migration.filename} failed and was rolled back: {e}"
            ) from e
        took = time.monotonic() - started
        if report is not None:
            report(migration, took)
        else:
            logger.info(
                "Applied migration %s to schema %s in %.1f s.",
                migration.filename,
                schema,
                took,
            )
        done.append(migration)
    return done


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
