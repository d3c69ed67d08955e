"""What a claim hands Dramatiq's worker: the message proxy of an attempt, the owner id of
a consumer, how an error is described; and the claim window that adapts a consumer's
claims to the work it finds (see :mod:`.consumer`)."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

import dramatiq
from dramatiq.broker import MessageProxy

from ..jobs.rows import Attempt, clean_text
from .states import Slots

#: The window halves when the next claim became due only after this many claims' time.
WINDOW_SHRINK_CLAIMS = 4


def new_owner_id() -> str:
    """A lease owner id: ``host:pid:random:Llevel``, unique per consumer instance (8 random
    hex digits), ending with this code's schema level (the highest migration it ships, four
    digits: ``:L0022``). The jobs table refuses claims whose owner ends the way every
    release before migration 0022 wrote it (``host:pid:thread:random``: 8 hex digits last,
    see that migration), and ``migrate`` reads the level of each lease's owner before a
    breaking migration (see :func:`..db.migrate.live_work`). The consumer's thread name,
    which earlier owners carried, said nothing the row does not (a consumer thread claims
    for one queue): left out, the owner is no longer than before with its level, and the
    claim's row version and the events that name the owner are as small."""
    from ..db.handshake import this_code

    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}:L{this_code().level:04d}"


def describe_exception(exc: BaseException) -> str:
    """``Type: text`` for an exception, even one whose ``str()`` raises."""
    try:
        name = type(exc).__name__
    except Exception:  # pragma: no cover - a type without a name
        name = "Exception"
    try:
        text = str(exc)
    except Exception:
        text = "<exception str() failed>"
    return clean_text(f"{name}: {text}" if text else name)


def describe_error(message: MessageProxy) -> str:
    """The text kept in ``last_error`` for a failed attempt."""
    exc = getattr(message, "_exception", None)
    if exc is None:
        return "message rejected"
    return describe_exception(exc)


class PgMessageProxy(MessageProxy):
    """A Dramatiq message proxy that remembers which attempt of which job row it is."""

    def __init__(self, message: dramatiq.Message, attempt: Attempt):
        super().__init__(message)
        self._attempt = attempt
        #: The retry delay this package's Retries middleware chose, if it chose one.
        self.backoff_ms: int | None = None
        #: What the consumer's ``prepare`` hook read for it with its claim, if anything
        #: (a workflow step's piped input).
        self.prepared: Any = None

    @property
    def attempt(self) -> Attempt:
        return self._attempt


class ClaimWindow:
    """How many messages one consumer may hold: its prefetch, grown while its jobs are
    short. Adapted once per claim, from how the last claim went (:meth:`adapt`), and given
    to the consumer's slots as their write-behind allowance (see :mod:`.inflight`).

    The window doubles, up to ``growth`` times the prefetch, when the last claim came back
    full and found the workers out of work (every message handed over before it was done:
    short jobs, whose threads idle through each claim's round trip); it halves, down to
    the prefetch, when the next claim became due only after more than
    :data:`WINDOW_SHRINK_CLAIMS` claims' time (longer jobs); and it returns to the
    prefetch when a claim comes back short (the queue runs dry).

    Parameters:
      prefetch(int): Dramatiq's prefetch, the smallest window.
      growth(int): the largest window, in prefetches (the ``prefetch_growth`` setting).
      slots(Slots): the consumer's slots, whose allowance follows the window.
    """

    def __init__(self, prefetch: int, growth: int, slots: Slots) -> None:
        self.prefetch = prefetch
        self.growth = growth
        self.slots = slots
        #: The window: how many messages the consumer may hold now.
        self.size = prefetch
        #: What the last claim said, used once: (when it returned, its seconds, whether it
        #: came back full, whether the workers had run dry by then).
        self._last: tuple[float, float, bool, bool] | None = None

    def claimed(self, *, sent: float, returned: float, full: bool, starved: bool) -> None:
        """A claim sent at ``sent`` came back at ``returned`` (monotonic seconds): ``full``
        when it brought as many jobs as it asked for, ``starved`` when every message handed
        over before it was done by then."""
        self._last = (returned, returned - sent, full, starved)

    def adapt(self, now: float) -> int:
        """Adapt the window before a claim sent at ``now`` (monotonic seconds), from what
        the last claim said (once: a second call without a claim in between changes
        nothing). Returns the window."""
        last, self._last = self._last, None
        if last is not None:
            returned, seconds, full, starved = last
            if not full:
                self.size = self.prefetch
            elif now - returned >= WINDOW_SHRINK_CLAIMS * seconds:
                self.size = max(self.prefetch, self.size // 2)
            elif starved:
                self.size = min(self.size * 2, self.prefetch * self.growth)
            self.slots.allowance = self.size
        return self.size
