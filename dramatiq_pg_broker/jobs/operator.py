"""The operator's transitions: retry failed jobs, cancel, abort, requeue jobs whose lease
expired."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

from ..config import Settings
from ..errors import DuplicateJobId, InvalidTransition
from .base import StoreBase
from .rows import ReapResult, abort_payload, clean_text

#: How long an abort waits for the job's row by default (seconds): a running job's row is
#: held for longer than a statement only by a complete_in() block's transaction.
ABORT_LOCK_WAIT = 1.0


class OperatorTransitions(StoreBase):
    """The operator's transitions (a part of :class:`~.store.JobStore`)."""

    def _raise_for(self, job_id: str, allowed: str, done: str, conn) -> None:
        """Say why an operator's transition of ``job_id`` changed nothing: the job's
        status (read with :meth:`~.reads.Reads.get`, which raises JobNotFound for no job)
        is not ``allowed``."""
        job = self.get(job_id, conn=conn)
        raise InvalidTransition(job_id, job["status"], done, allowed)

    def retry_failed(self, job_id: str, *, by: str | None = None, conn=None, now=None) -> dict:
        """failed -> queued by an operator; attempts start again from zero.

        Raises:
          JobNotFound: no job has this id.
          InvalidTransition: the job is not failed.
          DuplicateJobId: the job's id has a second row (see :meth:`retry_all_failed`).
        """
        rows = self._retry_failed({"ids": [job_id], "limit": 1, "by": by, "now": now}, conn)
        if not rows:
            self._raise_for(job_id, "failed", "retried", conn)
        if rows[0][3]:
            raise DuplicateJobId(job_id)
        return self.get(job_id, conn=conn)

    def retry_all_failed(
        self,
        *,
        queue_name: str | None = None,
        by: str | None = None,
        batch: int = 1000,
        now: dt.datetime | None = None,
        skipped: list[str] | None = None,
    ) -> Iterator[list[str]]:
        """failed -> queued by an operator for every job (of ``queue_name`` when given) that
        failed before the call, oldest failure first, in batches of at most ``batch``: each
        batch is one statement (the transition :meth:`retry_failed` runs) and its own
        commit, so neither memory nor a transaction grows with the number of failed jobs.
        A job that fails again while the batches run is not retried a second time.

        A failed job whose id has another row (queued or running in jobs, or a second row
        in history, which earlier releases could leave when a message was sent again while
        its job finished) is skipped: moving it back would give the id two rows in jobs.
        Its id is appended to ``skipped`` when a list is given (the operator's to sort
        out, see :class:`~dramatiq_pg_broker.errors.DuplicateJobId`).

        Yields:
          list[str]: the ids each batch retried, once it is committed.
        """
        failed_before = now if now is not None else self.server_now()
        after: tuple[Any, Any] = (None, None)
        reported: set[str] = set()
        while True:
            params = {
                "queue_name": queue_name,
                "failed_before": failed_before,
                "after_finished_at": after[0],
                "after_id": after[1],
                "limit": batch,
                "by": by,
                "now": now,
            }
            rows = self._retry_failed(params, None)
            if not rows:
                return
            after = max((r[2], r[0]) for r in rows)
            for row in rows:
                # An id twice in history is met once per row: reported once.
                if row[3] and skipped is not None and str(row[0]) not in reported:
                    reported.add(str(row[0]))
                    skipped.append(str(row[0]))
            yield [str(r[0]) for r in rows if not r[3]]

    def _retry_failed(self, params: dict[str, Any], conn) -> list[tuple]:
        """The ``retry_failed`` statement, then the wake-up of the queues it made runnable."""
        for name in ("ids", "queue_name", "failed_before", "after_finished_at", "after_id"):
            params.setdefault(name, None)
        rows = self._fetch("retry_failed", params, conn)
        self._notify({r[1] for r in rows if not r[3]}, conn)
        return rows

    def cancel(self, job_id: str, *, by: str | None = None, conn=None, now=None) -> dict:
        """queued -> cancelled by an operator.

        Raises:
          JobNotFound: no job has this id.
          InvalidTransition: the job is not queued.
        """
        if not self._fetch("cancel_job", {"id": job_id, "by": by, "now": now}, conn):
            self._raise_for(job_id, "queued", "cancelled", conn)
        return self.get(job_id, conn=conn)

    def abort(
        self,
        job_id: str,
        *,
        by: str | None = None,
        lock_wait: float = ABORT_LOCK_WAIT,
        conn=None,
        now=None,
    ) -> dict:
        """An operator aborts a job.

        - queued (delayed included) -> cancelled at once, with an ``aborted`` event;
        - running: the attempt is marked (``abort_requested_at``, ``abort_requested_by``;
          a second request keeps the first one's) with an ``abort_requested`` event, and the
          worker holding it is told (a NOTIFY on the job's queue, delivered at commit; its
          lease heartbeat tells it too when no NOTIFY can reach it). The worker interrupts
          the actor and, once its thread has left the actor, ends the job ``cancelled``
          with an ``aborted`` event (see :meth:`abort_attempts`); the job is never retried
          nor run again. A worker that
          died with it lets the reaper cancel it once its lease expires.

        The request waits at most ``lock_wait`` seconds for the job's row. The one thing
        that holds a running job's row for longer than a statement is the application's
        transaction of a ``complete_in()`` block that wrote the job's success (it commits
        the job's success, or rolls it back, when that transaction ends); past the wait,
        the request changes nothing and says who holds the row (:class:`JobBusy`).

        Parameters:
          job_id(str): the job (the Dramatiq message id).
          by(str): who asks, as the events and the row record it (default ``unknown``).
          lock_wait(float): the longest wait for the job's row, in seconds.

        Returns:
          dict: the job as :meth:`get` returns it, right after the request (``cancelled``,
          or still ``running`` with the request recorded).

        Raises:
          JobNotFound: no job has this id.
          InvalidTransition: the job has finished (succeeded, failed or cancelled).
          JobBusy: another transaction held the job's row for all of ``lock_wait``.
        """
        by = clean_text(by) or "unknown"
        busy = (
            "the request waited: the transaction of the job's complete_in() block, which "
            "wrote the job's success, holds it until it ends (if it commits, the job has "
            "succeeded; if it rolls back, the job goes on as before and can be aborted): "
            "nothing was changed"
        )
        with self._row_wait(job_id, lock_wait, busy, conn) as c:
            rows = self._fetch("abort_job", {"id": job_id, "by": by, "now": now}, c)
            if not rows:
                self._raise_for(job_id, "queued or running", "aborted", c)
            _, status, queue_name = rows[0]
            if status == "running":
                c.execute(
                    self.queries["notify_abort"],
                    {"channel": self.channel(queue_name), "payload": abort_payload(job_id)},
                )
            return self.get(job_id, conn=c)

    def requeue_expired(
        self,
        job_id: str | None = None,
        *,
        settings: Settings,
        queue_name: str | None = None,
        by: str | None = None,
        conn=None,
        now=None,
    ) -> ReapResult:
        """Put jobs whose lease expired back in their queue now, as an operator: the one
        job ``job_id``, or every such job (of ``queue_name`` when given).

        It is the reaper's own transition (:meth:`~.claims.Claims.reap`, the statement
        ``reap_expired``) on the chosen rows, runnable at once instead of after a backoff:
        only a row whose lease has expired is taken (a worker that is alive renews its
        lease first, so this cannot race it), an unstarted claim goes back uncharged, an
        interrupted attempt counts as an interruption, a job whose interruptions reach
        ``settings.max_interruptions`` fails and one whose abort was requested is
        cancelled, as the reaper would. No failure hook of Dramatiq runs here (this
        process has no actors; a worker's reaper runs them for the jobs it fails). Each
        job's event (``timeout_requeued``, ``released``, ``failed`` or ``aborted``) names
        ``by`` and, in its data, the worker that lost it.

        Parameters:
          job_id(str): the job; None: every job whose lease expired.
          settings(Settings): its ``max_interruptions``, its ``lease_seconds`` (a lease
            counts as expired only once the server has been up a whole lease) and its
            ``reaper_batch`` (rows per statement when no job is named).
          queue_name(str): without ``job_id``: only this queue's jobs.
          by(str): who asks, as the events record it.

        Returns:
          ReapResult: what was done with each job taken.

        Raises:
          JobNotFound: no job has the id ``job_id``.
          InvalidTransition: the job's lease has not expired (it runs, or it is not
            running at all).
        """
        by = clean_text(by) or "unknown"
        params = {
            "backoff_ms": [0],
            "max_interruptions": settings.max_interruptions,
            "lease_seconds": settings.lease_seconds,
            "by": by,
            "now": now,
        }
        if job_id is not None:
            result = self.reap(batch=1, ids=[job_id], conn=conn, **params)
            if not taken(result):
                self._raise_not_expired(job_id, conn, now)
            return result
        total = ReapResult([], [], [], [], [])
        while True:
            batch = settings.reaper_batch
            result = self.reap(batch=batch, queue_name=queue_name, conn=conn, **params)
            total = ReapResult(*(a + b for a, b in zip(total, result)))
            if taken(result) < batch:
                return total

    def _raise_not_expired(self, job_id: str, conn, now) -> None:
        """Say why :meth:`requeue_expired` took nothing of ``job_id``."""
        job = self.get(job_id, conn=conn)
        if job["status"] != "running":
            raise InvalidTransition(job_id, job["status"], "requeued", "lease-expired")
        clock = now if now is not None else self.server_now(conn=conn)
        until = job["locked_until"]
        if until is not None and until < clock:
            raise InvalidTransition(
                job_id,
                f"running, its lease ended at {until.isoformat(timespec='seconds')} but the "
                "database server started less than a lease ago (its worker may still renew "
                "it)",
                "requeued yet",
                "lease-expired",
            )
        shown = "" if until is None else f" until {until.isoformat(timespec='seconds')}"
        raise InvalidTransition(
            job_id, f"running (its worker holds its lease{shown})", "requeued", "lease-expired"
        )


def taken(result: ReapResult) -> int:
    """How many jobs a run of the reaper's statement took (requeued, released, failed or
    cancelled)."""
    return len(result.requeued) + len(result.released) + len(result.failed) + len(result.aborted)
