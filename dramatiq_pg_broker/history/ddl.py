"""Retention's DDL under short lock timeouts: the locks a step takes, who holds them,
and the names of partitions (see :mod:`.retention`)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg import sql

from ..db.core import connect
from ..db.locks import BRIEF_HOLDER_MS, LOCK_TIMEOUT_MS

logger = logging.getLogger("dramatiq_pg_broker.retention")

#: The statuses retention deletes, in the order a run visits them.
FINISHED = ("succeeded", "failed", "cancelled")

#: The parents of history's daily partitions, with the column of their bound.
PARENTS = {
    **{f"jobs_history_{status}": "finished_at" for status in FINISHED},
    "job_events": "created_at",
}

#: How long a DDL statement of maintenance (attach, detach, drop) waits for its lock once
#: only brief holders hold it (``BRIEF_HOLDER_MS``: a holder that may keep it long makes
#: the try give up without queueing, see the ``lock_holders`` statement): the bound of
#: :mod:`..db.locks`, shared with migrations.
LOCK_TIMEOUT = f"{LOCK_TIMEOUT_MS}ms"

#: The lock modes maintenance statements take, with the modes that conflict with each
#: (PostgreSQL's table of conflicting table-level locks).
ACCESS_EXCLUSIVE = "ACCESS EXCLUSIVE"
SHARE_UPDATE_EXCLUSIVE = "SHARE UPDATE EXCLUSIVE"
CONFLICTS = {
    ACCESS_EXCLUSIVE: (
        "AccessShareLock",
        "RowShareLock",
        "RowExclusiveLock",
        "ShareUpdateExclusiveLock",
        "ShareLock",
        "ShareRowExclusiveLock",
        "ExclusiveLock",
        "AccessExclusiveLock",
    ),
    SHARE_UPDATE_EXCLUSIVE: (
        "ShareUpdateExclusiveLock",
        "ShareLock",
        "ShareRowExclusiveLock",
        "ExclusiveLock",
        "AccessExclusiveLock",
    ),
}

#: Tries of one DDL statement, a random pause of :data:`RETRY_PAUSE` seconds between two;
#: after the last the statement is skipped (the step reports it) and the next run tries.
DDL_TRIES = 3
RETRY_PAUSE = (0.05, 0.25)


#: The first key of the advisory lock that gives one run at a time its turn at the partition
#: steps of a schema (the second is ``hashtext(schema)``): see :class:`Turn`.
TURN_NAMESPACE = 0x64717074  # "dqpt"


class LockBusy(Exception):
    """A maintenance statement did not get its lock in :data:`DDL_TRIES` tries."""


class TurnLost(Exception):
    """The connection that held the run's turn at the partition steps ended (see
    :class:`Turn`): the run leaves the rest of them to the next run."""


class LockHeld(Exception):
    """A session that may hold it long holds a lock a maintenance statement needs: the try
    gives up without queueing."""


#: A relation a maintenance statement locks, and the mode it takes.
Lock = tuple[str, str]


def _attach_locks(parent: str, day: dt.date) -> tuple[Lock, ...]:
    """What ``ATTACH PARTITION`` of ``parent``'s ``day`` locks."""
    return (
        (parent, SHARE_UPDATE_EXCLUSIVE),
        (f"{parent}_default", ACCESS_EXCLUSIVE),
        (_partition_name(parent, day), ACCESS_EXCLUSIVE),
    )


def _detach_locks(parent: str, partition: str) -> tuple[Lock, ...]:
    """What ``DETACH PARTITION`` locks: the parent, the partition and the parent's DEFAULT
    partition (whose implicit bound widens)."""
    return (
        (parent, ACCESS_EXCLUSIVE),
        (f"{parent}_default", ACCESS_EXCLUSIVE),
        (partition, ACCESS_EXCLUSIVE),
    )


@dataclasses.dataclass
class StepResult:
    """What one step of a run did: ``state`` is ``ok``, ``skipped`` (nothing failed, but
    something was left to the next run: a lock not granted, out of time, a dry run, a module
    not installed) or ``failed`` (``error`` says why)."""

    state: str = "ok"
    detail: str = ""
    error: str | None = None
    seconds: float = 0.0


def _identifiers(names: dict[str, str]) -> dict[str, sql.Identifier]:
    return {k: sql.Identifier(v) for k, v in names.items()}


def _named(text: str, **names: str) -> sql.Composed:
    """A retention statement with its tables (identifiers) filled in."""
    return sql.SQL(text).format(**_identifiers(names))


def _for(text: str, partition: str) -> sql.Composed:
    """A retention statement with its partition filled in."""
    return _named(text, partition=partition)


def _day_of(moment: dt.datetime) -> dt.date:
    return moment.astimezone(dt.timezone.utc).date()


def _partition_name(parent: str, day: dt.date) -> str:
    return f"{parent}_{day:%Y%m%d}"


