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
claim) moves a claimed or started attempt straight to *outcome queued* with the outcome
``abort`` (the job ends ``cancelled``), at once, whatever the actor is doing: a thread
blocked in a system call (``time.sleep``, a socket read) cannot be interrupted before the
call returns, but its job is cancelled within moments and the outcome the thread reports
later is refused. The actor's thread gets :class:`~.errors.JobAborted` raised in it (as
Dramatiq's TimeLimit raises its exception), at its next Python instruction, unless the
actor is declared ``interrupt_on_abort=False``: it then only sees
``current_job().abort_requested`` and stops itself; whatever it raises then ends the job
cancelled (a success stays a success).

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
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from dramatiq.errors import BrokerConnectionError
from dramatiq.middleware.threading import raise_thread_exception

from .. import forks
from ..config import Settings
from ..errors import JobAborted
from ..jobs.rows import Attempt
from ..jobs.store import JobStore
from ..sending.sender import GroupCommit

logger = logging.getLogger("dramatiq_pg_broker.inflight")

#: Longest pause between two tries of a write the database refused on a connection error,
#: so that work resumes within about this long of the server's return.
RETRY_CAP_SECONDS = 0.5

#: How long after its actor began an attempt's start is written, if no outcome came first.
START_RECORD_DELAY = 0.1

#: The longest a ``complete_in()`` block waits for a heartbeat statement that is writing
#: its attempt (normally one round trip).
HEARTBEAT_WAIT_SECONDS = 5.0


class State(enum.Enum):
    CLAIMED = "claimed"
    STARTED = "started"
    RESCHEDULING = "rescheduling"
    OUTCOME_QUEUED = "outcome queued"
    DONE = "done"


class Completion(enum.Enum):
    """Where a success written in the application's transaction stands (see
    :meth:`Ledger.completing`)."""

    PENDING = "pending"
    COMMITTED = "committed"


class Slots:
    """The slots of one consumer's claim window: attempts it claimed that are not done yet.

    An attempt whose outcome is queued gives its slot back at once while fewer than
    ``allowance`` (the consumer's current window) of the consumer's outcomes wait for the
    writer (the write-behind allowance), so the next claim overlaps the writing of the last
    batch's outcomes. Past that, an outcome keeps its slot until it is written; and when
    the window shrinks below the outcomes already behind, the excess counts as held
    (:attr:`held`). A consumer claims only up to its window in :attr:`held` slots, so it
    never holds more than its window in messages, nor more than twice its window in
    attempts the database has not recorded an outcome for (the window of its last claim).
    """

    def __init__(self, prefetch: int) -> None:
        self._in_use = 0
        #: Outcomes waiting for the writer whose slots were given back early.
        self._behind = 0
        #: How many outcomes may wait for the writer without holding their slots: the
        #: consumer's window (see :class:`~.consumer.ClaimWindow`).
        self.allowance = prefetch
        self._cond = threading.Condition()

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def held(self) -> int:
        """Slots in use, plus the outcomes waiting for the writer beyond the allowance."""
        return self._in_use + max(0, self._behind - self.allowance)

    def wait(self, timeout: float) -> None:
        """Wait until a slot is freed, at most ``timeout`` seconds."""
        with self._cond:
            self._cond.wait(timeout)

    def _take(self) -> None:
        with self._cond:
            self._in_use += 1

    def _give(self) -> None:
        with self._cond:
            self._in_use -= 1
            self._cond.notify_all()

    def _settle(self) -> bool:
        """An outcome was queued: give its slot back now if the allowance permits.
        Returns True if it did (the outcome is then owed, :meth:`_written` settles it)."""
        with self._cond:
            if self._behind >= self.allowance:
                return False
            self._behind += 1
            self._in_use -= 1
            self._cond.notify_all()
            return True

    def _written(self) -> None:
        with self._cond:
            beyond_allowance = self._behind > self.allowance
            self._behind -= 1
            if beyond_allowance:
                # It counted as held (the window shrank): a slot is free now.
                self._cond.notify_all()


