"""The schema handshake: may this code use the database's schema?

Two numbers decide, both counted in migrations:

- this code's **schema level**: the highest migration it ships (:func:`this_code`). A
  release is written against every migration it ships, so it needs all of them applied;
- the schema's **minimum code level**: the version of the latest *breaking* migration
  applied (0 while none is; see :mod:`.migrate` for the compatibility header that says which
  kind a migration is). Code that does not ship that migration may no longer use the
  schema: its processes must stop.

So a process refuses the schema when migrations it ships are not applied
(:class:`~.errors.MigrationsPending`: run ``dramatiq-pg-broker migrate``) or when its level
is below the schema's minimum (:class:`~.errors.CodeTooOld`: upgrade the package), each
with one line saying what is there, what is needed and which command fixes it. A schema
that has migrations this code does not ship, all of them compatible, is newer than the code
but admits it: the process runs and logs that once.

Where it is checked: in :class:`~.db.ProcessPool`, on the first connection a process takes
from it (:meth:`~.db.ProcessPool.connection`), so every sender, worker, results or
rate-limiter backend, CLI command and admin API process passes it before its first
statement: one round trip, once per process, nothing per message. A failed check is not
remembered: the next use checks again (a migration may have run meanwhile). What each kind
of process does with a refusal:

- a sender: the exception, from its ``send()``;
- a worker (:class:`SchemaGate`): checks when it boots, before it claims anything. While
  migrations are pending it says so once and checks again every :data:`WAIT_SECONDS`, then
  says that it proceeds; code the schema no longer admits logs one line and exits with
  status :data:`EXIT_CODE_TOO_OLD`, which stops the ``dramatiq`` command. The boot does
  not wait for it (beyond :data:`BOOT_WAIT_SECONDS`), so that the worker's log lines reach
  the ``dramatiq`` command at once; its consumers, reaper and scheduler wait instead;
- the CLI: ``error: <the line>`` and exit status 2 (``migrate`` and ``status`` report
  instead of refusing);
- the admin API: a 503 with the line, for every request until the schema fits.

A process checks when it starts, not afterwards: a breaking migration applied under running
processes of an older release is not noticed by them. Hence the deploy order of the
upgrading guide: stop them first.

The code's level is read from the folder ``migrate`` applies (``DRAMATIQ_PG_MIGRATIONS_DIR``
when set, else the package's own ``migrations``), so that the two always agree. That is
also the seam through which the tests build a schema newer than this code: they migrate
with a folder holding one more, breaking, migration, and run this code against it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import logging
import os
import threading
from pathlib import Path
from typing import Protocol

import psycopg
from dramatiq.errors import BrokerConnectionError
from dramatiq.middleware import Middleware

from .. import forks
from ..errors import CodeTooOld, MigrationsPending
from .migrate import Migration, discover, lock_key, migrations_dir
from .queries import Queries

logger = logging.getLogger("dramatiq_pg_broker.handshake")


class SchemaCheck(Protocol):
    """What the schema gate checks through: the process pool
    (:class:`~dramatiq_pg_broker.db.core.ProcessPool`), which runs the handshake at most
    once per process and opens on first use."""

    def check_schema(self, *, wait_for_migration: bool = True) -> None: ...


#: Seconds between two checks of a worker waiting for a migration.
WAIT_SECONDS = 5.0
#: Seconds between two tries of a booting worker that cannot reach the database (each try
#: also waits up to the pool's timeout for a connection).
UNREACHABLE_RETRY_SECONDS = 0.5
#: Longest a worker's boot waits for the handshake; after it the boot goes on with the gate
#: closed (see :class:`SchemaGate`).
BOOT_WAIT_SECONDS = 1.0
#: The exit status of a worker process whose code the schema no longer admits: the
#: ``dramatiq`` command's own status for a broker that cannot be used at start.
EXIT_CODE_TOO_OLD = 3


@dataclasses.dataclass(frozen=True)
class Code:
    """A release of this package: its version and the migrations it ships."""

    version: str
    migrations: tuple[Migration, ...]

    @property
    def level(self) -> int:
        """The highest migration shipped."""
        return self.migrations[-1].version if self.migrations else 0

    def describe(self) -> str:
        return f"dramatiq-pg-broker {self.version} (schema level {self.level:04d})"


@functools.lru_cache(maxsize=8)
def _code(directory: Path, version: str) -> Code:
    return Code(version, tuple(discover(directory)))


def this_code(directory: Path | None = None) -> Code:
    """This release: ``dramatiq_pg_broker.__version__`` and the migrations of ``directory``
    (default: the folder ``migrate`` applies). Read once per process.

    Raises:
      MigrationError: a migration file is misnamed or lacks its compatibility header.
    """
    from ..version import __version__

    return _code(Path(directory or migrations_dir()), __version__)


@dataclasses.dataclass(frozen=True)
class AppliedMigration:
    """A row of ``schema_migrations``."""

    version: int
    name: str
    #: ``compatible``, ``breaking``, or None (released before the contract).
    compatibility: str | None
    #: The package version that applied it (None before migration 0010).
    code_version: str | None

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


@dataclasses.dataclass(frozen=True)
class SchemaState:
    """What the database says about its schema."""

    schema: str
    applied: tuple[AppliedMigration, ...]

    @property
    def level(self) -> int:
        """The highest migration applied (0: none)."""
        return self.applied[-1].version if self.applied else 0

    @property
    def raised_by(self) -> AppliedMigration | None:
        """The latest breaking migration applied: the one that sets the minimum."""
        breaking = [m for m in self.applied if m.compatibility == "breaking"]
        return breaking[-1] if breaking else None

    @property
    def min_code_level(self) -> int:
        """The oldest schema level of code that may use the schema."""
        raised_by = self.raised_by
        return raised_by.version if raised_by is not None else 0

    def pending(self, code: Code) -> list[Migration]:
        """The migrations ``code`` ships that are not applied."""
        applied = {m.version for m in self.applied}
        return [m for m in code.migrations if m.version not in applied]

    def unknown(self, code: Code) -> list[AppliedMigration]:
        """The applied migrations ``code`` does not ship: the database is newer."""
        shipped = {m.version for m in code.migrations}
        return [m for m in self.applied if m.version not in shipped]

    def admits(self, code: Code) -> bool:
        return code.level >= self.min_code_level


def read_state(conn: psycopg.Connection, schema: str) -> SchemaState:
    """Read the applied migrations: one statement, or two before migration 0010.

    A schema without the table or its 0010 columns fails the first statement, and the
    second must still run: in autocommit mode (a pooled connection is) it does; inside a
    transaction (``doctor``'s) the first runs in a savepoint.
    """
    queries = Queries(schema, "schema.sql")
    in_transaction = conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
    try:
        with conn.transaction() if in_transaction else contextlib.nullcontext():
            rows = conn.execute(queries["read_migrations"]).fetchall()
    except psycopg.errors.UndefinedTable:
        rows = []
    except psycopg.errors.UndefinedColumn:
        rows = conn.execute(queries["read_migrations_before_contract"]).fetchall()
    return SchemaState(schema, tuple(AppliedMigration(*row) for row in rows))


def _labels(labels: list[str]) -> str:
    if len(labels) <= 3:
        return ", ".join(labels)
    return f"{labels[0]}, ..., {labels[-1]}"


def pending_message(state: SchemaState, code: Code, pending: list[Migration]) -> str:
    """The refusal line of a schema older than ``code`` needs."""
    there = f"is at migration {state.level:04d}" if state.applied else "has no migration applied"
    labels = [f"{m.version:04d}_{m.name}" for m in pending]
    return (
        f"schema {state.schema!r} {there}, and dramatiq-pg-broker {code.version} needs "
        f"{code.level:04d} ({len(pending)} pending: {_labels(labels)}): run "
        "`dramatiq-pg-broker migrate` with the same DRAMATIQ_PG_URL and DRAMATIQ_PG_SCHEMA"
    )


def too_old_message(state: SchemaState, code: Code) -> str:
    """The refusal line of code the schema no longer admits."""
    raised_by = state.raised_by
    assert raised_by is not None
    applier = ""
    if raised_by.code_version:
        applier = f"; dramatiq-pg-broker {raised_by.code_version} applied it"
    return (
        f"schema {state.schema!r} is at migration {state.level:04d} and admits code of schema "
        f"level {state.min_code_level:04d} or later (its migration {raised_by.label} is "
        f"breaking{applier}), but this is {code.describe()}: upgrade dramatiq-pg-broker on "
        f"this host to a release that ships migration {raised_by.version:04d}"
    )


def newer_message(state: SchemaState, code: Code, unknown: list[AppliedMigration]) -> str:
    """The note for a schema newer than ``code`` that still admits it."""
    versions = sorted({m.code_version for m in unknown if m.code_version})
    by = f" by dramatiq-pg-broker {', '.join(versions)}" if versions else ""
    return (
        f"schema {state.schema!r} has {len(unknown)} migration(s) that {code.describe()} "
        f"does not ship ({_labels([m.label for m in unknown])}), applied{by}; none is "
        "breaking for it, so it runs: upgrade it when convenient"
    )


def verify(state: SchemaState, code: Code) -> None:
    """Refuse ``state`` for ``code``.

    Raises:
      CodeTooOld: the schema's minimum code level is above ``code``'s level (checked
        first: migrating would not help).
      MigrationsPending: migrations ``code`` ships are not applied.
    """
    if not state.admits(code):
        raise CodeTooOld(too_old_message(state, code))
    pending = state.pending(code)
    if pending:
        raise MigrationsPending(pending_message(state, code, pending))


#: The notes logged in this process: (process id, schema, newest unknown migration).
_noted: set[tuple[int, str, int]] = set()


def check(conn: psycopg.Connection, schema: str, code: Code | None = None) -> SchemaState:
    """The handshake: read the schema's state and refuse it if it does not fit ``code``
    (default: :func:`this_code`). A schema newer than the code that admits it is noted
    once per process in the log.

    Returns:
      SchemaState: the state, when it fits.

    Raises:
      CodeTooOld, MigrationsPending: see :func:`verify`.
    """
    code = code or this_code()
    state = read_state(conn, schema)
    verify(state, code)
    unknown = state.unknown(code)
    if unknown:
        key = (forks.pid(), schema, unknown[-1].version)
        if key not in _noted:
            _noted.add(key)
            logger.info("%s.", newer_message(state, code, unknown))
    return state


@dataclasses.dataclass(frozen=True)
class MigrationRun:
    """A ``migrate`` running now on the schema, as its migration lock shows it."""

    pid: int
    #: When its connection started (None: the server did not say).
    since: dt.datetime | None

    def describe(self) -> str:
        return f"the `migrate` of server process {self.pid}"


def running_migration(conn: psycopg.Connection, schema: str) -> MigrationRun | None:
    """The ``migrate`` that holds ``schema``'s migration lock now, if one does (see
    :func:`.migrate.lock_key`)."""
    namespace, key = lock_key(schema)
    row = conn.execute(
        Queries(schema, "schema.sql")["running_migration"],
        {"namespace": namespace, "key": key & 0xFFFFFFFF},
    ).fetchone()
    return MigrationRun(*row) if row is not None else None


def wait_for_migration_lock(conn: psycopg.Connection, schema: str, seconds: float) -> bool:
    """Wait up to ``seconds`` for the running ``migrate`` to release ``schema``'s migration
    lock, in one statement that the release wakes (no polling); whether it was released.
    ``conn`` must be in autocommit mode; the wait is its own transaction, and takes and
    keeps nothing after it."""
    namespace, key = lock_key(schema)
    timeout = f"{max(1, round(seconds * 1000))}ms"
    try:
        with conn.transaction():
            conn.execute(
                "SELECT set_config('lock_timeout', %s, true), "
                "set_config('statement_timeout', '0', true)",
                (timeout,),
            )
            conn.execute(
                Queries(schema, "schema.sql")["wait_for_migration_lock"],
                {"namespace": namespace, "key": key},
            )
    except psycopg.errors.LockNotAvailable:
        return False
    return True


def waited_message(refusal: MigrationsPending, seconds: float, run: MigrationRun) -> str:
    """The refusal of a send that waited ``seconds`` for a migration that did not finish."""
    return (
        f"{refusal} (this send waited {seconds:g} s, migration_wait_seconds, for "
        f"{run.describe()}, which has not finished)"
    )


class SchemaGate(Middleware):
    """Keeps a worker from claiming until this code fits the schema (see the module
    docstring).

    :class:`~dramatiq_pg_broker.PostgresBroker` installs it. When a worker boots, the gate
    closes and a thread of its own runs the handshake: while migrations are pending it says
    so once and checks again every :data:`WAIT_SECONDS`; while the database cannot be
    reached it says so once (the process's outage lines tell the rest) and tries again;
    once the schema fits it opens. The boot itself waits at most
    :data:`BOOT_WAIT_SECONDS` for it, so that a worker whose database is down or behind
    boots at once and its log lines reach the ``dramatiq`` command (which shows a booting
    worker's lines only once it booted or its ``--worker-fork-timeout`` passed). What
    touches the schema in a worker waits for the gate: the consumers claim nothing, the
    reaper reaps nothing, the scheduler starts nothing. Code the schema no longer admits
    logs one line and ends the process with status :data:`EXIT_CODE_TOO_OLD`, which stops
    the ``dramatiq`` command: during the boot by raising ``SystemExit``, afterwards (the
    database came back with a newer schema) with ``os._exit``, since the process holds no
    job while the gate is closed.

    A broker whose workers never boot (a sender, or a test that consumes directly) keeps the
    gate open: the handshake then happens at the pool's first connection.

    Parameters:
      pool(ProcessPool): the process pool the handshake runs through (the broker's); it is
        given, not found on the broker the worker hooks receive, so the gate depends on
        nothing else of it.
    """

    def __init__(self, pool: SchemaCheck) -> None:
        self._pool = pool
        self._open = threading.Event()
        self._open.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._booting = False
        self._fatal = False

    @property
    def is_open(self) -> bool:
        """Whether this process may touch the schema (no worker boot waits for it)."""
        return self._open.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the gate to open; whether it is open."""
        return self._open.wait(timeout)

    def before_worker_boot(self, broker, worker) -> None:
        self._open.clear()
        self._stop.clear()
        with self._lock:
            self._booting = True
            self._fatal = False
        watcher = threading.Thread(target=self._watch, name="dramatiq-pg-schema-gate", daemon=True)
        watcher.start()
        watcher.join(BOOT_WAIT_SECONDS)
        with self._lock:
            self._booting = False
            fatal = self._fatal
        if fatal:
            raise SystemExit(EXIT_CODE_TOO_OLD)

    def before_worker_shutdown(self, broker, worker) -> None:
        self._stop.set()

    def _watch(self) -> None:
        try:
            passed = self._wait()
        except CodeTooOld as e:
            logger.critical("This worker cannot use the database: %s.", e)
            with self._lock:
                self._fatal = True
                booting = self._booting
            if not booting:
                # After the boot: nothing in this process holds a job (the gate was
                # closed), and only the process's exit status stops the dramatiq command.
                logging.shutdown()
                os._exit(EXIT_CODE_TOO_OLD)
            return
        if passed:
            self._open.set()

    def _wait(self) -> bool:
        """Check until the schema fits (True) or the worker stops (False)."""
        said: str | None = None
        while True:
            try:
                # The gate waits for a migration itself, however long it takes.
                self._pool.check_schema(wait_for_migration=False)
            except MigrationsPending as e:
                if said != "migration":
                    logger.warning(
                        "This worker waits for a migration before it claims anything: %s "
                        "(checking again every %g s).",
                        e,
                        WAIT_SECONDS,
                    )
                    said = "migration"
                delay = WAIT_SECONDS
            except BrokerConnectionError as e:
                if said != "database":
                    logger.warning(
                        "This worker waits for the database to check its schema before it "
                        "claims anything: %s",
                        e,
                    )
                    said = "database"
                delay = UNREACHABLE_RETRY_SECONDS
            else:
                if said is not None:
                    logger.info(
                        "The schema fits %s now: this worker proceeds.", this_code().describe()
                    )
                return True
            if self._stop.wait(delay):
                logger.info("Stopped while waiting for the schema.")
                return False
