"""The outcomes of attempts: complete, fail, reschedule (a retry), release, abort
and skip."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from .base import BUSY_ROW, StoreBase
from .rows import Attempt, clean_text


class Outcomes(StoreBase):
    """Outcomes of attempts (a part of :class:`~.store.JobStore`)."""

    def complete(self, attempts: Sequence[Attempt], *, conn=None, now=None) -> set[str]:
        """running -> succeeded. Returns the ids changed (the attempts still owned)."""
        if not attempts:
            return set()
        rows = self._fetch("complete_jobs", {**self._attempt_params(attempts), "now": now}, conn)
        return {str(r[0]) for r in rows}

    def complete_in_transaction(self, attempt: Attempt, conn, *, now=None) -> str | None:
        """running -> succeeded for one attempt, in the transaction open on ``conn`` (an
        application's connection): the job succeeds when that transaction commits. Returns
        the transaction's id (for :meth:`completion_status`), or None if the attempt is no
        longer owned (or its abort was requested)."""
        params = {"id": attempt.id, "owner": attempt.owner, "attempt": attempt.attempt}
        rows = self._fetch("complete_in_transaction", {**params, "now": now}, conn)
        return str(rows[0][1]) if rows else None

    def pin_completion(
        self,
        attempt: Attempt,
        lease_seconds: float,
        *,
        lock_wait: float | None = None,
        conn=None,
        now=None,
    ) -> tuple[Any, bool] | None:
        """Record the attempt's start and renew its lease, before a ``complete_in()``
        block's REPEATABLE READ or SERIALIZABLE transaction takes its snapshot. Returns the
        new ``locked_until`` (the mark :meth:`lock_for_completion` looks for) and whether an
        abort was requested, or None if the attempt is no longer owned. With
        ``lock_wait``, the statement waits at most that many seconds for the row.

        Raises:
          JobBusy: with ``lock_wait``, another transaction held the row all that time.
        """
        params = {
            "id": attempt.id,
            "owner": attempt.owner,
            "attempt": attempt.attempt,
            "lease_ms": int(lease_seconds * 1000),
            "now": now,
        }
        if lock_wait is None:
            rows = self._fetch("pin_completion", params, conn)
        else:
            busy = BUSY_ROW.format("the complete_in() block")
            with self._row_wait(attempt.id, lock_wait, busy, conn) as c:
                rows = self._fetch("pin_completion", params, c)
        return (rows[0][0], bool(rows[0][1])) if rows else None

    def transaction_isolation(self, conn) -> str:
        """The isolation level of the transaction open on ``conn`` (``read committed``,
        ``repeatable read``, ...), without taking its snapshot."""
        with self.pool.use(conn) as c:
            return str(c.execute(self.queries["transaction_isolation"]).fetchone()[0])

    def lock_lanes_for_completion(self, conn) -> None:
        """In the application's transaction on ``conn``, before anything in it reads: wait
        for any emptying of a lane of jobs to commit, and keep the next one out until the
        transaction ends (LOCK takes no snapshot; see the query). In a savepoint of its
        own, rolled back if the lock fails (the connection reaches another database, say):
        the caller's check of the database then says what is wrong."""
        c = conn
        c.execute("SAVEPOINT dramatiq_pg_lanes")
        try:
            c.execute(self.queries["lock_lanes_for_completion"])
        except psycopg.Error:
            c.execute("ROLLBACK TO SAVEPOINT dramatiq_pg_lanes")
        c.execute("RELEASE SAVEPOINT dramatiq_pg_lanes")

    def lock_for_completion(self, attempt: Attempt, pinned: Any, conn) -> tuple[bool, bool]:
        """In the application's transaction on ``conn``: lock the job's row (FOR KEY SHARE)
        and say whether the transaction sees the version :meth:`pin_completion` wrote
        (``pinned``), and whether that version is the attempt's with no abort requested."""
        params = {
            "id": attempt.id,
            "owner": attempt.owner,
            "attempt": attempt.attempt,
            "pinned": pinned,
        }
        rows = self._fetch("lock_for_completion", params, conn)
        return (bool(rows[0][0]), bool(rows[0][1])) if rows else (False, False)

    def completion_status(self, attempt: Attempt, xid: str, *, conn=None) -> tuple[str, bool]:
        """How the transaction ``xid`` that ran :meth:`complete_in_transaction` for
        ``attempt`` ended (``committed``, ``aborted``, ``in progress``), and whether the
        row is still that attempt's (running, owned)."""
        params = {"id": attempt.id, "owner": attempt.owner, "attempt": attempt.attempt, "xid": xid}
        status, running = self._fetch("completion_status", params, conn)[0]
        return status, bool(running)

    def fail(
        self, attempts: Sequence[Attempt], errors: Sequence[str | None], *, conn=None, now=None
    ) -> set[str]:
        """running -> failed (dead letter), keeping each attempt's error."""
        errors = [clean_text(error) for error in errors]
        return self._each_with("fail_jobs", attempts, "errors", errors, conn, now)

    def reschedule(
        self,
        attempt: Attempt,
        queue_name: str,
        delay_ms: int,
        error: str | None,
        *,
        message: dict[str, Any] | None = None,
        message_bytes: bytes | None = None,
        max_attempts: int | None = None,
        conn=None,
        now=None,
    ) -> bool:
        """running -> queued, runnable after ``delay_ms`` (a retry). The attempt stays
        charged. Passing ``message`` or ``message_bytes`` replaces the stored message;
        ``max_attempts`` (from :func:`~dramatiq_pg_broker.messages.max_attempts_for`), the
        row's limit."""
        replace = message is not None or message_bytes is not None
        rows = self._fetch(
            "reschedule_job",
            {
                "id": attempt.id,
                "owner": attempt.owner,
                "attempt": attempt.attempt,
                "delay_ms": max(0, int(delay_ms)),
                "error": clean_text(error),
                "replace_message": replace,
                "message": Jsonb(message) if message is not None else None,
                "message_bytes": message_bytes,
                "max_attempts": max_attempts,
                "channel": self.channel(queue_name),
                "now": now,
            },
            conn,
        )
        return bool(rows)

    def release(self, attempts: Sequence[Attempt], *, conn=None, now=None) -> set[str]:
        """running -> queued at once for claimed messages that never started; the attempt
        is given back and the queues' consumers are woken. Used at worker shutdown."""
        if not attempts:
            return set()
        rows = self._fetch("release_jobs", {**self._attempt_params(attempts), "now": now}, conn)
        self._notify({r[1] for r in rows}, conn)
        return {str(r[0]) for r in rows}

    def finished_attempts(
        self, attempts: Sequence[Attempt], status: str | Sequence[str], *, conn=None
    ) -> set[str]:
        """The ids of ``attempts`` whose job already ended ``status`` (or one of these
        statuses) at that attempt: the outcome an owner sent was written, though the reply
        was lost (the connection dropped as it committed), so its second try found the job
        no longer running."""
        if not attempts:
            return set()
        statuses = [status] if isinstance(status, str) else list(status)
        params = {**self._attempt_params(attempts), "statuses": statuses}
        return {str(r[0]) for r in self._fetch("finished_attempts", params, conn)}

    def abort_attempts(self, attempts: Sequence[Attempt], *, conn=None, now=None) -> set[str]:
        """running -> cancelled for attempts a worker stopped because their abort was
        requested (an ``aborted`` event each). Returns the ids changed: an attempt missing
        is no longer the caller's (or had no abort requested)."""
        if not attempts:
            return set()
        rows = self._fetch("abort_attempts", {**self._attempt_params(attempts), "now": now}, conn)
        return {str(r[0]) for r in rows}

    def cancel_skipped(
        self, attempts: Sequence[Attempt], skips: Sequence[dict[str, Any]], *, conn=None, now=None
    ) -> set[str]:
        """running -> cancelled for attempts whose message a middleware skipped without
        failing it (a ``cancelled`` event each, whose data is the attempt's skip:
        ``reason``, ``skipped_by``, ``message``). Returns the ids changed: an attempt
        missing is no longer the caller's."""
        skips = [Jsonb(skip) for skip in skips]
        return self._each_with("cancel_skipped", attempts, "skips", skips, conn, now)

    def _each_with(
        self, name: str, attempts: Sequence[Attempt], key: str, values: list, conn, now
    ) -> set[str]:
        """Statement ``name`` over attempts that each carry a value (parameter ``key``),
        in id order like every ownership guard; the ids it changed."""
        if not attempts:
            return set()
        pairs = sorted(zip(attempts, values), key=lambda pair: pair[0].id)
        params = {
            **self._attempt_params([attempt for attempt, _ in pairs]),
            key: [value for _, value in pairs],
            "now": now,
        }
        return {str(r[0]) for r in self._fetch(name, params, conn)}
