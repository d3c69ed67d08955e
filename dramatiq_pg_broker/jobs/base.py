"""What every part of the job store stands on: the pool, the named statements, one
reused cursor per pooled connection."""

from __future__ import annotations

import contextlib
import datetime as dt
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg

from ..db.core import ProcessPool
from ..db.queries import Queries
from ..errors import JobBusy
from ..history.probe import HistoryProbe
from .rows import Attempt, channel_name

#: One cursor per pooled connection, reused by the statements a send, a claim or an outcome
#: runs on it: a new cursor per statement looks up the adapters of every parameter and
#: result column afresh (about 40 µs of a send's Python on a 15-parameter statement). A
#: pooled connection is used by one thread at a time, and each statement's rows are read
#: before it goes back to the pool; the entry goes with the connection.
_cursors: weakref.WeakKeyDictionary[psycopg.Connection, psycopg.Cursor] = (
    weakref.WeakKeyDictionary()
)


def _execute(c: Any, query: str, params: dict[str, Any], pooled: bool) -> Any:
    """``c.execute(query, params)``, on the connection's reused cursor when ``c`` is one of
    the pool's connections (``pooled``); a connection a caller holds (an application's
    transaction, which other threads of the application may share) gets a new cursor."""
    if not pooled or type(c) is not psycopg.Connection:
        return c.execute(query, params)
    cursor = _cursors.get(c)
    if cursor is None or cursor.closed:
        cursor = _cursors[c] = c.cursor()
    return cursor.execute(query, params)


#: What a worker's statement on a running job's row says when another transaction held the
#: row for all of its wait (:meth:`StoreBase._row_wait`), ``{}`` naming what waited.
BUSY_ROW = (
    "{} waited: a transaction other than a complete_in() block's locks the job's row (the "
    "worker holds that row while the job runs); nothing was written"
)


class StoreBase:
    """The job-store API's plumbing over one schema (see :class:`~.store.JobStore`)."""

    def __init__(self, pool: ProcessPool, schema: str, *, events: bool = True) -> None:
        self.pool = pool
        self.schema = schema
        self.events = events
        self.queries = Queries(schema)
        self.history = HistoryProbe(schema)

    # -- plumbing ------------------------------------------------------------------------

    def _fetch(self, name: str, params: dict[str, Any], conn=None) -> list[tuple]:
        params.setdefault("now", None)
        params.setdefault("events", self.events)
        with self.pool.use(conn) as c:
            return _execute(c, self.queries[name], params, conn is None).fetchall()

    @contextlib.contextmanager
    def _row_wait(
        self, job_id: str, lock_wait: float, busy: str, conn=None
    ) -> Iterator[psycopg.Connection]:
        """A connection (``conn``, or a pooled one) whose statements, in one transaction,
        wait at most ``lock_wait`` seconds for a lock. A wait that runs out rolls the
        transaction back and raises :class:`~.errors.JobBusy`: ``job <id>'s row is held
        by <whom> for the <n>s <busy>``, ``busy`` saying what waited and what it means."""
        ms = max(1, int(lock_wait * 1000))
        with self.pool.use(conn) as c:
            try:
                with c.transaction():
                    self._fetch("set_lock_timeout", {"ms": ms}, c)
                    yield c
            except psycopg.errors.LockNotAvailable:
                whom = self._row_holder(job_id, c) or "another transaction"
                raise JobBusy(
                    job_id, f"job {job_id}'s row is held by {whom} for the {lock_wait:g}s {busy}"
                ) from None

    def _row_holder(self, job_id: str, conn) -> str | None:
        """Who holds job ``job_id``'s row, in words (its backend, state, how long its
        transaction has been open, its application_name), or None if no one is found.

        The row's ``xmax`` names the transaction that locked or wrote it last, or a
        savepoint of it; or, when several did (a lock and a write in two savepoints, two
        lockers), a MultiXact whose members are those. Each is looked for as the holder of
        its id's lock, then (a savepoint released into its transaction no longer holds
        one) as the latest transaction begun before it among those locking the jobs
        table."""
        rows = self._fetch("job_row_xmax", {"id": job_id}, conn)
        if not rows:
            return None
        xmax = rows[0][0]
        holders = self._fetch("job_row_holder", {"id": job_id, "xids": [xmax], "exact": True}, conn)
        if not holders:
            members = self._multixact_members(xmax, conn)
            if members:
                params = {"id": job_id, "xids": members, "exact": False}
                holders = self._fetch("job_row_holder", params, conn)
        if not holders:
            params = {"id": job_id, "xids": [xmax], "exact": False}
            holders = self._fetch("job_row_holder", params, conn)
        if not holders:
            return None
        pid, state, seconds, application = holders[0]
        return (
            f"the transaction of backend {pid} ({state}, open for {seconds or 0:.1f}s, "
            f"application {application or ''!r})"
        )

    def _multixact_members(self, xmax: str, conn) -> list[str]:
        """The transaction ids of the MultiXact ``xmax``, or none if it is not one
        (PostgreSQL refuses the id then)."""
        try:
            with conn.transaction():
                rows = self._fetch("multixact_members", {"xmax": xmax}, conn)
        except psycopg.errors.DatabaseError:
            return []
        return [row[0] for row in rows]

    @staticmethod
    def _attempt_params(attempts: Sequence[Attempt]) -> dict[str, Any]:
        # In id order, so that two statements updating overlapping rows (the heartbeat and
        # the outcome writer) lock them in the same order and do not deadlock.
        attempts = sorted(attempts, key=lambda a: a.id)
        return {
            "ids": [a.id for a in attempts],
            "owners": [a.owner for a in attempts],
            "attempts": [a.attempt for a in attempts],
        }

    def channel(self, queue_name: str) -> str:
        return channel_name(self.schema, queue_name)

    def server_now(self, *, conn=None) -> dt.datetime:
        """The database server's clock (``now()``)."""
        return self._fetch("server_now", {}, conn)[0][0]

    def _notify(self, queue_names, conn=None) -> None:
        """Wake the consumers of these queues, in one statement."""
        if not queue_names:
            return
        channels = sorted({self.channel(queue_name) for queue_name in queue_names})
        with self.pool.use(conn) as c:
            c.execute(self.queries["notify_queues"], {"channels": channels})

    def wake_queues(self, queue_names) -> None:
        """Wake the consumers of these queues now, in a transaction of their own whose
        commit does not wait for the WAL flush (the send path's notifier, see
        :mod:`~..sending.notifier`): one statement on a pooled connection."""
        if not queue_names:
            return
        channels = sorted({self.channel(queue_name) for queue_name in queue_names})
        with self.pool.use() as c:
            _execute(c, self.queries["wake_queues"], {"channels": channels}, True)
