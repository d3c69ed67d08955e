"""Retries that reschedule the same job row.

:class:`Retries` replaces Dramatiq's middleware of the same name and honours the same actor
and message options (``max_retries``, ``min_backoff``, ``max_backoff``, ``retry_when``,
``throws``, ``on_retry_exhausted``) and the :class:`dramatiq.Retry` exception's ``delay``.
Instead of enqueueing a copy, a failure with attempts left moves the row back to
``queued`` with ``available_at = now + backoff`` and a ``retry_scheduled`` event.

The attempt count comes from the row (``attempts``), so a lease expiry counts as an attempt
too. Backoff is deterministic: ``min(min_backoff * 2 ** (attempt - 1), max_backoff)``
milliseconds; set ``jitter=True`` for Dramatiq's randomised backoff instead.
"""

from __future__ import annotations

import logging

from dramatiq.common import compute_backoff
from dramatiq.errors import Retry
from dramatiq.middleware.retries import DEFAULT_MAX_BACKOFF
from dramatiq.middleware.retries import Retries as DramatiqRetries

from .consumer import PgMessageProxy, describe_error
from .messages import max_retries_of

logger = logging.getLogger(__name__)


def backoff_ms(attempt: int, min_backoff: int, max_backoff: int) -> int:
    """The delay before the attempt after ``attempt`` (1-based): doubles every attempt."""
    return int(min(min_backoff * 2 ** min(max(attempt - 1, 0), 60), max_backoff))


class Retries(DramatiqRetries):
    """Dramatiq's Retries, rescheduling the job row instead of enqueueing a copy.

    Parameters:
      max_retries(int): retries of actors that set none (attempts = retries + 1).
      min_backoff(int): first delay in milliseconds (default: the broker's backoff base).
      max_backoff(int): longest delay in milliseconds (default: the broker's maximum).
      retry_when(callable): ``(retries, exception) -> bool``; overrides ``max_retries``.
      jitter(bool): use Dramatiq's randomised backoff instead of the deterministic one.
    """

    def __init__(
        self,
        *,
        max_retries=20,
        min_backoff=None,
        max_backoff=None,
        retry_when=None,
        jitter: bool = False,
    ):
        super().__init__(
            max_retries=max_retries,
            min_backoff=min_backoff,
            max_backoff=max_backoff,
            retry_when=retry_when,
        )
        self._explicit_backoff = (min_backoff, max_backoff)
        self.jitter = jitter

    def configure(self, backoff_base_ms: int, backoff_max_ms: int) -> None:
        """Take the broker's backoff settings unless given to the constructor."""
        if self._explicit_backoff[0] is None:
            self.min_backoff = backoff_base_ms
        if self._explicit_backoff[1] is None:
            self.max_backoff = backoff_max_ms

    def max_retries_for(self, actor, options: dict) -> int | None:
        return max_retries_of(options, actor.options, self.max_retries)

    def after_process_message(self, broker, message, *, result=None, exception=None):
        if exception is None:
            return
        if not isinstance(message, PgMessageProxy):
            # Not a job row (another broker's message): behave exactly like Dramatiq.
            return super().after_process_message(
                broker, message, result=result, exception=exception
            )
        actor = broker.get_actor(message.actor_name)
        throws = message.options.get("throws") or actor.options.get("throws")
        if throws and isinstance(exception, throws):
            logger.info("Aborting message %r.", message.message_id)
            message.fail()
            return

        attempt = message.attempt.attempt
        retries = attempt - 1
        message.options["retries"] = attempt
        max_retries = self.max_retries_for(actor, message.options)
        retry_when = actor.options.get("retry_when", self.retry_when)
        if (retry_when is not None and not retry_when(retries, exception)) or (
            retry_when is None and max_retries is not None and retries >= max_retries
        ):
            logger.warning("Retries exceeded for message %r.", message.message_id)
            message.fail()
            target = message.options.get("on_retry_exhausted") or actor.options.get(
                "on_retry_exhausted"
            )
            if target:
                broker.get_actor(target).send(
                    message.asdict(), {"retries": retries, "max_retries": max_retries}
                )
            return

        if isinstance(exception, Retry) and exception.delay is not None:
            delay = exception.delay
        else:
            min_backoff = message.options.get(
                "min_backoff", actor.options.get("min_backoff", self.min_backoff)
            )
            max_backoff = message.options.get(
                "max_backoff", actor.options.get("max_backoff", self.max_backoff)
            )
            max_backoff = min(max_backoff, DEFAULT_MAX_BACKOFF)
            if self.jitter:
                _, delay = compute_backoff(retries, factor=min_backoff, max_backoff=max_backoff)
            else:
                delay = backoff_ms(attempt, min_backoff, max_backoff)
        logger.info("Retrying message %r in %d milliseconds.", message.message_id, delay)
        broker.reschedule(message, delay, describe_error(message))
