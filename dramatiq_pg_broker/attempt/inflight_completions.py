"""The ledger's side of ``complete_in`` and of operator aborts (a part of
:class:`.inflight.Ledger`)."""

from __future__ import annotations

import logging
from typing import Any

from dramatiq.middleware.threading import raise_thread_exception

from ..errors import JobAborted
from ..jobs.rows import Attempt
from .states import HEARTBEAT_WAIT_SECONDS, Completion, State

logger = logging.getLogger("dramatiq_pg_broker.inflight")


class CompletionBook:
    """Completions in the application's transaction, and aborts."""

    # -- success in the application's transaction ----------------------------------------

    def completing(self, attempt: Attempt) -> bool:
        """An actor's ``complete_in()`` block is about to write its attempt's success in
        the application's transaction (:mod:`.completion`). From now until that
        transaction is known to have ended, the heartbeat neither renews the lease nor
        writes the start: the statement holds the row's lock until the application's
        transaction ends, and either would wait for it. Returns False (the block raises
        ``LostOwnership``) if the attempt is not this process's running one any more: lost,
        aborted, or completed by an earlier block."""
        self._check_fork()
        with self._lock:
            entry = self._get(attempt, State.STARTED)
            if entry is None or entry.abort_requested or entry.completion is not None:
                return False
            entry.completion = Completion.PENDING
            entry.renew_before, entry.renew = entry.renew, False
            # A heartbeat statement that took the attempt before it was marked is let
            # finish first (one round trip): taken after it, the row's lock would make it
            # wait for the application's transaction.
            self._heartbeat_done.wait_for(
                lambda: not self._heartbeat_writing[attempt.id], HEARTBEAT_WAIT_SECONDS
            )
            entry = self._get(attempt, State.STARTED)
            if entry is None or entry.completion is not Completion.PENDING:
                return False  # the renewal found the attempt lost
            return True

    def pin_completion(self, attempt: Attempt) -> Any | None:
        """A ``complete_in()`` block begins in a REPEATABLE READ or SERIALIZABLE
        transaction: from now on, as after :meth:`completing`, the heartbeat leaves the
        attempt alone, and its row is written once more first (its start and a renewed
        lease, :meth:`~.JobStore.pin_completion`), so that a snapshot the transaction
        takes from here on sees the row's latest version, which no one but an operator's
        abort writes until the transaction ends. Returns the mark of that version, or
        None (nothing pinned) if the attempt is not this process's running one any more,
        or its abort was requested.

        Raises:
          dramatiq.errors.ConnectionError: the database is unreachable (nothing pinned).
        """
        if not self.completing(attempt):
            return None
        try:
            pinned = self.store.pin_completion(attempt, self.settings.lease_seconds)
        except BaseException:
            self.completion_undone(attempt)
            raise
        if pinned is None or pinned[1]:
            self.completion_undone(attempt)
            return None
        with self._lock:
            entry = self._get(attempt, State.STARTED)
            if entry is not None:
                entry.start_recorded = True
        return pinned[0]

    def completion_written(self, attempt: Attempt, xid: str) -> None:
        """The success is written in the application's transaction ``xid`` (not committed
        yet)."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            if entry is not None and entry.attempt == attempt:
                entry.completion_xid = xid

    def completion_committed(self, attempt: Attempt) -> None:
        """The block committed the transaction it began: the job succeeded."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            if entry is not None and entry.attempt == attempt and entry.completion is not None:
                entry.completion = Completion.COMMITTED
                if entry.state is State.RESCHEDULING:
                    entry.state, entry.retry = State.STARTED, None

    def completion_undone(self, attempt: Attempt) -> None:
        """Nothing of the block's success stands (it was not written, or its transaction
        rolled back): the attempt goes on as any other, its lease renewed again."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            if entry is not None and entry.attempt == attempt and entry.completion is not None:
                entry.completion = None
                entry.completion_xid = None
                entry.renew = entry.renew_before

    def succeeded_in_transaction(self, attempt: Attempt) -> bool:
        """Whether the attempt's success committed with the application's transaction (a
        ``complete_in()`` block): asked when its actor raised, before any middleware
        learns of it. A transaction still pending is looked up first
        (:meth:`resolve_completion`)."""
        self.resolve_completion(attempt)
        with self._lock:
            entry = self._entries.get(attempt.id)
            return (
                entry is not None
                and entry.attempt == attempt
                and entry.completion is Completion.COMMITTED
            )

    def resolve_completion(self, attempt: Attempt) -> None:
        """The actor returned (or raised): learn how the transaction that holds a pending
        success ended, before Dramatiq's ack or nack is settled. One read, run only for an
        attempt whose block joined a transaction (or whose commit raised):

        - committed, and the row gone: the job succeeded (the ack writes nothing);
        - rolled back (or the row still this attempt's): the usual outcome is written;
        - still in progress (the actor returned with its transaction open): the attempt
          is let go with no outcome and no renewal. The transaction decides: a commit
          succeeds the job, a rollback leaves it to its lease (it runs again).
        """
        with self._lock:
            entry = self._entries.get(attempt.id)
            if entry is None or entry.attempt != attempt:
                return
            if entry.completion is not Completion.PENDING:
                return
            xid = entry.completion_xid
        if xid is None:
            self.completion_undone(attempt)
            return
        try:
            status, running = self.store.completion_status(attempt, xid)
        except Exception as e:
            # The guarded outcome then settles it: a committed success leaves no row.
            logger.debug("Could not read how job %s's transaction ended: %s", attempt.id, e)
            self.completion_undone(attempt)
            return
        if status == "committed" and not running:
            self.completion_committed(attempt)
        elif status == "in progress":
            logger.warning(
                "Job %s attempt %d: the transaction of its complete_in() block is still open "
                "after its actor returned; its commit will succeed the job, a rollback "
                "leaves it to its lease (it runs again).",
                attempt.id,
                attempt.attempt,
            )
            with self._lock:
                entry = self._entries.get(attempt.id)
                if entry is not None and entry.attempt == attempt:
                    self._finish(entry)
        else:
            self.completion_undone(attempt)

    def abort(self, job_id: str) -> bool:
        """An operator asked for the abort of job ``job_id``: stop this process's attempt of
        it, if it holds one that is claimed or running (see the module docstring). The
        attempt's outcome becomes ``abort``, written by the outcome writer (the job ends
        ``cancelled``, never retried nor run again): at once for an attempt whose actor is
        not running; for one whose actor runs, ``JobAborted`` is raised in its thread and
        the outcome is written when the thread leaves the actor (its ack or nack, see
        :meth:`settle`), so that the job stays ``running``, its lease renewed and its place
        under a queue limit kept, while the thread may still be in a call no exception can
        interrupt. A running actor declared ``interrupt_on_abort=False`` is only flagged.
        Returns True if this process held such an attempt; a second request for the same
        attempt changes nothing."""
        self._check_fork()
        with self._lock:
            entry = self._entries.get(str(job_id))
            if entry is None or entry.state not in (State.CLAIMED, State.STARTED):
                return False
            if entry.completion is Completion.COMMITTED:
                return False  # it succeeded
            if entry.abort_requested:
                return True
            entry.abort_requested = True
            attempt = entry.attempt
            if entry.completion is Completion.PENDING:
                # The application's transaction holds the row (a complete_in() block): an
                # outcome written now would wait for it. The actor is stopped; how that
                # transaction ends decides (resolve_completion): committed, the job
                # succeeded; not, the actor's exception is written as the abort.
                if entry.thread is not None and entry.interrupt:
                    raise_thread_exception(entry.thread, JobAborted)
                logger.warning(
                    "Abort requested for job %s attempt %d while the transaction of its "
                    "complete_in() block holds its row: it ends cancelled unless that "
                    "transaction commits.",
                    attempt.id,
                    attempt.attempt,
                )
                return True
            if entry.state is State.STARTED and not entry.interrupt:
                logger.warning(
                    "Abort requested for job %s attempt %d; its actor checks for it itself "
                    "(interrupt_on_abort=False).",
                    attempt.id,
                    attempt.attempt,
                )
                return True
            started = entry.state is State.STARTED
            thread = entry.thread
            if thread is not None:
                # Under the lock that left() takes: the thread is still in the actor. The
                # attempt stays started until it leaves: its ack or nack writes the abort.
                raise_thread_exception(thread, JobAborted)
            else:
                entry.state = State.OUTCOME_QUEUED
                entry.slot_given = entry.slots._settle()
        if thread is not None:
            logger.warning(
                "Aborting job %s attempt %d at an operator's request: its actor is "
                "interrupted, and the job ends cancelled when its thread leaves it.",
                attempt.id,
                attempt.attempt,
            )
            return True
        self._outcomes().submit("abort", attempt, None)
        logger.warning(
            "Aborted job %s attempt %d at an operator's request (%s).",
            attempt.id,
            attempt.attempt,
            "its actor was not running" if started else "it had not started",
        )
        return True

    def abort_requested(self, attempt: Attempt) -> bool:
        """Whether an abort of this attempt reached this process (while it holds it)."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            return entry is not None and entry.attempt == attempt and entry.abort_requested
