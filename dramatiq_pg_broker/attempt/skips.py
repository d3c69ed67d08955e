"""What a skipped message becomes: ``cancelled``, with an event saying who skipped it.

A middleware skips a message by raising Dramatiq's ``SkipMessage`` in its
``before_process_message``: dramatiq-abort's ``Abortable`` for a cancel (``AbortMode.CANCEL``)
of a job that has not started, Dramatiq's ``AgeLimit`` for a message too old to run, or a
middleware of the application's. Dramatiq then acks the message, unless the middleware also
failed it (``message.fail()``, as ``AgeLimit`` does), and its ``Results`` middleware stores
None as the result. Neither would tell the truth here: nothing ran, so nothing succeeded.

:class:`SkipRecorder` (the broker runs it first at every skip) finds the middleware that
raised and why, and:

- tells the in-flight ledger, so that the ack is written as ``cancelled`` (the
  ``cancel_skipped`` statement) with a ``cancelled`` event whose actor is the middleware
  and whose data is ``{"reason", "skipped_by", "message", "worker"}``: ``reason`` is
  ``abort`` (dramatiq-abort), ``age_limit``, ``actor`` (the actor itself raised
  ``SkipMessage``) or ``middleware``; a failed skip stays a failure, as before, and its
  error names the middleware (``SkipMessage: Message age limit exceeded (skipped by
  dramatiq.middleware.age_limit.AgeLimit)``);
- for a skip that did not fail, stores :class:`~.errors.MessageSkipped` in every results
  backend that would have stored the result, instead of None: ``get_result`` raises
  ``ResultFailure`` (``orig_exc_type == "MessageSkipped"``).
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TYPE_CHECKING, Any

from dramatiq.actor import Actor
from dramatiq.middleware import AgeLimit, Middleware, SkipMessage
from dramatiq.results import Results

from ..errors import MessageSkipped
from .claiming import PgMessageProxy

if TYPE_CHECKING:
    from .inflight import Ledger

#: The ``reason`` of a skip by each kind of skipper.
ABORT = "abort"
AGE_LIMIT = "age_limit"
ACTOR = "actor"
MIDDLEWARE = "middleware"


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
    """Records who skipped a message and why (see the module docstring).

    The broker calls its ``after_skip_message`` before any middleware's, whatever their
    order (:meth:`PostgresBroker.emit_after`): the ``Results`` middleware, added after the
    broker was built, must find the result already taken care of.

    Parameters:
      ledger(Ledger): the broker's in-flight ledger, which writes the skip's ack.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def after_skip_message(self, broker, message) -> None:
        exception = sys.exc_info()[1]
        skip = describe_skip(exception if isinstance(exception, SkipMessage) else None)
        if isinstance(message, PgMessageProxy):
            self.ledger.skipped(message.attempt, skip)
        if not message.failed:
            self._store_skipped(broker, message, skip)

    @staticmethod
    def _store_skipped(broker, message, skip: dict[str, Any]) -> None:
        """Store :class:`MessageSkipped` where Dramatiq's Results would store None."""
        actor = broker.actors.get(message.actor_name)
        actor_options = actor.options if actor is not None else {}
        error = MessageSkipped(
            f"skipped by {skip['skipped_by']}" + (f": {skip['message']}" if skip["message"] else "")
        )
        for middleware in broker.middleware:
            if not isinstance(middleware, Results):
                continue
            store = message.options.get(
                "store_results", actor_options.get("store_results", middleware.store_results)
            )
            if not store:
                continue
            ttl = message.options.get(
                "result_ttl", actor_options.get("result_ttl", middleware.result_ttl)
            )
            middleware.backend.store_exception(message, error, ttl)
        # Dramatiq's Results stores None for a skipped message that did not fail.
        message.options["store_results"] = False