class _Entry:
    __slots__ = (
        "attempt",
        "slots",
        "slot_given",
        "state",
        "renew",
        "error",
        "leased_until",
        "start_first",
        "began",
        "start_recorded",
        "thread",
        "interrupt",
        "abort_requested",
        "skip",
        "retry",
        "completion",
        "completion_xid",
        "renew_before",
    )

    def __init__(
        self, attempt: Attempt, slots: Slots, leased_until: float, start_first: bool
    ) -> None:
        self.attempt = attempt
        self.slots = slots
        #: Its slot went back when its outcome was queued (:meth:`Slots._settle`).
        self.slot_given = False
        self.state = State.CLAIMED
        self.renew = True
        #: Monotonic time until which the lease is surely held: the moment before the
        #: statement that claimed or last renewed it was sent, plus the lease.
        self.leased_until = leased_until
        #: Record the start before the actor runs (the job has an abandoned claim).
        self.start_first = start_first
        #: Monotonic time the actor began (started attempts).
        self.began = 0.0
        self.start_recorded = False
        #: The text of an exception the actor raised, kept so that an ack of a failed
        #: attempt (a broken retry hook) is written as a failure, never as a success.
        self.error: str | None = None
        #: The ident of the worker thread running the actor, while it does.
        self.thread: int | None = None
        #: An abort raises JobAborted in that thread (else the actor checks for it).
        self.interrupt = True
        #: An operator asked for this attempt's abort.
        self.abort_requested = False
        #: A middleware skipped the message: who and why (see :mod:`.skips`).
        self.skip: dict[str, Any] | None = None
        #: The retry's statement, written at the ack or nack (rescheduling attempts).
        self.retry: Callable[[], bool] | None = None
        #: Its success was written in the application's transaction (a
        #: ``complete_in()`` block): pending until that transaction is known to have
        #: committed (then committed) or not (then None again).
        self.completion: Completion | None = None
        #: The id of that transaction, once the statement ran in it.
        self.completion_xid: str | None = None
        #: ``renew`` before the block (the heartbeat leaves the attempt alone meanwhile).
        self.renew_before = True


class LeaseTimer(Protocol):
    """What the ledger needs of the lease keeper (:class:`~.leases.LeaseKeeper`)."""

    def start(self) -> None: ...

    def starts_pending(self) -> None: ...


class OutcomeSink(Protocol):
    """What the ledger needs of the outcome writer (:class:`~.outcomes.OutcomeWriter`)."""

    def submit(self, kind: str, attempt: Attempt, error: Any) -> None: ...


