"""The ledger's side of ``complete_in`` and of operator aborts (a part of
:class:`.inflight.Ledger`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from dramatiq.errors import BrokerConnectionError
from dramatiq.middleware.threading import raise_thread_exception

from ..errors import JobAborted
from ..jobs.rows import Attempt
from .states import (
    HEARTBEAT_WAIT_SECONDS,
    RETRY_CAP_SECONDS,
    ROW_WAIT_SECONDS,
    BlockEnd,
    Completion,
    State,
    _Entry,
)

logger = logging.getLogger("dramatiq_pg_broker.inflight")


class CompletionBook:
    """Completions in the application's transaction, and aborts.

    A ``complete_in()`` block (:mod:`.completion`) marks its attempt before it writes or
    locks the job's row (:meth:`completing`, :meth:`pin_completion`) and, on every way
    out, says what it left (:meth:`completion_ended`, a :class:`~.states.BlockEnd`):
    nothing (the attempt goes on as any other: renewed again, and a block tried again in
    the same attempt may write its success), a committed success, or a success in a
    transaction that goes on or whose end it could not tell, which the transaction's id
    settles (:meth:`resolve_completion`). While the mark stands the job's row is, or may
    be, held by the application's transaction: the heartbeat leaves the attempt alone, and
    the actor's own ``renew()`` and ``progress()`` write nothing on the row
    (:meth:`holds_row`)."""

    # -- success in the application's transaction ----------------------------------------

    def completing(self, attempt: Attempt, block: object = None) -> bool:
        """An actor's ``complete_in()`` block (``block``, whose end is told by
        :meth:`completion_ended`) is about to write its attempt's success in the
        application's transaction (:mod:`.completion`). From now until the block ends
        without a success, or that transaction is known to have ended, the heartbeat
        neither renews the lease nor writes the start: the statement holds the row's lock
        until the application's transaction ends, and either would wait for it. Returns
        False (the block raises ``LostOwnership``) if the attempt is not this process's
        running one any more: lost, aborted, or completed by an earlier block (committed,
        or written in a transaction that is still open).

        Raises:
          dramatiq.errors.ConnectionError: a heartbeat statement that took the attempt
            before it was marked still runs after :data:`~.states.HEARTBEAT_WAIT_SECONDS`
            (nothing is marked; the block does not begin).
        """
        self._check_fork()
        self._settle_ended(attempt)
        with self._lock:
            entry = self._get(attempt, State.STARTED)
            if entry is None or entry.abort_requested or entry.completion is not None:
                return False
            entry.completion = Completion.PENDING
            entry.completion_block = block
            entry.renew_before, entry.renew = entry.renew, False
            # A heartbeat statement that took the attempt before it was marked is let
            # finish first (one round trip): taken after it, the row's lock would make it
            # wait for the application's transaction.
            done = self._heartbeat_done.wait_for(
                lambda: not self._heartbeat_writing[attempt.id], HEARTBEAT_WAIT_SECONDS
            )
            entry = self._get(attempt, State.STARTED)
            if entry is None or entry.completion is not Completion.PENDING:
                return False  # the renewal found the attempt lost
            if not done:
                self._undo(entry)
        if not done:
            raise BrokerConnectionError(
                f"job {attempt.id} attempt {attempt.attempt}: the worker's heartbeat "
                f"statement still writes its row after {HEARTBEAT_WAIT_SECONDS:g}s (the "
                "database is slow to answer): the complete_in() block does not begin, "
                "since its transaction would hold the row that statement waits for"
            )
        return True

    def pin_completion(self, attempt: Attempt, block: object = None) -> Any | None:
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
          JobBusy: a transaction the worker does not know of (the application's own lock
            on the job's row) held the row for :data:`~.states.ROW_WAIT_SECONDS`.
        """
        if not self.completing(attempt, block):
            return None
        try:
            pinned = self.store.pin_completion(
                attempt, self.settings.lease_seconds, lock_wait=ROW_WAIT_SECONDS
            )
        except BaseException:
            self.completion_ended(attempt, block, BlockEnd.NOT_WRITTEN)
            raise
        if pinned is None or pinned[1]:
            self.completion_ended(attempt, block, BlockEnd.NOT_WRITTEN)
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

    def completion_ended(self, attempt: Attempt, block: object, how: BlockEnd) -> None:
        """The block ``block`` ended, leaving ``how`` (see :class:`~.states.BlockEnd`):

        - ``NOT_WRITTEN``: the attempt goes on as any other; if the block had marked it,
          its lease is renewed again at once (the row was left alone meanwhile);
        - ``COMMITTED``: the job succeeded;
        - ``OPEN``: the success stands or falls with the application's transaction,
          learnt once the actor returned (:meth:`resolve_completion`);
        - ``ENDED``: the transaction's id says how it ended (read now; if it cannot be
          read, or the transaction is still open, as for ``OPEN``).

        A block that never marked the attempt (refused at once) changes nothing."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            if entry is None or entry.attempt != attempt or entry.completion_block is not block:
                return
            entry.completion_block = None
            if how is BlockEnd.NOT_WRITTEN:
                self._undo(entry)
            elif how is BlockEnd.COMMITTED:
                self._committed(entry)
        if how is BlockEnd.NOT_WRITTEN:
            self._leases().renew_soon()
        elif how is BlockEnd.ENDED:
            self._resolve(attempt, final=False)

    def completion_committed(self, attempt: Attempt) -> None:
        """The job's success committed with the application's transaction."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            if entry is not None and entry.attempt == attempt and entry.completion is not None:
                self._committed(entry)

    def completion_undone(self, attempt: Attempt) -> None:
        """Nothing of the block's success stands (it was not written, or its transaction
        rolled back): the attempt goes on as any other, its lease renewed again."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            if entry is not None and entry.attempt == attempt and entry.completion is not None:
                self._undo(entry)

    def _committed(self, entry: _Entry) -> None:
        """Call with the lock held."""
        entry.completion = Completion.COMMITTED
        if entry.state is State.RESCHEDULING:
            entry.state, entry.retry = State.STARTED, None

    def _undo(self, entry: _Entry) -> None:
        """Call with the lock held."""
        if entry.completion is None:
            return
        entry.completion = None
        entry.completion_xid = None
        entry.completion_block = None
        entry.renew = entry.renew_before

    def holds_row(self, attempt: Attempt) -> bool:
        """Whether the attempt's row is, or may be, held by the application's transaction
        of a ``complete_in()`` block (pinned by a REPEATABLE READ or SERIALIZABLE block,
        or its success written in a transaction not known to have ended): the actor's own
        ``renew()`` and ``progress()`` then write nothing on the row, which that
        transaction's lock holds for the job (a write would wait for it, in the very
        thread that holds it; or fail the block's success at those levels)."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            return (
                entry is not None
                and entry.attempt == attempt
                and entry.completion is Completion.PENDING
            )

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
        success ended, before Dramatiq's ack or nack is settled. One read (tried again
        while the database is unreachable, for up to a lease), run only for an attempt
        whose block left a success in a transaction it could not see end:

        - committed, and the row gone: the job succeeded (the ack writes nothing);
        - rolled back (or the row still this attempt's): the usual outcome is written;
        - still in progress (the actor returned with its transaction open), or not
          readable for a whole lease: the attempt is let go with no outcome and no
          renewal. The transaction decides: a commit succeeds the job, a rollback leaves
          it to its lease (it runs again).
        """
        self._resolve(attempt, final=True)

    def _settle_ended(self, attempt: Attempt) -> None:
        """Before a new block of the attempt: a success an earlier block left in a
        transaction that ended unseen (``ENDED``, unreadable then) is looked up again."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            if (
                entry is None
                or entry.attempt != attempt
                or entry.completion is not Completion.PENDING
                or entry.completion_xid is None
                or entry.completion_block is not None
            ):
                return
        self._resolve(attempt, final=False)

    def _resolve(self, attempt: Attempt, *, final: bool) -> None:
        """:meth:`resolve_completion`; ``final``: the actor returned (else a block ended,
        and a transaction still open, or a status that cannot be read now, leaves the
        success pending)."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            if entry is None or entry.attempt != attempt:
                return
            if entry.completion is not Completion.PENDING:
                return
            xid = entry.completion_xid
            if xid is None:
                # Marked, and nothing written: the block that marked it is gone.
                self._undo(entry)
                return
        patience = self.settings.lease_seconds if final else 0.0
        status = self._completion_status(attempt, xid, patience=patience)
        if status is None:
            if final:
                logger.error(
                    "Job %s attempt %d: how the transaction of its complete_in() block ended "
                    "could not be read; the job is left to its row: a committed success "
                    "stands, a rolled back one runs again once its lease expires.",
                    attempt.id,
                    attempt.attempt,
                )
                self._let_go(attempt)
            return
        state, running = status
        if state == "committed" and not running:
            self.completion_committed(attempt)
        elif state == "in progress":
            if not final:
                return
            logger.warning(
                "Job %s attempt %d: the transaction of its complete_in() block is still open "
                "after its actor returned; its commit will succeed the job, a rollback "
                "leaves it to its lease (it runs again).",
                attempt.id,
                attempt.attempt,
            )
            self._let_go(attempt)
        else:
            self.completion_undone(attempt)
            self._leases().renew_soon()

    def _completion_status(
        self, attempt: Attempt, xid: str, *, patience: float
    ) -> tuple[str, bool] | None:
        """:meth:`~.JobStore.completion_status`, tried again while the database is
        unreachable, for up to ``patience`` seconds; None if it could not be read."""
        deadline = time.monotonic() + patience
        delay = 0.05
        while True:
            try:
                return self.store.completion_status(attempt, xid)
            except Exception as e:
                if not isinstance(e, BrokerConnectionError) or time.monotonic() + delay > deadline:
                    logger.warning(
                        "Could not read how the transaction of job %s's complete_in() block "
                        "ended: %s",
                        attempt.id,
                        e,
                    )
                    return None
                time.sleep(delay)
                delay = min(delay * 2, RETRY_CAP_SECONDS)

    def _let_go(self, attempt: Attempt) -> None:
        """No outcome and no renewal for the attempt: its row decides."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            if entry is not None and entry.attempt == attempt:
                self._finish(entry)

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
