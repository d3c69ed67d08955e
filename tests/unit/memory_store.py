"""An in-memory stand-in for the job store, for unit tests of the worker side (the in-flight
ledger, the consumer's claim window, the outcome writer) without a database.

It implements the few :class:`~dramatiq_pg_broker.jobs.JobStore` methods a broker's send
path and worker side call, over rows kept in a dict, with the guards their SQL has: a
transition out of ``running`` only touches a row whose owner and attempt match the attempt
it is given, and reports the ids it changed, so a lost attempt looks lost here as it does
in PostgreSQL. Every call is recorded (:attr:`InMemoryJobStore.calls`); the next calls of a
method can be made to raise (:meth:`~InMemoryJobStore.fail_next`) or to wait
(:meth:`~InMemoryJobStore.hold`), a job's row can be refused
(:meth:`~InMemoryJobStore.refuse`) or claimed by another worker
(:meth:`~InMemoryJobStore.take_over`).

What PostgreSQL decides (locking and SKIP LOCKED, constraints, notifications, idempotency
keys, delays, the reaper's arithmetic) is not imitated: those are the integration tests'.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Sequence
from typing import Any

import psycopg

from dramatiq_pg_broker.jobs import (
    Attempt,
    Claim,
    ClaimedJob,
    EnqueueResult,
    NewJob,
    ReapResult,
    Renewal,
)


@dataclasses.dataclass
class Row:
    """One job, with the columns the worker side reads or changes."""

    id: str
    queue_name: str
    message: Any
    message_bytes: bytes | None
    priority: int
    max_attempts: int
    order: int
    status: str = "queued"
    attempts: int = 0
    owner: str | None = None
    #: The current attempt's start is recorded (it is charged).
    started: bool = False
    failures: int = 0
    abandoned_claims: int = 0
    abort_requested: bool = False
    last_error: str | None = None
    #: Who skipped the message and why, for a job a skip cancelled.
    skip: dict | None = None

    def owned_by(self, attempt: Attempt) -> bool:
        return (
            self.status == "running"
            and self.owner == attempt.owner
            and self.attempts == attempt.attempt
        )


class InMemoryJobStore:
    """Job rows in a dict, changed as the store's statements change them. See the module
    docstring. Thread-safe: the outcome writer and the heartbeat call it from their own
    threads."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}
        #: Every call of a store method: (method name, the job ids it was given).
        self.calls: list[tuple[str, list[str]]] = []
        #: The queues the send path's notifier woke (see :meth:`wake_queues`).
        self.woken: list[set[str]] = []
        #: Every claim: (the most it asked for, how many it claimed).
        self.claims: list[tuple[int, int]] = []
        #: Queues an operator paused: their claims claim nothing.
        self.paused: set[str] = set()
        self._lock = threading.RLock()
        self._order = itertools.count()
        self._errors: dict[str, list[BaseException]] = {}
        self._gates: dict[str, threading.Event] = {}
        self._refused: set[str] = set()
        #: The applications' transactions a success was written in: xid -> (job id,
        #: its state as pg_xact_status says it).
        self._transactions: dict[str, tuple[str, str]] = {}

    # -- for tests ---------------------------------------------------------------------

    def add(self, job: NewJob, **columns: Any) -> str:
        """Store ``job`` as a queued row (``columns``: ``failures``, ``abandoned_claims``,
        ``abort_requested`` ...); returns its id."""
        with self._lock:
            self.rows[job.id] = Row(
                id=job.id,
                queue_name=job.queue_name,
                message=job.message,
                message_bytes=job.message_bytes,
                priority=job.priority,
                max_attempts=job.max_attempts,
                order=next(self._order),
                **columns,
            )
        return job.id

    def fail_next(self, method: str, *errors: BaseException) -> None:
        """The next ``len(errors)`` calls of ``method`` raise these errors, in order."""
        with self._lock:
            self._errors.setdefault(method, []).extend(errors)

    def hold(self, method: str) -> threading.Event:
        """Calls of ``method`` wait (30 s at most) until the returned event is set."""
        gate = self._gates[method] = threading.Event()
        return gate

    def called(self, method: str) -> list[list[str]]:
        """The job ids each call of ``method`` was given, call by call."""
        with self._lock:
            return [ids for name, ids in self.calls if name == method]

    def status(self, job_id: str) -> str:
        return self.rows[job_id].status

    def request_abort(self, job_id: str) -> None:
        """An operator asked for the job's abort (what ``JobStore.abort`` records)."""
        with self._lock:
            self.rows[job_id].abort_requested = True

    def refuse(self, job_id: str) -> None:
        """Every statement that touches the job fails as a row the server refuses would."""
        with self._lock:
            self._refused.add(job_id)

    def take_over(self, job_id: str, owner: str = "another-worker") -> None:
        """The job's lease expired and another worker claimed it."""
        with self._lock:
            row = self.rows[job_id]
            row.status, row.owner, row.started = "running", owner, False
            row.attempts += 1

    def _call(self, method: str, ids: list[str]) -> None:
        """Record a call (at once: a held call is already in :attr:`calls`), wait while the
        method is held, then raise what the test asked for."""
        with self._lock:
            self.calls.append((method, ids))
        gate = self._gates.get(method)
        if gate is not None:
            assert gate.wait(30), f"{method} was held for 30 s"
        with self._lock:
            errors = self._errors.get(method)
            if errors:
                raise errors.pop(0)
            refused = self._refused.intersection(ids)
        if refused:
            raise psycopg.errors.CheckViolation(f"the row of job {min(refused)} is refused")

    def _owned(self, attempts: Sequence[Attempt]) -> list[Row]:
        rows = (self.rows.get(a.id) for a in attempts)
        return [r for r, a in zip(rows, attempts) if r is not None and r.owned_by(a)]

    # -- sending -----------------------------------------------------------------------

    def channel(self, queue_name: str) -> str:
        return f"memory.{queue_name}"

    def enqueue(
        self, job: NewJob, *, conn=None, now=None, again: bool = True, notify: bool = True
    ) -> EnqueueResult:
        """A new id is stored; a known one is returned as it is (re-enqueues are the
        integration tests')."""
        self._call("enqueue", [job.id])
        with self._lock:
            row = self.rows.get(job.id)
            if row is not None:
                return EnqueueResult(row.id, False, row.status, row.message, row.message_bytes)
            self.add(job)
        return EnqueueResult(job.id, True, "queued", job.message, job.message_bytes)

    def send_many(
        self, sends: Sequence[tuple[NewJob, bool]], *, notify: bool = True
    ) -> list[EnqueueResult]:
        return [self.enqueue(job, again=again) for job, again in sends]

    def wake_queues(self, queue_names) -> None:
        """Nothing listens here: the queues are recorded."""
        self.woken.append(set(queue_names))

    # -- claiming ----------------------------------------------------------------------

    def claim_or_wait(
        self, queue_name: str, limit: int, owner: str, lease_seconds: float, **_: Any
    ) -> Claim:
        """Up to ``limit`` queued rows of the queue, in priority then send order."""
        self._call("claim_or_wait", [])
        with self._lock:
            if queue_name in self.paused:
                self.claims.append((limit, 0))
                return Claim([], paused=True)
            queued = [r for r in self.rows.values() if r.queue_name == queue_name]
            queued = [r for r in queued if r.status == "queued"]
            waiting = sorted(queued, key=lambda r: (r.priority, r.order))[:limit]
            claimed = []
            for row in waiting:
                row.status, row.owner, row.started = "running", owner, False
                row.attempts += 1
                claimed.append(
                    ClaimedJob(
                        row.id,
                        row.priority,
                        row.attempts,
                        row.max_attempts,
                        row.message,
                        row.message_bytes,
                        failures=row.failures,
                        abandoned_claims=row.abandoned_claims,
                        abort_requested=row.abort_requested,
                    )
                )
            self.claims.append((limit, len(claimed)))
        if claimed:
            return Claim(claimed)
        return Claim([], lease_seconds_left=math.inf)

    def claim(self, queue_name: str, limit: int, owner: str, lease_seconds: float, **_: Any):
        return self.claim_or_wait(queue_name, limit, owner, lease_seconds).jobs

    def queue_limits(self, **_: Any) -> dict[str, int]:
        """No queue is limited here (the limits are tested against PostgreSQL)."""
        return {}

    # -- transitions of an attempt -----------------------------------------------------

    def start(self, attempts: Sequence[Attempt], lease_seconds: float | None, **_: Any) -> set[str]:
        self._call("start", [a.id for a in attempts])
        with self._lock:
            rows = self._owned(attempts)
            for row in rows:
                row.started = True
            return {row.id for row in rows}

    def release(self, attempts: Sequence[Attempt], **_: Any) -> set[str]:
        """Claimed rows that never started go back, uncharged."""
        self._call("release", [a.id for a in attempts])
        with self._lock:
            rows = [row for row in self._owned(attempts) if not row.started]
            for row in rows:
                row.status, row.owner = "queued", None
                row.attempts -= 1
            return {row.id for row in rows}

    def complete(self, attempts: Sequence[Attempt], **_: Any) -> set[str]:
        return self._finish("complete", attempts, "succeeded")

    def fail(self, attempts: Sequence[Attempt], errors: Sequence[str | None], **_: Any) -> set[str]:
        changed = self._finish("fail", attempts, "failed")
        with self._lock:
            for attempt, error in zip(attempts, errors):
                if attempt.id in changed:
                    row = self.rows[attempt.id]
                    row.last_error = error
                    row.failures += 1
                    if row.abort_requested:  # fail_jobs ends it cancelled
                        row.status = "cancelled"
        return changed

    def finished_attempts(
        self, attempts: Sequence[Attempt], status: str | Sequence[str], **_: Any
    ) -> set[str]:
        self._call("finished_attempts", [a.id for a in attempts])
        statuses = (status,) if isinstance(status, str) else tuple(status)
        with self._lock:
            rows = ((self.rows.get(a.id), a) for a in attempts)
            return {
                r.id
                for r, a in rows
                if r is not None and r.status in statuses and r.attempts == a.attempt
            }

    def abort_attempts(self, attempts: Sequence[Attempt], **_: Any) -> set[str]:
        with self._lock:
            asked = [a for a in attempts if a.id in self.rows and self.rows[a.id].abort_requested]
        return self._finish("abort_attempts", asked, "cancelled", given=attempts)

    def cancel_skipped(
        self, attempts: Sequence[Attempt], skips: Sequence[dict], **_: Any
    ) -> set[str]:
        changed = self._finish("cancel_skipped", attempts, "cancelled")
        with self._lock:
            for attempt, skip in zip(attempts, skips):
                if attempt.id in changed:
                    self.rows[attempt.id].skip = skip
        return changed

    def _finish(
        self, method: str, attempts: Sequence[Attempt], status: str, given=None
    ) -> set[str]:
        self._call(method, [a.id for a in (attempts if given is None else given)])
        with self._lock:
            rows = self._owned(attempts)
            for row in rows:
                row.status, row.owner = status, None
            return {row.id for row in rows}

    def reschedule(self, attempt: Attempt, queue_name: str, delay_ms: int, error, **_: Any) -> bool:
        """A retry: the row is queued again, the attempt stays charged."""
        self._call("reschedule", [attempt.id])
        with self._lock:
            rows = self._owned([attempt])
            for row in rows:
                row.status, row.owner, row.last_error = "queued", None, error
                row.failures += 1
            return bool(rows)

    # -- leases ------------------------------------------------------------------------

    def renew_leases(self, attempts: Sequence[Attempt], lease_seconds: float, **_: Any) -> Renewal:
        self._call("renew_leases", [a.id for a in attempts])
        with self._lock:
            rows = self._owned(attempts)
            return Renewal({r.id for r in rows}, {r.id for r in rows if r.abort_requested})

    def renew(self, attempts: Sequence[Attempt], lease_seconds: float, **options: Any) -> set[str]:
        return self.renew_leases(attempts, lease_seconds).owned

    def progress(self, attempt: Attempt, data: Any, lease_seconds: float, **_: Any) -> bool:
        self._call("progress", [attempt.id])
        with self._lock:
            return bool(self._owned([attempt]))

    def progress_event(self, attempt: Attempt, data: Any, **_: Any) -> bool:
        self._call("progress_event", [attempt.id])
        with self._lock:
            return bool(self._owned([attempt]))

    # -- complete_in -------------------------------------------------------------------

    def complete_in_transaction(self, attempt: Attempt, conn: Any, **_: Any) -> str | None:
        """The success written in an application's transaction, as the ledger sees it: the
        id of that transaction (see :meth:`end_transaction`), or None for a lost attempt."""
        self._call("complete_in_transaction", [attempt.id])
        with self._lock:
            if not self._owned([attempt]) or self.rows[attempt.id].abort_requested:
                return None
            xid = str(next(self._order) + 1000)
            self._transactions[xid] = (attempt.id, "in progress")
            return xid

    def pin_completion(self, attempt: Attempt, lease_seconds: float, **_: Any) -> tuple | None:
        """The start recorded and the lease renewed before a pinned block: the version's
        mark (a number here) and whether an abort was requested; None for a lost one."""
        self._call("pin_completion", [attempt.id])
        with self._lock:
            if not self._owned([attempt]):
                return None
            row = self.rows[attempt.id]
            row.started = True
            return next(self._order), row.abort_requested

    def end_transaction(self, xid: str, committed: bool) -> None:
        """The application's transaction ``xid`` commits (its job succeeds) or rolls back."""
        with self._lock:
            job_id, _ = self._transactions[xid]
            self._transactions[xid] = (job_id, "committed" if committed else "aborted")
            if committed:
                self.rows[job_id].status, self.rows[job_id].owner = "succeeded", None

    def completion_status(self, attempt: Attempt, xid: str, **_: Any) -> tuple[str, bool]:
        self._call("completion_status", [attempt.id])
        with self._lock:
            _, status = self._transactions[xid]
            return status, bool(self._owned([attempt]))

    def refresh_statistics(self, **_: Any) -> list[str]:
        """No planner here: nothing to analyze (the call is recorded)."""
        self._call("refresh_statistics", [])
        return []

    def reap(self, **_: Any) -> ReapResult:
        """No lease expires here: the reaper finds nothing."""
        return ReapResult([], [])
