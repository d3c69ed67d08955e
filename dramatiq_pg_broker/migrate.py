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
from pathlib import Path

import psycopg
from psycopg import sql

from .errors import MigrationChecksumError, MigrationError

logger = logging.getLogger(__name__)

_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_HEADER_RE = re.compile(r"^-- compatibility: *(\S*)\s*$")

#: The first migration under the compatibility contract (see the module docstring).
CONTRACT_FROM = 10
#: The header's two kinds.
COMPATIBLE = "compatible"
BREAKING = "breaking"

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
    return Path(__file__).resolve().parent / "migrations"


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


def migrate(
    url: str,
    schema: str = "dramatiq",
    *,
    directory: Path | None = None,
    target: int | None = None,
) -> list[Migration]:
    """Apply every pending migration, in order, and return the ones applied.

    Parameters:
      url(str): the database URL.
      schema(str): the schema to create and migrate.
      directory(Path): the migration files; the top-level ``migrations/`` by default.
      target(int): stop after this version (tests use it to check upgrades).

    Raises:
      MigrationChecksumError: an applied file was edited.
      MigrationError: a file failed to apply (its transaction is rolled back).
    """
    migrations = discover(directory)
    if target is not None:
        migrations = [m for m in migrations if m.version <= target]
    done: list[Migration] = []
    with psycopg.connect(url, autocommit=True) as conn:
        # Held on this connection only, for the length of the migration; the job path
        # takes no advisory locks.
        conn.execute("SELECT pg_advisory_lock(%s, %s)", (_LOCK_NAMESPACE, _lock_key(schema)))
        try:
            _ensure_table(conn, schema)
            applied = _applied(conn, schema)
            _check_checksums(migrations, applied)
            for migration in migrations:
                if migration.version in applied:
                    continue
                logger.info("Applying migration %s to schema %s.", migration.filename, schema)
                try:
                    with conn.transaction():
                        conn.execute(
                            sql.SQL("SET LOCAL search_path TO {}, public").format(
                                sql.Identifier(schema)
                            )
                        )
                        conn.execute(migration.read())
                        _record(conn, schema, migration)
                except psycopg.Error as e:
                    raise MigrationError(
                        f"migration {migration.filename} failed and was rolled back: {e}"
                    ) from e
                done.append(migration)
        finally:
            if not conn.closed:
                conn.execute(
                    "SELECT pg_advisory_unlock(%s, %s)", (_LOCK_NAMESPACE, _lock_key(schema))
                )
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
    from . import __version__

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