class Ledger:
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

    # -- starting ------------------------------------------------------------------------

    def start(self, attempt: Attempt, *, record_first: bool = False) -> bool:
        """claimed -> started, just before the actor runs. Returns False (the message must
        not run) if this process no longer holds the attempt: it was released at shutdown,
        or its lease was lost.

        The start is written later, by :meth:`record_starts`, while the lease is surely
        held; otherwise (and with ``record_first``, or for a job with an abandoned claim) it
        is written now, by one guarded statement group-committed with other threads'
        starts, and a lost claim is found before the actor runs. While the database is
        unreachable that write is retried, at least twice a second: its guard, not a local
        clock, says whether the claim is still this process's.
        """
        self._check_fork()
        with self._lock:
            entry = self._get(attempt, State.CLAIMED)
            if entry is None:
                self._refuse("start", attempt)
                return False
            now = time.monotonic()
            if (
                not (record_first or entry.start_first or self._closing)
                and entry.leased_until - now > self.settings.lease_seconds / 2
            ):
                entry.state = State.STARTED
                entry.began = now
                deferred = True
            else:
                deferred = False
        if deferred:
            self._leases().starts_pending()
            return True
        delay = 0.05
        while True:
            with self._lock:
                if self._get(attempt, State.CLAIMED) is None:
                    return False
            if self._closing:
                # Shutdown began after the worker took it: it goes back instead.
                try:
                    self.release([attempt])
                except BrokerConnectionError:
                    pass
                return False
            try:
                owned = self._starts.submit(attempt)
                break
            except BrokerConnectionError as e:
                # Told once per outage by the process (outage.py), not at every try.
                logger.debug("Could not record the start of job %s, retrying: %s", attempt.id, e)
                time.sleep(delay)
                delay = min(delay * 2, RETRY_CAP_SECONDS)
        with self._lock:
            entry = self._get(attempt, State.CLAIMED)
            if entry is None:
                return False
            if attempt.id not in owned:
                logger.warning(
                    "Job %s attempt %d was lost before it started (its lease expired and the "
                    "job went to another worker); it is not run here.",
                    attempt.id,
                    attempt.attempt,
                )
                self._finish(entry)
                return False
            entry.state = State.STARTED
            entry.start_recorded = True
            return True

    def record_starts(self) -> float | None:
        """Write, in one statement, the starts of attempts whose actors began at least
        :data:`START_RECORD_DELAY` ago and have no outcome yet, and of attempts let go
        without an outcome before their start was written. A running attempt the statement
        finds owned by someone else is lost: it is let go (its outcome will be refused).
        Returns the monotonic time the next unwritten start is due, or None.

        Raises:
          dramatiq.errors.ConnectionError: the database is unreachable; nothing changed.
        """
        self._check_fork()
        now = time.monotonic()
        later: list[float] = []
        with self._lock:
            orphans, self._orphans = self._orphans, []
            due: list[Attempt] = list(orphans)
            for entry in self._entries.values():
                if entry.state is not State.STARTED or entry.start_recorded:
                    continue
                if entry.completion is not None:
                    # Its row is locked by the application's transaction: the start would
                    # wait for it (and a committed success needs none).
                    continue
                if entry.began + START_RECORD_DELAY <= now:
                    due.append(entry.attempt)
                else:
                    later.append(entry.began + START_RECORD_DELAY)
            self._heartbeat_writing.update(a.id for a in due)
        if due:
            try:
                owned = self.store.start(due, None)
            except BaseException:
                with self._lock:
                    self._orphans.extend(orphans)
                raise
            finally:
                self._heartbeat_wrote(due)
            with self._lock:
                for attempt in due[len(orphans) :]:
                    entry = self._get(attempt, State.STARTED)
                    if entry is None or entry.completion is not None:
                        continue  # its outcome came meanwhile, or a complete_in() block
                    if attempt.id in owned:
                        entry.start_recorded = True
                    else:
                        logger.warning(
                            "Lost job %s attempt %d while its actor ran: its lease expired "
                            "and another worker may run it.",
                            attempt.id,
                            attempt.attempt,
                        )
                        self._finish(entry)
        return min(later) if later else None

    def _write_starts(self, attempts: list[Attempt]) -> set[str]:
        return self.store.start(attempts, self.settings.lease_seconds)

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
        if kind == "fail" and entry.abort_requested:
            # An actor that checks for aborts itself stopped with an exception.
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

    def abort(self, job_id: str) -> bool:
        """An operator asked for the abort of job ``job_id``: stop this process's attempt of
        it, if it holds one that is claimed or running (see the module docstring). The
        attempt's outcome becomes ``abort``, written by the outcome writer (the job ends
        ``cancelled``, never retried nor run again), except for a running actor declared
        ``interrupt_on_abort=False``, which is only flagged. Returns True if this process
        held such an attempt; a second request for the same attempt changes nothing."""
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
            entry.state = State.OUTCOME_QUEUED
            entry.slot_given = entry.slots._settle()
            if thread is not None:
                # Under the lock that left() takes: the thread is still in the actor.
                raise_thread_exception(thread, JobAborted)
        self._outcomes().submit("abort", attempt, None)
        logger.warning(
            "Aborted job %s attempt %d at an operator's request (%s).",
            attempt.id,
            attempt.attempt,
            "its actor is interrupted" if started else "it had not started",
        )
        return True

    def abort_requested(self, attempt: Attempt) -> bool:
        """Whether an abort of this attempt reached this process (while it holds it)."""
        with self._lock:
            entry = self._entries.get(attempt.id)
            return entry is not None and entry.attempt == attempt and entry.abort_requested

    def claimed_by(self, owner: str) -> list[Attempt]:
        """The attempts of one consumer (its lease owner id) that are claimed and have not
        started: what it gives back when its queue is paused."""
        with self._lock:
            return [
                e.attempt
                for e in self._entries.values()
                if e.state is State.CLAIMED and e.attempt.owner == owner
            ]

    # -- leases --------------------------------------------------------------------------

    def renewable(self) -> list[Attempt]:
        """Attempts whose leases the heartbeat renews."""
        self._check_fork()
        with self._lock:
            return [e.attempt for e in self._entries.values() if e.renew]

    @contextlib.contextmanager
    def renewing(self) -> Iterator[list[Attempt]]:
        """:meth:`renewable`, held as being written until the block ends: a
        ``complete_in()`` block waits for the statement to be done with its attempt before
        it takes the row's lock (:meth:`completing`), so that the heartbeat never waits
        for an application's transaction."""
        with self._lock:
            attempts = self.renewable()
            self._heartbeat_writing.update(a.id for a in attempts)
        try:
            yield attempts
        finally:
            self._heartbeat_wrote(attempts)

    def _heartbeat_wrote(self, attempts: Iterable[Attempt]) -> None:
        with self._lock:
            self._heartbeat_writing.subtract(a.id for a in attempts)
            self._heartbeat_writing += collections.Counter()  # drops the zeros
            self._heartbeat_done.notify_all()

    def renewed(
        self, attempts: Sequence[Attempt], owned: set[str], leased_until: float | None = None
    ) -> None:
        """A renewal returned ``owned``: let go of the attempts it did not renew (lost).
        ``leased_until``: the monotonic time until which the renewed leases surely hold."""
        with self._lock:
            for attempt in attempts:
                entry = self._entries.get(attempt.id)
                if entry is None or entry.attempt != attempt or entry.state is State.DONE:
                    continue
                if entry.completion is not None:
                    # Renewed just before a complete_in() block took the row: the block
                    # and its transaction say what happened to it, not this renewal.
                    continue
                if attempt.id in owned:
                    if leased_until is not None:
                        entry.leased_until = max(entry.leased_until, leased_until)
                    continue
                if entry.state is not State.RESCHEDULING:
                    # Its outcome was just written, or the lease expired and another
                    # worker owns the job now.
                    if entry.state is not State.OUTCOME_QUEUED:
                        logger.warning(
                            "Lost job %s attempt %d: its lease expired and another worker "
                            "may run it.",
                            attempt.id,
                            attempt.attempt,
                        )
                    self._finish(entry)

    def renew(self, attempt: Attempt, lease_seconds: float, *, record: bool = False) -> bool:
        """An explicit renewal by the running actor. Returns False if no longer owned."""
        owned = self.store.renew([attempt], lease_seconds, record=record)
        return attempt.id in owned
