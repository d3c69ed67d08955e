"""Claims and the running attempt's own transitions: claim (limited or not), start,
renew, progress, and the reaper."""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ..db.core import read_committed
from ..db.queries import statements_for
from .base import BUSY_ROW, StoreBase
from .rows import (
    LEASE_EXPIRED,
    Attempt,
    Claim,
    ClaimedJob,
    ReapedJob,
    ReapResult,
    Renewal,
    _claim_of,
    _ms,
    clean_text,
)

#: How many times a claim statement of its own runs when it meets a serialization failure
#: (a database whose default isolation is stricter than READ COMMITTED: see
#: :meth:`Claims._claim_rows`).
CLAIM_TRIES = 5

#: The statements of limits.sql for a schema (loaded once per process, shared).
_limit_queries = functools.partial(statements_for, filename="limits.sql")


class Claims(StoreBase):
    """Claims and the running attempt's transitions (a part of :class:`~.store.JobStore`)."""

    def claim(
        self,
        queue_name: str,
        limit: int,
        owner: str,
        lease_seconds: float,
        *,
        conn: psycopg.Connection | None = None,
        now: dt.datetime | None = None,
    ) -> list[ClaimedJob]:
        """queued -> running for up to ``limit`` runnable jobs of a queue, in claim order
        (priority, available_at, created_at, id). Each gets ``attempts + 1``, the owner and
        a lease, and a ``claimed`` event."""
        return self.claim_or_wait(queue_name, limit, owner, lease_seconds, conn=conn, now=now).jobs

    def claim_or_wait(
        self,
        queue_name: str,
        limit: int,
        owner: str,
        lease_seconds: float,
        *,
        conn: psycopg.Connection | None = None,
        now: dt.datetime | None = None,
    ) -> Claim:
        """:meth:`claim`, and when it claims nothing, when the queue's earliest waiting job
        becomes runnable, in the same statement (an idle poll is one round trip)."""
        return _claim_of(self._claim_rows(queue_name, limit, owner, lease_seconds, now, conn))

    def _claim_rows(self, queue_name, limit, owner, lease_seconds, now, conn) -> list[tuple]:
        """The plain claim statement, limited or not: its rows.

        On a database whose default isolation is REPEATABLE READ or SERIALIZABLE
        (``default_transaction_isolation``), the statement alone is a transaction at that
        level: a row its snapshot saw as runnable, which a racing claim took and committed
        meanwhile, is a serialization failure where READ COMMITTED would have skipped it.
        Nothing was written; the statement of its own (no ``conn``) runs again with a new
        snapshot, up to :data:`CLAIM_TRIES` times. At READ COMMITTED it never fails so."""
        params = {"queue_name": queue_name, "limit": limit, "owner": owner, "now": now}
        params["lease_ms"] = _ms(lease_seconds)
        for _ in range(CLAIM_TRIES - 1 if conn is None else 0):
            try:
                return self._fetch("claim_jobs", params)
            except psycopg.errors.SerializationFailure:
                pass  # nothing was written: again, with a new snapshot
        return self._fetch("claim_jobs", params, conn)

    def claim_limited(
        self,
        queue_name: str,
        limit: int,
        owner: str,
        lease_seconds: float,
        *,
        conn: psycopg.Connection | None = None,
        now: dt.datetime | None = None,
    ) -> Claim:
        """:meth:`claim_or_wait` for a queue with a limit (see :mod:`.limits`): at most
        ``limit`` jobs, and never so many that more of the queue's jobs would be running
        than its limit allows, however many workers claim at once on however many hosts.

        One transaction: an advisory lock of the transaction on the queue (claims of the
        queue take turns until it commits), then the room left under the limit, read with
        a snapshot taken after the lock was granted, then the plain claim statement for at
        most that many jobs. A running job whose lease ran out (by the reaper's test, with
        ``lease_seconds`` as the whole lease the server must have been up for) takes no
        room: a crashed worker's place comes back within its lease. The returned claim
        carries the limit read (``queue_limit``; None: the queue has no limit any more and
        the claim was not bounded by one) and, when the queue was at its limit,
        ``at_limit``; a paused queue claims nothing and says ``paused`` (not ``at_limit``,
        which would have its consumers look again every few milliseconds).
        """
        queries = _limit_queries(self.schema)
        with self.pool.use(conn) as c:
            # READ COMMITTED whatever the server's default_transaction_isolation: at
            # REPEATABLE READ or SERIALIZABLE the lock's own statement would take the
            # snapshot, before its wait, and the room would be read as it was before the
            # claims the lock waited for (a serialization failure at the claim statement,
            # or too few counted).
            with read_committed(c).transaction():
                c.execute(queries["lock_limited_queue"], {"key": f"{self.schema}.{queue_name}"})
                max_running, room, paused = self._room(queue_name, lease_seconds, now, c)
                if paused:
                    return Claim([], paused=True, queue_limit=max_running)
                if max_running is not None:
                    limit = min(limit, room)
                if limit <= 0:
                    return Claim([], queue_limit=max_running, at_limit=True)
                rows = self._claim_rows(queue_name, limit, owner, lease_seconds, now, c)
        claim = _claim_of(rows)
        return dataclasses.replace(claim, queue_limit=max_running)

    def limited_room(
        self, queue_name: str, lease_seconds: float, *, conn=None, now: dt.datetime | None = None
    ) -> int:
        """How many more jobs of a limited queue may run now, by a read that takes no lock
        (a hint: :meth:`claim_limited` decides, and counts the same way). A large number
        for a queue without a limit."""
        max_running, room, _ = self._room(queue_name, lease_seconds, now, conn)
        return room if max_running is not None else 1 << 30

    def _room(self, queue_name, lease_seconds, now, conn) -> tuple[int | None, int, bool]:
        """The queue's limit (None: it has none), the room left under it, and whether
        the queue is paused."""
        params = {"queue_name": queue_name, "lease_ms": _ms(lease_seconds), "now": now}
        return self._fetch("limited_queue_room", params, conn)[0]

    def queue_limits(self, *, conn=None) -> dict[str, int]:
        """Every queue's limit, by queue name (see :mod:`.limits`)."""
        with self.pool.use(conn) as c:
            rows = c.execute(_limit_queries(self.schema)["queue_limits"]).fetchall()
        return {row[0]: row[1] for row in rows}

    def next_available_at(self, queue_name: str, *, conn=None) -> dt.datetime | None:
        """When the earliest waiting job of a queue becomes runnable, or None."""
        return self._peek(queue_name, conn).next_available_at

    def seconds_until_available(self, queue_name: str, *, conn=None) -> float | None:
        """Seconds, by the server's clock, until the earliest waiting job of a queue
        becomes runnable (0 or less: it is runnable now), or None if none waits."""
        return self._peek(queue_name, conn).seconds_until_available

    def _peek(self, queue_name: str, conn) -> Claim:
        # The claim statement with no room claims nothing and reports the next due time.
        return self.claim_or_wait(queue_name, 0, "", 0, conn=conn)

    def start(
        self, attempts: Sequence[Attempt], lease_seconds: float | None, *, conn=None, now=None
    ) -> set[str]:
        """Claimed attempts whose actors run or are about to: from now on each is charged as
        an attempt. With ``lease_seconds`` its lease starts afresh; with None it is left as
        it is (a cheaper, HOT update). Returns the ids still owned; a message whose id is
        missing must not run (or, already running, is no longer this worker's)."""
        if not attempts:
            return set()
        lease_ms = None if lease_seconds is None else _ms(lease_seconds)
        params = {**self._attempt_params(attempts), "lease_ms": lease_ms, "now": now}
        return {str(r[0]) for r in self._fetch("start_jobs", params, conn)}

    def renew(
        self,
        attempts: Sequence[Attempt],
        lease_seconds: float,
        *,
        record: bool = False,
        lock_wait: float | None = None,
        conn=None,
        now=None,
    ) -> set[str]:
        """Extend the leases of attempts still owned. ``record`` writes ``lease_renewed``
        events (explicit renewals; the heartbeat renews silently). With ``lock_wait``
        (one attempt), the statement waits at most that many seconds for the row.

        Raises:
          JobBusy: with ``lock_wait``, another transaction held the row all that time.
        """
        if lock_wait is None or not attempts:
            return self.renew_leases(
                attempts, lease_seconds, record=record, conn=conn, now=now
            ).owned
        (attempt,) = attempts
        with self._row_wait(attempt.id, lock_wait, BUSY_ROW.format("renew()"), conn) as c:
            return self.renew_leases(attempts, lease_seconds, record=record, conn=c, now=now).owned

    def renew_leases(
        self,
        attempts: Sequence[Attempt],
        lease_seconds: float,
        *,
        record: bool = False,
        conn=None,
        now=None,
    ) -> Renewal:
        """:meth:`renew`, also reporting which of the attempts still owned have an abort
        requested (what the heartbeat needs when no NOTIFY reaches the worker)."""
        if not attempts:
            return Renewal(set(), set())
        params = {
            **self._attempt_params(attempts),
            "lease_ms": _ms(lease_seconds),
            "record": record,
            "now": now,
        }
        rows = self._fetch("renew_leases", params, conn)
        return Renewal({str(r[0]) for r in rows}, {str(r[0]) for r in rows if r[1]})

    def progress(
        self,
        attempt: Attempt,
        data: Any,
        lease_seconds: float,
        *,
        lock_wait: float | None = None,
        conn=None,
        now=None,
    ) -> bool:
        """Record a ``progress`` event for a running attempt and renew its lease. Returns
        False if the attempt is no longer owned. With ``lock_wait``, the statement waits at
        most that many seconds for the row.

        Raises:
          JobBusy: with ``lock_wait``, another transaction held the row all that time.
        """
        params = {
            "id": attempt.id,
            "owner": attempt.owner,
            "attempt": attempt.attempt,
            "data": Jsonb(data),
            "lease_ms": _ms(lease_seconds),
            "now": now,
        }
        if lock_wait is None:
            return bool(self._fetch("record_progress", params, conn))
        with self._row_wait(attempt.id, lock_wait, BUSY_ROW.format("progress()"), conn) as c:
            return bool(self._fetch("record_progress", params, c))

    def progress_event(self, attempt: Attempt, data: Any, *, conn=None, now=None) -> bool:
        """Record a ``progress`` event for a running attempt without writing its row (whose
        lock a ``complete_in()`` block's transaction holds). Returns False if the attempt
        is no longer owned, as the row's last committed version says."""
        params = {"id": attempt.id, "owner": attempt.owner, "attempt": attempt.attempt}
        return bool(self._fetch("record_progress_event", {**params, "data": Jsonb(data)}, conn))

    def reap(
        self,
        *,
        batch: int,
        backoff_ms: Sequence[int],
        max_interruptions: int,
        lease_seconds: float,
        ids: Sequence[str] | None = None,
        queue_name: str | None = None,
        by: str | None = None,
        conn=None,
        now=None,
    ) -> ReapResult:
        """Give back running jobs whose lease expired, at most ``batch`` of them.

        A claim that never started is released uncharged. A started attempt was interrupted:
        the job is requeued after ``backoff_ms[interruptions - 1]`` (the last entry for
        later ones), or failed once its interruptions reach ``max_interruptions``. A job
        whose abort was requested is cancelled instead (``aborted``). A lease only counts
        as expired once the server has been up for ``lease_seconds``.

        The reaper gives neither ``ids`` nor ``queue_name`` nor ``by``; an operator's
        requeue (:meth:`~.operator.OperatorTransitions.requeue_expired`) gives them: only
        those jobs (or that queue's), and an event naming who asked, written whatever
        ``events`` says.
        """
        if not backoff_ms:
            raise ValueError("backoff_ms needs at least one delay")
        rows = self._fetch(
            "reap_expired",
            {
                "batch": batch,
                "backoff_ms": [int(ms) for ms in backoff_ms],
                "max_interruptions": max_interruptions,
                "lease_expired": LEASE_EXPIRED,
                "lease_ms": _ms(lease_seconds),
                "ids": None if ids is None else list(ids),
                "queue_name": queue_name,
                "by": clean_text(by),
                "now": now,
            },
            conn,
        )
        requeued = [str(r[0]) for r in rows if r[1] == "queued" and r[3]]
        released = [str(r[0]) for r in rows if r[1] == "queued" and not r[3]]
        failed_jobs = [
            ReapedJob(str(r[0]), r[2], r[4], r[5], r[6], r[7], r[8], r[9])
            for r in rows
            if r[1] == "failed"
        ]
        aborted = [str(r[0]) for r in rows if r[1] == "cancelled"]
        self._notify({r[2] for r in rows if r[1] == "queued"}, conn)
        return ReapResult(requeued, [j.id for j in failed_jobs], released, failed_jobs, aborted)
