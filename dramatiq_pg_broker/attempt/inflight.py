"""The in-flight ledger: every attempt this worker process holds, and the one place where
an attempt moves from one state to the next.

::

    claimed ──start──> started ──settle──> outcome queued ──written──> done
       │                  │ └──reschedule──> rescheduling ──settle (the retry written)──> done
       └──release─────────┴──lost (the heartbeat found another owner)──> done

- *claimed*: the row is ``running`` for this process, the message waits in the worker. It
  is not an attempt yet: giving it back costs the job nothing.
- *started*: its actor is about to run or runs. The database learns it (``start_jobs``)
  :data:`START_RECORD_DELAY` after the actor began, in one statement with the other starts
  of that moment, unless the outcome came first: most short jobs never pay for a start of
  their own. From then on a worker that dies has interrupted an attempt. The start is
  written *before* the actor runs when the claim's lease is not surely held any more (the
  heartbeat fell behind), for ``heartbeat=False`` actors, and for a job with an abandoned
  claim (a lease that expired with no start recorded): a message that kills its process as
  soon as it starts is thus charged from its second claim on.
- *outcome queued*: Dramatiq acked or nacked it; the :class:`~.outcomes.OutcomeWriter`
  writes it in a batch.
- *done*: written, rescheduled, released or lost. The ledger forgets it.

An operator's abort (:meth:`Ledger.abort`, told by a NOTIFY, the lease heartbeat or a
claim) moves a claimed attempt, or a started one whose actor is not running (yet, or any
more), straight to *outcome queued* with the outcome ``abort`` (the job ends
``cancelled``). A running actor's thread gets :class:`~.errors.JobAborted` raised in it
(as Dramatiq's TimeLimit raises its exception), at its next Python instruction, and the
attempt stays *started* until the thread leaves the actor: its ack or nack is then
written as the abort. A thread blocked in a system call (``time.sleep``, a socket read)
cannot be interrupted before the call returns: meanwhile the job is still ``running``
(with its abort requested), its lease renewed, and it keeps its place under its queue's
limit, since it may still be calling what the limit protects. An actor declared
``interrupt_on_abort=False`` only sees ``current_job().abort_requested`` and stops
itself; whatever it raises then ends the job cancelled (a success stays a success).

Every attempt that is not done has its lease renewed by the heartbeat and holds a slot of
its consumer's claim window, except that a consumer's first ``window`` unwritten outcomes
give their slots back as soon as they are queued (:class:`Slots`): the next claim then
overlaps the writing of the last batch, while a slow or unreachable database still cannot
let a consumer run more than about a window ahead of what it has recorded (backpressure).
A move the state does not allow (an ack after a reschedule, a second outcome, starting a
released message) is refused here, and only here.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from dramatiq.errors import BrokerConnectionError

from .. import forks
from ..config import Settings
from ..jobs.rows import Attempt
from ..jobs.store import JobStore
from ..sending.group_commit import GroupCommit
from .inflight_completions import CompletionBook
from .inflight_heartbeat import HeartbeatBook
from .states import Completion, LeaseTimer, OutcomeSink, Slots, State, _Entry

logger = logging.getLogger("dramatiq_pg_broker.inflight")


class Ledger(HeartbeatBook, CompletionBook):
    """The attempts of one process. See the module docstring.

    Parameters:
      store(JobStore): where starts are written.
      settings(Settings): the broker's settings.

    The lease keeper and the outcome writer it hands work to are given with
    :meth:`connect` (both are built with the ledger).
    """

    def __init__(self, store: JobStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.leases: LeaseTimer | None = None
        self.outcomes: OutcomeSink | None = None
        self._lock = threading.RLock()
        #: Signalled when a heartbeat statement is done with its attempts.
        self._heartbeat_done = threading.Condition(self._lock)
        #: Ids of the attempts a heartbeat statement (renewal, starts) is writing now.
        self._heartbeat_writing: collections.Counter[str] = collections.Counter()
        self._entries: dict[str, _Entry] = {}
        self._closing = False
        #: Starts written before their actors run, group-committed (see :meth:`start`).
        self._starts = GroupCommit(self._write_starts)
        #: Attempts this process let go of without an outcome (a retry or an outcome that
        #: could not be written) whose start is not written yet: it is written still, so
        #: that the reaper counts the attempt as interrupted, not as an abandoned claim.
        self._orphans: list[Attempt] = []
        self._process = forks.PerProcess(self._enter_process, value=None)

    # -- bookkeeping ---------------------------------------------------------------------

    def connect(self, *, leases: LeaseTimer, outcomes: OutcomeSink) -> None:
        """Hand the ledger the lease keeper and the outcome writer (each holds the ledger
        too, so they are given once all three are built)."""
        self.leases = leases
        self.outcomes = outcomes

    def _leases(self) -> LeaseTimer:
        assert self.leases is not None, "Ledger.connect() was not called"
        return self.leases

    def _outcomes(self) -> OutcomeSink:
        assert self.outcomes is not None, "Ledger.connect() was not called"
        return self.outcomes

    def _enter_process(self) -> None:
        """A forked child holds none of its parent's attempts."""
        with self._lock:
            self._entries = {}
            self._orphans = []
            self._closing = False
            self._starts = GroupCommit(self._write_starts)

    def _check_fork(self) -> None:
        self._process.get()

    def _get(self, attempt: Attempt, *states: State) -> _Entry | None:
        entry = self._entries.get(attempt.id)
        if entry is None or entry.attempt != attempt or entry.state not in states:
            return None
        return entry

    def _finish(self, entry: _Entry) -> None:
        """Move an entry to done: forget it and free its slot. Call with the lock held."""
        if entry.state is State.DONE:
            return
        entry.state = State.DONE
        if self._entries.get(entry.attempt.id) is entry:
            del self._entries[entry.attempt.id]
        if entry.slot_given:
            entry.slots._written()
        else:
            entry.slots._give()

    def _refuse(self, move: str, attempt: Attempt) -> None:
        entry = self._entries.get(attempt.id)
        state = "not held" if entry is None or entry.attempt != attempt else entry.state.value
        logger.debug(
            "Refused to %s job %s attempt %d: it is %s.", move, attempt.id, attempt.attempt, state
        )

    def state_of(self, attempt: Attempt) -> State:
        """The state of an attempt (``DONE`` for one this process does not hold)."""
        self._check_fork()
        with self._lock:
            entry = self._entries.get(attempt.id)
            if entry is None or entry.attempt != attempt:
                return State.DONE
            return entry.state

    def holds(self, attempt: Attempt) -> bool:
        return self.state_of(attempt) is not State.DONE

    def __len__(self) -> int:
        return len(self._entries)

    def occupying(self) -> int:
        """Attempts that take or wait for a worker thread: claimed and not started yet
        (handed to Dramatiq, or about to be), started, or being rescheduled. A queue with a
        limit claims only what the threads left can start (see :mod:`.limits`)."""
        busy = (State.CLAIMED, State.STARTED, State.RESCHEDULING)
        with self._lock:
            return sum(1 for entry in self._entries.values() if entry.state in busy)

    # -- claiming ------------------------------------------------------------------------

    @property
    def closing(self) -> bool:
        """True once worker shutdown began: consumers claim nothing more."""
        self._check_fork()
        return self._closing

    def open(self) -> None:
        """A worker boots: claiming is allowed (again)."""
        self._check_fork()
        self._closing = False

    def slots(self, prefetch: int) -> Slots:
        """Prefetch slots for a new consumer."""
        return Slots(max(1, prefetch))

    def claimed(
        self,
        slots: Slots,
        attempt: Attempt,
        *,
        leased_until: float | None = None,
        start_first: bool = False,
    ) -> None:
        """A consumer claimed an attempt: it holds a slot and its lease is renewed.

        ``leased_until`` is the monotonic time until which the lease is surely held (by
        default a whole lease from now); ``start_first`` records the start before the actor
        runs, for a job with an abandoned claim."""
        self._check_fork()
        if leased_until is None:
            leased_until = time.monotonic() + self.settings.lease_seconds
        self._leases().start()
        with self._lock:
            previous = self._entries.get(attempt.id)
            if previous is not None:
                # An earlier claim of the same job that this process lost track of.
                self._finish(previous)
            slots._take()
            self._entries[attempt.id] = _Entry(attempt, slots, leased_until, start_first)

    def release(self, attempts: Iterable[Attempt]) -> set[str]:
        """Give claimed attempts that never started back to the queue, uncharged. Those
        already started or done are left alone. Returns the ids given back.

        Raises:
          dramatiq.errors.ConnectionError: the database is unreachable. The attempts are
            done for this process anyway: no longer renewed, their leases expire and the
            reaper gives them back, still uncharged.
        """
        self._check_fork()
        with self._lock:
            entries = [e for a in attempts if (e := self._get(a, State.CLAIMED)) is not None]
            for entry in entries:
                self._finish(entry)
        if not entries:
            return set()
        return self.store.release([e.attempt for e in entries])

    def begin_shutdown(self) -> set[str]:
        """Shutdown began: claim nothing more and give back every claimed message that has
        not started, at once."""
        self._check_fork()
        self._closing = True
        with self._lock:
            claimed = [e.attempt for e in self._entries.values() if e.state is State.CLAIMED]
        try:
            released = self.release(claimed)
        except BrokerConnectionError:
            logger.warning(
                "Could not return %d unstarted message(s) at shutdown; their leases will "
                "expire and they go back uncharged.",
                len(claimed),
            )
            return set()
        if released:
            logger.info("Returned %d unstarted message(s) at shutdown.", len(released))
        return released

    def stop_renewing(self, attempt: Attempt) -> None:
        """An actor declared with ``heartbeat=False`` starts: its lease (fresh from the
        start) is no longer renewed by the heartbeat."""
        with self._lock:
            entry = self._get(attempt, State.STARTED)
            if entry is not None:
                entry.renew = False

    def failed_with(self, attempt: Attempt, error: str) -> None:
        """The actor raised: remember it, so that no ack can write this attempt as a
        success."""
        with self._lock:
            entry = self._get(attempt, State.STARTED)
            if entry is not None:
                entry.error = error

    def skipped(self, attempt: Attempt, skip: dict[str, Any]) -> None:
        """A middleware skipped the message before its actor ran (``skip``: its
        ``reason``, ``skipped_by`` and ``message``): Dramatiq's ack of it is then written
        as ``cancelled`` with that event, its nack as a failure that names the middleware.
        """
        with self._lock:
            entry = self._get(attempt, State.CLAIMED, State.STARTED)
            if entry is not None:
                entry.skip = skip

    # -- outcomes ------------------------------------------------------------------------

    def settle(self, attempt: Attempt, kind: str, error: str | None = None) -> bool:
        """Dramatiq acked (``kind="complete"``) or nacked (``"fail"``) a message: queue its
        outcome for the writer. Refused (False) for an attempt with an outcome (or a
        written retry) already, one that was released, aborted or lost.

        An ack of an attempt whose actor raised is written as a failure: a failed attempt
        is never recorded as a success (Dramatiq acks it when no Retries middleware is
        installed, or when that middleware's hook failed). A nack of an attempt whose abort
        was requested (an actor declared ``interrupt_on_abort=False`` that stopped itself)
        is written as the abort: the job ends cancelled. An ack of a message a middleware
        skipped (:meth:`skipped`) is written as ``skip``: the job ends cancelled, with an
        event saying who skipped it. The ack or nack of an attempt whose retry was asked
        for (:meth:`reschedule`) writes that retry, here, in the calling thread.
        """
        self._check_fork()
        with self._lock:
            entry = self._get(attempt, State.CLAIMED, State.STARTED, State.RESCHEDULING)
            if entry is not None and entry.completion is Completion.COMMITTED:
                # Its success committed with the actor's transaction: nothing is left to
                # write, whatever the actor did after the block.
                self._finish(entry)
                return True
            if entry is None or (entry.state is State.RESCHEDULING and entry.retry is None):
                self._refuse(kind, attempt)
                return False
            retry = None
            if entry.state is State.RESCHEDULING:
                retry, entry.retry = entry.retry, None
            else:
                kind, error = self._outcome(entry, kind, error)
                entry.state = State.OUTCOME_QUEUED
                entry.slot_given = entry.slots._settle()
        if retry is not None:
            # Dramatiq acks (or nacks) the message once every middleware ran: the row goes
            # back to its queue now.
            self._write_retry(entry, retry)
        else:
            self._outcomes().submit(kind, attempt, error)
        return True

    @staticmethod
    def _outcome(entry: _Entry, kind: str, error: Any) -> tuple[str, Any]:
        """The outcome an ack or nack of ``entry`` is written as (see :meth:`settle`)."""
        attempt = entry.attempt
        if entry.abort_requested and (kind == "fail" or entry.interrupt):
            # An actor that checks for aborts itself stopped with an exception; or the
            # abort was raised in the actor's thread, which has now left it (whatever it
            # reports: the exception may have come after its last line).
            return "abort", None
        if entry.skip is not None and entry.error is None:
            # Nothing ran: an ack is no success, and a failure says who skipped it.
            if kind == "complete":
                return "skip", entry.skip
            return kind, f"{error} (skipped by {entry.skip['skipped_by']})"
        if kind == "complete" and entry.error is not None:
            logger.error(
                "Job %s attempt %d raised but was acked (no Retries middleware, or its "
                "hook failed); it is recorded as failed.",
                attempt.id,
                attempt.attempt,
            )
            return "fail", entry.error
        return kind, error

    def written(self, attempt: Attempt, owned: bool) -> None:
        """The outcome writer is done with an attempt: written (``owned``), or found to be
        lost (another worker owns the job since its lease expired)."""
        with self._lock:
            entry = self._get(attempt, State.OUTCOME_QUEUED)
            if entry is None:
                return
            if not owned:
                logger.warning(
                    "Lost job %s attempt %d before its outcome was written: its lease expired "
                    "and it was requeued or claimed again; this outcome is discarded.",
                    attempt.id,
                    attempt.attempt,
                )
            self._finish(entry)

    def unwritable(self, attempt: Attempt) -> None:
        """An outcome cannot be written (not a connection problem): stop renewing the
        attempt, so that its lease expires and the job runs again."""
        with self._lock:
            entry = self._get(attempt, State.OUTCOME_QUEUED)
            if entry is not None:
                self._finish(entry)
                self._orphan(entry)

    def _orphan(self, entry: _Entry) -> None:
        """An attempt let go without an outcome: its start is still to be written. Call
        with the lock held."""
        if not entry.start_recorded:
            self._orphans.append(entry.attempt)
            self._leases().starts_pending()

    def reschedule(self, attempt: Attempt, write: Callable[[], bool]) -> bool:
        """started -> rescheduling: the attempt's retry (``write``, its guarded statement)
        waits for Dramatiq's ack or nack of the message, which writes it instead of an
        outcome (:meth:`settle`). Dramatiq's Retries asks for the retry in its
        ``after_process_message``; the row goes back to its queue only once every
        middleware's ``after_process_message`` ran for this attempt, as an outcome is
        written only then. Returns False if the move was refused (the attempt already has
        an outcome or a retry, or is lost)."""
        self._check_fork()
        with self._lock:
            entry = self._get(attempt, State.STARTED)
            if entry is not None and entry.completion is Completion.COMMITTED:
                logger.info(
                    "Job %s attempt %d raised after its complete_in() block committed: it "
                    "succeeded, and is not retried.",
                    attempt.id,
                    attempt.attempt,
                )
                return True
            if entry is None:
                self._refuse("reschedule", attempt)
                return False
            entry.state = State.RESCHEDULING
            entry.retry = write
        return True

    def _write_retry(self, entry: _Entry, write: Callable[[], bool]) -> bool:
        """rescheduling -> done through the retry's statement, at the ack or nack. The
        attempt is done whatever the statement does: a failed attempt whose retry could
        not be written is left to its lease (the reaper requeues it), never acked as a
        success."""
        attempt = entry.attempt
        written = False
        try:
            written = write()
        except Exception as e:
            logger.error(
                "Could not write the retry of job %s attempt %d (%s: %s); it runs again "
                "once its lease expires.",
                attempt.id,
                attempt.attempt,
                type(e).__name__,
                e,
            )
            return False
        finally:
            with self._lock:
                self._finish(entry)
                if not written:
                    self._orphan(entry)
        if not written:
            logger.warning(
                "Could not reschedule job %s attempt %d: this worker no longer owns it.",
                attempt.id,
                attempt.attempt,
            )
        return written

    # -- aborts --------------------------------------------------------------------------

    def running_in(self, attempt: Attempt, thread: int, *, interrupt: bool = True) -> bool:
        """The actor of a started attempt runs in worker thread ``thread`` from now until
        :meth:`left`: an abort raises :class:`~.errors.JobAborted` there (``interrupt``),
        or only flags the attempt for the actor to check. Returns False when the attempt
        was aborted (or lost) since it started: the actor must not run."""
        self._check_fork()
        with self._lock:
            entry = self._get(attempt, State.STARTED)
            if entry is None:
                return False
            entry.thread = thread
            entry.interrupt = interrupt
            return True

    def left(self, attempt: Attempt) -> None:
        """The worker thread is done with the attempt's actor (Dramatiq's post-processing
        follows): no abort is raised in it any more. Taken under the same lock as
        :meth:`abort`, so an exception is never set in a thread that has moved on."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            if entry is not None and entry.attempt == attempt:
                entry.thread = None
