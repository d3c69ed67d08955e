"""Queue limits: at most N jobs of a queue run at a time, across every worker process and
host.

A limit is a row of ``<schema>.queue_limits`` (queue name, limit, who set it). It is
enforced where jobs are claimed (:meth:`~.jobs.JobStore.claim_limited`): the claim of a
limited queue takes a transaction-level advisory lock on the queue, so that claims of
that queue take turns on every host, counts the queue's ``running`` jobs and claims at
most the limit less that count. The limit is read in that transaction, so a change holds
at the next claim of every worker, with no restart and no cache to go stale. A queue
without a limit is claimed by the plain statement (``claim_jobs``), which never reads
this table: unlimited queues pay nothing.

What a worker caches is only *which* queues are limited, to choose the statement
(:class:`QueueLimits`). A change is announced on the queue's channel (payload
``limit``), so consumers listening read the limits again before their next claim; a
worker reads them anyway at most once a second while it claims work, when a notification
wakes it (the listener's look after a reconnection stands for what was lost meanwhile),
or while one of its queues is limited, and before every claim at most once a second in
poll-only mode (``listen=False``). A queue that becomes limited is thus held to its limit
within about a second, everywhere; until then a worker that has not heard of it may claim
as before.

What counts as running: every ``running`` row of the queue whose lease has not run out:
claimed by a worker (a limited queue's consumer claims only what its worker threads can
start at once, never a prefetch), started, aborted while its thread is still in the actor
(the attempt ends when the thread leaves it), finished but with its outcome not written
yet (a few milliseconds), or held by a worker that died, until its lease runs out. That
last one is deliberate: the database cannot tell a dead worker from a slow one before the
lease says so, and counting it never lets two attempts of the limit run beside the one
that may still be running. Once the lease ran out (the reaper's test: never within a
lease of the server's start), the row holds no place, whether or not the reaper took it
back yet: a crashed worker's place comes back within its lease, whatever
``reaper_interval`` is.

Limits set in code (``PostgresBroker(queue_limits={"partner_api": 5})`` or
``DRAMATIQ_PG_QUEUE_LIMITS=partner_api=5``) are written by each worker process before its
first claim, of any queue (:func:`apply_declared`, from :meth:`QueueLimits.refresh`): the
claim that follows reads them like any other limit, so the deploy that introduces a limit
is held to it from the first claim of its first worker. Until the write succeeds, the
process claims nothing (a failure to write is raised to the consumer, which tries again).
A worker whose code does not declare the limit (an older deploy, still running) is told
on the queue's channel when the row is written, as for an operator's change. An
operator's limit (``dramatiq-pg-broker queues limit`` or ``PUT /api/queues/{name}/limit``)
wins over code: a worker replaces only a limit that code set. Clearing a limit deletes the
row, whoever set it; a worker process configured with a limit for that queue sets it again
when it next starts.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import psycopg
from dramatiq.middleware import Middleware

from .. import forks
from ..config import Settings
from ..db.queries import statements_for
from ..errors import QueueNotDeclared
from ..jobs.rows import AsDict, channel_name, clean_text
from ..queue_rules import check_limit, check_queue_name
from .queues import get as get_queue
from .queues import not_declared

if TYPE_CHECKING:
    from ..db.core import ProcessPool

logger = logging.getLogger("dramatiq_pg_broker.limits")


class Occupancy(Protocol):
    """What the queue limits ask the in-flight ledger
    (:class:`~dramatiq_pg_broker.attempt.inflight.Ledger`)."""

    def occupying(self) -> int: ...


class LimitReads(Protocol):
    """What the queue limits ask the job store (:class:`~dramatiq_pg_broker.jobs.JobStore`)."""

    def queue_limits(self) -> dict[str, int]: ...


#: The payload on a queue's channel that announces a change of its limit.
LIMIT_PAYLOAD = "limit"

#: How old a worker's copy of which queues are limited may get while it claims work.
REFRESH_SECONDS = 1.0

#: How long a limited queue that found no free worker thread keeps the next ones reserved
#: for it without saying so again (its consumer says so every few claims' time).
HUNGER_SECONDS = 0.5


@dataclasses.dataclass(frozen=True)
class QueueLimit(AsDict):
    """A queue's limit: at most ``limit`` of its jobs run at once. ``source`` is ``code``
    (a worker's ``queue_limits`` setting) or ``operator`` (the CLI, the admin API)."""

    queue_name: str
    limit: int
    source: str
    set_by: str
    set_at: dt.datetime


#: The statements of limits.sql for a schema (loaded once per process, shared).
_queries = functools.partial(statements_for, filename="limits.sql")


def get(conn: psycopg.Connection, schema: str, name: str) -> QueueLimit | None:
    """One queue's limit, or None when it has none."""
    row = conn.execute(_queries(schema)["get_queue_limit"], {"name": name}).fetchone()
    return None if row is None else QueueLimit(*row)


def all_limits(conn: psycopg.Connection, schema: str) -> dict[str, QueueLimit]:
    """Every queue's limit, by queue name."""
    rows = conn.execute(_queries(schema)["queue_limits"]).fetchall()
    return {row[0]: QueueLimit(*row) for row in rows}


def set_limit(
    conn: psycopg.Connection,
    schema: str,
    name: str,
    limit: int | None,
    *,
    by: str,
    force: bool = False,
) -> QueueLimit | None:
    """Set (or, with ``limit`` None, clear) an operator's limit on a queue, and tell its
    consumers on every host. From the commit on, no claim of the queue lets more than
    ``limit`` of its jobs run; jobs already running beyond a lowered limit finish.

    Parameters:
      conn(psycopg.Connection): where to run it (in its own transaction, or a savepoint
        of the caller's).
      schema(str): the broker's schema.
      name(str): the queue.
      limit(int | None): the limit; None clears it.
      by(str): who sets it, as recorded.
      force(bool): limit a queue no worker declared yet.

    Returns:
      QueueLimit | None: the limit now in force (None: the queue has none).

    Raises:
      QueueNotDeclared: no worker declared the queue (and ``force`` is False).
      InvalidQueueName: the name cannot be a queue's.
      InvalidQueueLimit: the limit is not a whole number from 1 to
        :data:`~dramatiq_pg_broker.queue_rules.MAX_LIMIT`.
    """
    check_queue_name(name)
    if limit is not None:
        check_limit(limit)
    queries = _queries(schema)
    with conn.transaction():
        if not force and get_queue(conn, schema, name) is None:
            raise QueueNotDeclared(
                f"{not_declared(name)}, or limit it ahead of its workers with --force"
            )
        if limit is None:
            conn.execute(queries["clear_queue_limit"], {"name": name})
            result = None
        else:
            row = conn.execute(
                queries["set_queue_limit"],
                {"name": name, "limit": limit, "by": clean_text(by) or "unknown"},
            ).fetchone()
            result = QueueLimit(*row)
        conn.execute(queries["notify_limit"], {"channel": channel_name(schema, name)})
    return result


def apply_declared(
    conn: psycopg.Connection, schema: str, limits: Mapping[str, int], *, by: str
) -> list[str]:
    """Write the limits a worker was configured with (each worker process does it before
    its first claim, see :meth:`QueueLimits.refresh`): a queue without a limit gets its
    configured one, a limit set by code takes the new value, and an operator's limit is
    left as it is. Consumers of a queue whose limit changed are told (at the commit of the
    caller's transaction).

    Returns:
      list[str]: the queues whose limit changed.
    """
    if not limits:
        return []
    names = sorted(limits)
    queries = _queries(schema)
    changed = [
        row[0]
        for row in conn.execute(
            queries["apply_code_limits"],
            {"names": names, "limits": [int(limits[n]) for n in names], "by": by},
        ).fetchall()
    ]
    for name in changed:
        conn.execute(queries["notify_limit"], {"channel": channel_name(schema, name)})
    for name, limit in all_limits(conn, schema).items():
        if name in limits and limit.source == "operator" and limit.limit != limits[name]:
            # Said where it is decided: the limits line each process logs names values only.
            logger.warning(
                "Queue %s keeps the limit %d an operator set (%s, %s), not this worker's "
                "queue_limits %d: an operator's limit wins over code. "
                "`dramatiq-pg-broker queues limit %s --clear` lifts it (the next worker to "
                "boot sets its own).",
                name,
                limit.limit,
                limit.set_by,
                limit.set_at.isoformat(timespec="seconds"),
                limits[name],
                name,
            )
    return changed


@dataclasses.dataclass(eq=False, repr=False, kw_only=True)
class QueueLimits(Middleware):
    """A worker process's view of queue limits: which queues are limited (refreshed as the
    module docstring says), and how many of its worker threads are free to start a job
    now. It writes the limits declared in code before its process's first claim.
    :class:`~dramatiq_pg_broker.PostgresBroker` installs it.

    Parameters:
      store(JobStore): where the limits are read.
      ledger(Ledger): the in-flight ledger, which counts the attempts that hold a thread.
      settings(Settings): its ``listen`` (without LISTEN, no change is announced), its
        ``queue_limits`` (the limits declared in code) and its ``schema``.
      pool(ProcessPool): where the declared limits are written (opened on first use).
    """

    store: LimitReads
    ledger: Occupancy
    settings: Settings
    pool: ProcessPool

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._limits: dict[str, int] = {}
        #: Monotonic time of the last read (None: never read, or a change was announced).
        self._read_at: float | None = None
        #: The worker's thread count (None: no worker booted in this process).
        self.worker_threads: int | None = None
        #: Limited queues of this process that wait for a free thread, with when each
        #: last said so (see :meth:`hungry`).
        self._hungry: dict[str, float] = {}
        #: Whether this process wrote the limits declared in code (see :meth:`refresh`).
        self._declared = False
        self._process = forks.PerProcess(self._enter_process, value=None)

    def _enter_process(self) -> None:
        with self._lock:
            self._limits = {}
            self._read_at = None
            self._hungry = {}
            self._declared = False

    def before_worker_boot(self, broker, worker) -> None:
        self.worker_threads = getattr(worker, "worker_threads", None)

    def invalidate(self) -> None:
        """A change was announced: read the limits again before the next claim."""
        self._read_at = None

    def limit_of(self, queue_name: str, *, busy: bool) -> int | None:
        """The queue's limit as this process last read it (None: unlimited), read again
        first when a change was announced or, while the caller claims work or was woken by
        a notification (``busy``) or
        the queue is limited or the consumers poll without LISTEN, when the last read is
        older than :data:`REFRESH_SECONDS`.

        Raises:
          dramatiq.errors.ConnectionError: the database is unreachable.
        """
        self._process.get()
        read_at = self._read_at
        now = time.monotonic()
        stale = read_at is None or (
            now - read_at >= REFRESH_SECONDS
            and (busy or queue_name in self._limits or not self.settings.listen)
        )
        if stale:
            self.refresh(unless_read_since=read_at)
        return self._limits.get(queue_name)

    def refresh(self, *, unless_read_since: float | None = None) -> dict[str, int]:
        """Read every limit now (one statement), unless another thread read them since
        ``unless_read_since`` (the read its caller saw): the consumers of a process that
        find the copy stale at once read it once. The process's first read writes the
        limits declared in code first (:meth:`write_declared`): every consumer reads the
        limits before its first claim, so no claim of this process comes before them.

        Raises:
          dramatiq.errors.ConnectionError: the database is unreachable (nothing is
            claimed: the caller tries again).
        """
        with self._lock:
            if unless_read_since is not None and self._read_at not in (None, unless_read_since):
                return self._limits
            if not self._declared:
                self.write_declared()
            limits = self.store.queue_limits()
            if limits != self._limits:
                logger.info(
                    "Queue limits: %s.",
                    ", ".join(f"{q}={n}" for q, n in sorted(limits.items())) or "none",
                )
            self._limits = limits
            self._read_at = time.monotonic()
            return limits

    def write_declared(self) -> list[str]:
        """Write the limits declared in code (the ``queue_limits`` setting) with
        :func:`apply_declared`, once per process; an operator's limit wins. Returns the
        queues whose limit this changed.

        Raises:
          dramatiq.errors.ConnectionError: the database is unreachable (written next time).
        """
        declared = dict(self.settings.queue_limits)
        changed: list[str] = []
        if declared:
            by = f"worker {socket.gethostname()}:{forks.pid()}"
            with self.pool.connection() as conn, conn.transaction():
                changed = apply_declared(conn, self.settings.schema, declared, by=by)
            if changed:
                logger.info("Queue limits set from this worker's code: %s.", ", ".join(changed))
        self._declared = True
        return changed

    def hungry(self, queue_name: str) -> None:
        """A limited queue has jobs to run and below its limit, but every worker thread of
        this process is taken (running, or prefetched by the other queues' consumers).
        Until it is fed, or says nothing for :data:`HUNGER_SECONDS`, the other consumers
        of this process claim only what leaves it the next free thread (:meth:`reserved`):
        otherwise their prefetch would keep every thread busy and the limited queue, which
        never prefetches, would starve on a worker the other queues keep busy."""
        self._hungry[queue_name] = time.monotonic()

    def fed(self, queue_name: str) -> None:
        """The limited queue claimed (or is at its limit, or has nothing to run)."""
        if self._hungry:
            self._hungry.pop(queue_name, None)

    def reserved(self) -> int:
        """How many of the next free threads the unlimited consumers leave to hungry
        limited queues (0 in a process with no limited queue waiting: nothing is read)."""
        if not self._hungry:
            return 0
        now = time.monotonic()
        return sum(1 for at in list(self._hungry.values()) if now - at < HUNGER_SECONDS)

    def free_threads(self) -> int | None:
        """Worker threads of this process that could start a message now: the threads
        less the attempts this process holds that run or wait for a thread (every queue's).
        None when no worker booted here (no bound but the limit's)."""
        threads = self.worker_threads
        if threads is None:
            return None
        return max(0, threads - self.ledger.occupying())
