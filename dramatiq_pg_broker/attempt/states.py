"""The states an attempt goes through in its process, its prefetch slots, and what the
ledger hands work to (see :mod:`.inflight`)."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ..jobs.rows import Attempt

#: Longest pause between two tries of a write the database refused on a connection error,
#: so that work resumes within about this long of the server's return.
RETRY_CAP_SECONDS = 0.5

#: How long after its actor began an attempt's start is written, if no outcome came first.
START_RECORD_DELAY = 0.1

#: The longest a ``complete_in()`` block waits for a heartbeat statement that is writing
#: its attempt (normally one round trip): past it, the block does not begin.
HEARTBEAT_WAIT_SECONDS = 5.0

#: The longest an actor's own ``renew()`` or ``progress()``, or the pin of a REPEATABLE
#: READ or SERIALIZABLE ``complete_in()`` block, waits for its job's row, held by a
#: transaction the worker does not know of (the application's own lock on it): past it,
#: the call raises :class:`~.errors.JobBusy` rather than hang.
ROW_WAIT_SECONDS = 1.0


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


class BlockEnd(enum.Enum):
    """How a ``complete_in()`` block ended, as it tells the ledger on every way out
    (:meth:`Ledger.completion_ended`)."""

    #: Nothing of its success stands: not written, or written in a transaction (or
    #: savepoint) that rolled back as the block left.
    NOT_WRITTEN = "not written"
    #: Written in the transaction the block began, which committed.
    COMMITTED = "committed"
    #: Written in the application's transaction, which goes on after the block.
    OPEN = "open"
    #: Written, in a transaction that ended in a way the block cannot tell (its commit
    #: raised, or the application committed inside the block): its id says.
    ENDED = "ended"


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
        "completion_block",
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
        #: The block that set ``completion`` and has not ended yet (it alone may undo it).
        self.completion_block: object | None = None
        #: ``renew`` before the block (the heartbeat leaves the attempt alone meanwhile).
        self.renew_before = True


class LeaseTimer(Protocol):
    """What the ledger needs of the lease keeper (:class:`~.leases.LeaseKeeper`)."""

    def start(self) -> None: ...

    def starts_pending(self) -> None: ...

    def renew_soon(self) -> None: ...


class OutcomeSink(Protocol):
    """What the ledger needs of the outcome writer (:class:`~.outcomes.OutcomeWriter`)."""

    def submit(self, kind: str, attempt: Attempt, error: Any) -> None: ...
