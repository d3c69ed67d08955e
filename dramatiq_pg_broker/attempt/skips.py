"""What a skipped message becomes: ``cancelled``, with an event saying who skipped it.

A middleware skips a message by raising Dramatiq's ``SkipMessage`` in its
``before_process_message``: dramatiq-abort's ``Abortable`` for a cancel (``AbortMode.CANCEL``)
of a job that has not started, Dramatiq's ``AgeLimit`` for a message too old to run, or a
middleware of the application's. Dramatiq then acks the message, unless the middleware also
failed it (``message.fail()``, as ``AgeLimit`` does), and its ``Results`` middleware stores
None as the result of one it did not fail. An ack would record a success: nothing ran, so
nothing succeeded.

:class:`SkipRecorder` (the broker runs it first at every skip) finds the middleware that
raised and why, and tells the in-flight ledger, so that the skip is written as
``cancelled`` (the ``cancel_skipped`` statement) with a ``cancelled`` event whose actor is
the middleware and whose data is ``{"reason", "skipped_by", "message", "worker"}``:
``reason`` is ``abort`` (dramatiq-abort), ``age_limit``, ``actor`` (the actor itself raised
``SkipMessage``) or ``middleware``. A failed skip stays a failure, as before, and its error
names the middleware (``SkipMessage: Message age limit exceeded (skipped by
dramatiq.middleware.age_limit.AgeLimit)``).

A results backend holds what Dramatiq stores on every broker: None for a skip that did not
fail (``get_result`` returns None), the ``SkipMessage`` failure for one that did. None is
also what an actor that returns nothing leaves, so the job tells the two apart: a skip
that did not fail is written ``cancelled`` at once, in the worker thread, before any other
middleware's ``after_skip_message`` runs (the ``Results`` middleware among them; Dramatiq's
ack of the message, later, finds it written). A reader whom ``get_result`` gave None then
finds the job ``cancelled`` (``broker.store.get(message_id)["status"]``, ``jobs show``, the
admin API), never still ``running``, nor ``succeeded``. If the database does not take the
write within :data:`WRITE_WAIT_SECONDS` (an outage), the worker goes on and the outcome
writer writes it when it can, as any outcome.

A skip that :class:`~.current.JobContext` raises for a message this process no longer owns
(its lease was lost while it waited, or an operator aborted it) stores no result at all:
another worker runs, or ran, that job.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from dramatiq.actor import Actor
from dramatiq.middleware import AgeLimit, Middleware, SkipMessage

from .claiming import PgMessageProxy

if TYPE_CHECKING:
    from .inflight import Ledger

#: The ``reason`` of a skip by each kind of skipper.
ABORT = "abort"
AGE_LIMIT = "age_limit"
ACTOR = "actor"
MIDDLEWARE = "middleware"

#: The longest a worker thread waits for a skip's ``cancelled`` to be written before the
#: other middleware see the skip, and how often it looks.
WRITE_WAIT_SECONDS = 5.0
WRITE_POLL_SECONDS = 0.002


def _name(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _skipper(traceback: TracebackType | None) -> Any:
    """The middleware (or actor) whose code raised the skip: the first frame of the
    traceback, from Dramatiq's worker inward, whose ``self`` is one."""
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        if isinstance(owner, (Middleware, Actor)):
            return owner
        traceback = traceback.tb_next
    return None


def describe_skip(exception: BaseException | None) -> dict[str, Any]:
    """``{"reason", "skipped_by", "message"}`` for the ``SkipMessage`` being handled."""
    skipper = _skipper(exception.__traceback__) if exception is not None else None
    if isinstance(skipper, Actor):
        reason, skipped_by = ACTOR, skipper.actor_name
    elif skipper is None:
        reason, skipped_by = MIDDLEWARE, "unknown"
    else:
        skipped_by = _name(skipper)
        if isinstance(skipper, AgeLimit):
            reason = AGE_LIMIT
        elif type(skipper).__module__.split(".")[0] == "dramatiq_abort":
            reason = ABORT
        else:
            reason = MIDDLEWARE
    text = str(exception) if exception is not None else ""
    return {"reason": reason, "skipped_by": skipped_by, "message": text or None}


class SkipRecorder(Middleware):
    """Records who skipped a message and why, and writes the skip of a message that was
    not failed at once (see the module docstring).

    The broker calls its ``after_skip_message`` before any middleware's, whatever their
    order (:meth:`PostgresBroker.emit_after`): the ``Results`` middleware, added after the
    broker was built, must find the job already cancelled when it stores None.

    Parameters:
      ledger(Ledger): the broker's in-flight ledger, which writes the skip.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def after_skip_message(self, broker, message) -> None:
        if not isinstance(message, PgMessageProxy):
            return
        exception = sys.exc_info()[1]
        skip = describe_skip(exception if isinstance(exception, SkipMessage) else None)
        attempt = message.attempt
        # Its actor never ran: no abort is to be raised in this thread from here on.
        self.ledger.left(attempt)
        self.ledger.skipped(attempt, skip)
        if message.failed or not self.ledger.settle(attempt, "complete"):
            # A failure is written at Dramatiq's nack, naming the middleware; a message
            # this process no longer owns has nothing to write.
            return
        deadline = time.monotonic() + WRITE_WAIT_SECONDS
        while self.ledger.holds(attempt) and time.monotonic() < deadline:
            time.sleep(WRITE_POLL_SECONDS)