class Turn:
    """One run's turn at the partition steps (create, drop, default) of a schema: a
    transaction-level advisory lock, taken without waiting, in a transaction kept open on
    a connection of its own for as long as the steps run (:meth:`take`).

    Runs started at once (the workers' scheduled run, a cron's ``prune``, an operator's)
    never wait for each other: the one that gets the turn does the partition work, the
    others skip those steps, saying who has it, and go on with the rest (their reclaimers
    take different rows). Two runs attaching, detaching or moving the same day at once
    would trip over each other's tables and constraints half-way. The transaction holds
    no snapshot and no transaction id (READ COMMITTED, one SELECT), so it keeps nothing
    from vacuum, and it works behind PgBouncer in transaction mode (a transaction keeps
    its server session). A session the server ends (a restart, an
    ``idle_in_transaction_session_timeout``) releases the turn: :meth:`check` tells the
    run before each DDL statement, and the run stops its partition work there
    (:class:`TurnLost`).
    """

    def __init__(self, conn: psycopg.Connection, row: tuple) -> None:
        self._conn = conn
        #: Whether this run has the turn; if not, the server process id of the holder's
        #: connection and since when its transaction runs (None: it ended meanwhile).
        self.ours: bool = row[0]
        self.holder: int | None = row[1]
        self.since: dt.datetime | None = row[2]

    @classmethod
    @contextlib.contextmanager
    def take(cls, url: str, schema: str, query: str) -> Iterator[Turn]:
        """Try to take the turn of ``schema`` on a new connection to ``url`` (``query``:
        the ``take_turn`` statement of retention.sql); the turn is released, and the
        connection closed, on leaving the block.

        Raises:
          dramatiq.errors.ConnectionError: the database cannot be reached.
        """
        conn = connect(url)
        try:
            conn.execute("BEGIN")
            row = conn.execute(query, {"namespace": TURN_NAMESPACE, "schema": schema}).fetchone()
            yield cls(conn, row)
        finally:
            # The transaction ends (and the turn with it) before this returns: a closed
            # connection's backend lets its locks go only once it has exited, which a run
            # started right after this one could beat.
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
            conn.close()

    def describe_holder(self) -> str:
        """Why this run skips the partition steps, in one line."""
        who = f"server process {self.holder}" if self.holder else "another run"
        when = f", its transaction since {self.since:%H:%M:%S %Z}" if self.since else ""
        return f"another maintenance run has the partition steps' turn ({who}{when})"

    def check(self) -> None:
        """Raise :class:`TurnLost` when the connection holding the turn has ended."""
        try:
            self._conn.execute("SELECT 1")
        except psycopg.Error as e:
            raise TurnLost(str(e).strip() or type(e).__name__) from e


class LockedDDL:
    """A run's DDL under short lock timeouts (a part of :class:`.retention._Run`)."""

    #: The run's turn at the partition steps (:class:`Turn`), checked before each DDL
    #: statement; None outside them.
    turn: Turn | None = None

    def ddl(self, statement, params: dict | None = None, *, locks: Sequence[Lock] = ()):
        """Run one maintenance statement alone in its transaction (see :meth:`locked`);
        returns its first column (or None). ``locks`` names what it locks.

        Raises:
          LockBusy: its locks were not granted in :data:`DDL_TRIES` tries.
        """

        def run(conn: psycopg.Connection):
            cur = conn.execute(statement, params)
            row = cur.fetchone() if cur.description else None
            return row[0] if row else None

        return self.locked(locks, run)

    def locked(self, locks: Sequence[Lock], work: Callable[[psycopg.Connection], Any]) -> Any:
        """Run ``work`` in a transaction of its own that takes ``locks`` (relation, mode),
        up to :data:`DDL_TRIES` times with a random pause in between. Each try first asks
        ``pg_locks`` who holds them (:meth:`check_holders`, called again by ``work`` before
        a later statement): a holder that may keep them long ends the try at once, without
        queueing; else the statements wait for brief holders under :data:`LOCK_TIMEOUT`.
        The transaction commits without waiting for its WAL flush (its locks go at once;
        a crash can only undo a partition change the next run makes again).

        Raises:
          LockBusy: not granted in :data:`DDL_TRIES` tries.
        """
        for attempt in range(DDL_TRIES):
            if self.turn is not None:
                self.turn.check()
            try:
                with self.pool.connection() as conn:
                    started = time.monotonic()
                    with conn.transaction():
                        conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                        conn.execute("SET LOCAL synchronous_commit = off")
                        self.check_holders(conn, locks)
                        result = work(conn)
                    logger.debug(
                        "Maintenance transaction on %s: %.0f ms.",
                        ", ".join(r for r, _ in locks) or "new tables",
                        (time.monotonic() - started) * 1000,
                    )
                    return result
            except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected, LockHeld):
                if attempt + 1 < DDL_TRIES:
                    self.pause(random.uniform(*RETRY_PAUSE))
        raise LockBusy

    def check_holders(self, conn: psycopg.Connection, locks: Sequence[Lock]) -> None:
        """Raise :class:`LockHeld` when a session that may keep it long holds (or waits
        for) a lock conflicting with one of ``locks``."""
        if not locks:
            return
        pairs = [(relation, held) for relation, mode in locks for held in CONFLICTS[mode]]
        conn.execute(self.queries["clear_activity_snapshot"])
        holder = conn.execute(
            self.queries["lock_holders"],
            {
                "schema": self.schema,
                "relations": [r for r, _ in pairs],
                "modes": [m for _, m in pairs],
                "brief_ms": BRIEF_HOLDER_MS,
            },
        ).fetchone()
        if holder is not None:
            relation, mode, granted, pid, state, kind, seconds = holder
            logger.debug(
                "%s %s %s by pid %s (%s, %s, transaction of %s s): not queueing behind it.",
                relation,
                mode,
                "held" if granted else "waited for",
                pid,
                kind,
                state,
                seconds,
            )
            raise LockHeld(relation)

    def free(self, locks: Sequence[Lock]) -> bool:
        """Whether ``locks`` could be had now without waiting for a long holder (nothing
        is locked)."""
        with self.pool.connection() as conn:
            try:
                self.check_holders(conn, locks)
            except LockHeld:
                return False
        return True
