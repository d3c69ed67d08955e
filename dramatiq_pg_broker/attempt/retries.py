"""Retries that reschedule the same job row.

:class:`Retries` is Dramatiq's own middleware of the same name, extended: Dramatiq's
``after_process_message`` decides (``max_retries``, ``retry_when``, ``throws``,
``on_retry_exhausted``, ``Retry(delay=...)``), computes the delay, logs it and sets
``options["retries"]``, ``options["traceback"]`` and ``options["requeue_timestamp"]`` as it
always does; its re-enqueue of the message reaches :meth:`PostgresBroker.enqueue`, which
moves the same row back to ``queued`` with ``available_at = now + delay`` and a
``retry_scheduled`` event, instead of adding a copy. The delay the row waits is the one
the log line states.

An aborted job is never retried: an actor stopped by an abort fails its message at once.
The broker's own abort (:class:`~.errors.JobAborted`) ends the job ``cancelled``;
dramatiq-abort's ``Abort`` ends it ``failed``, with that error, as its middleware
intends.

``options["retries"]`` counts the job's failed attempts (an exception or a time limit),
from the row; interruptions (a worker that died, a lost lease, a shutdown) are not retries.

Backoff is Dramatiq's by default: ``min_backoff * 2 ** retries`` stretched by a random
factor between 1 and 2 (and, past ``max_backoff``, between half of it and all of it), so
that jobs that failed together (one outage of a service they call) do not all retry at the
same instant. ``jitter=False`` gives the deterministic
``min(min_backoff * 2 ** retries, max_backoff)`` of :func:`~.backoff.backoff_ms` instead.

``max_retries`` defaults to the broker's ``max_attempts`` setting minus one
(``DRAMATIQ_PG_MAX_ATTEMPTS``, 21 attempts unless set), the same default the admin API
gives the jobs it creates (:func:`~.messages.default_max_retries`).
"""

from __future__ import annotations

import contextvars
import logging
import sys
from typing import Any

import dramatiq
from dramatiq.broker import MessageProxy
from dramatiq.errors import Retry
from dramatiq.middleware import Callbacks
from dramatiq.middleware.retries import DEFAULT_MAX_BACKOFF
from dramatiq.middleware.retries import Retries as DramatiqRetries

from ..backoff import backoff_ms
from ..config import Settings
from ..errors import JobAborted, JobInterrupted
from ..jobs.rows import ReapedJob
from ..sending.messages import default_max_retries, max_retries_of
from .claiming import PgMessageProxy

__all__ = ["Retries", "backoff_ms", "end_reaped_job"]

logger = logging.getLogger("dramatiq_pg_broker.retries")

#: The line Dramatiq's Retries logs for a retry it schedules.
RETRYING_LINE = "Retrying message %r in %d milliseconds."

_FROM_SETTINGS: Any = object()

#: The deterministic delay of the retry being decided in this thread (``jitter=False``).
_applied_delay: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "dramatiq_pg_broker_retry_delay", default=None
)


class _AppliedDelay(logging.Filter):
    """Dramatiq's Retries logs the delay it computed. With ``jitter=False`` the row waits
    the deterministic backoff instead, and the log line states that one.

    A filter on the middleware's logger, not an adapter around it: Dramatiq's Retries then
    still calls ``Logger.info`` and ``Logger.warning`` themselves, which is what code (and
    Dramatiq's own tests) that watch a logger's calls see."""

    def filter(self, record: logging.LogRecord) -> bool:
        delay = _applied_delay.get()
        args = record.args
        if delay is not None and record.msg == RETRYING_LINE and isinstance(args, tuple):
            if len(args) == 2:
                record.args = (args[0], delay)
        return True


_APPLIED_DELAY = _AppliedDelay()


class Retries(DramatiqRetries):
    """Dramatiq's Retries, rescheduling the job row instead of enqueueing a copy.

    Parameters:
      max_retries(int): retries of actors that set none (attempts = retries + 1).
        Default: the broker's ``max_attempts`` setting minus one. Given here, it wins in
        this process: the admin API, which has no middleware, still uses the setting.
      min_backoff(int): first delay in milliseconds (default: the broker's backoff base).
      max_backoff(int): longest delay in milliseconds (default: the broker's maximum).
      retry_when(callable): ``(retries, exception) -> bool``; overrides ``max_retries``.
      jitter(bool): Dramatiq's randomised backoff (the default); False for the
        deterministic one.
    """

    def __init__(
        self,
        *,
        max_retries=_FROM_SETTINGS,
        min_backoff=None,
        max_backoff=None,
        retry_when=None,
        jitter: bool = True,
    ):
        self._explicit = {
            "max_retries": max_retries is not _FROM_SETTINGS,
            "min_backoff": min_backoff is not None,
            "max_backoff": max_backoff is not None,
        }
        if max_retries is _FROM_SETTINGS:
            max_retries = Settings.max_attempts - 1  # until configure() gives the broker's
        super().__init__(
            max_retries=max_retries,
            min_backoff=min_backoff,
            max_backoff=max_backoff,
            retry_when=retry_when,
        )
        if _APPLIED_DELAY not in self.logger.filters:
            self.logger.addFilter(_APPLIED_DELAY)
        self.jitter = jitter

    def configure(self, settings: Settings) -> None:
        """Take the broker's settings for what the constructor was not given:
        ``max_retries`` (``max_attempts - 1``) and the backoff base and maximum."""
        if not self._explicit["max_retries"]:
            self.max_retries = default_max_retries(settings)
        if not self._explicit["min_backoff"]:
            self.min_backoff = settings.backoff_base_ms
        if not self._explicit["max_backoff"]:
            self.max_backoff = settings.backoff_max_ms

    def after_process_message(self, broker, message, *, result=None, exception=None):
        if exception is not None and _aborted(broker, message, exception):
            # An operator aborted the job: it is never retried (the ledger ends it
            # cancelled), nor reported as out of retries.
            message.fail()
            return
        if (
            exception is None
            or self.jitter
            or not isinstance(message, PgMessageProxy)
            or (isinstance(exception, Retry) and exception.delay is not None)
        ):
            super().after_process_message(broker, message, result=result, exception=exception)
            return
        # Dramatiq decides whether to retry; the delay comes from the one backoff function,
        # and Dramatiq's log line states it.
        message.backoff_ms = delay = self._backoff_ms(broker, message)
        token = _applied_delay.set(delay)
        try:
            super().after_process_message(broker, message, result=result, exception=exception)
        finally:
            _applied_delay.reset(token)

    def _backoff_ms(self, broker, message) -> int:
        actor = broker.get_actor(message.actor_name)
        options = message.options
        min_backoff = options.get("min_backoff", actor.options.get("min_backoff", self.min_backoff))
        max_backoff = options.get("max_backoff", actor.options.get("max_backoff", self.max_backoff))
        failures = options.get("retries", 0) + 1
        return backoff_ms(failures, min_backoff, min(max_backoff, DEFAULT_MAX_BACKOFF))


def _aborted(broker, message, exception: BaseException) -> bool:
    """Whether the attempt ended because of an abort: the broker's own (JobAborted, or an
    abort that reached an actor declared ``interrupt_on_abort=False``), or dramatiq-abort's
    ``Abort`` when that package is in use."""
    if isinstance(exception, JobAborted):
        return True
    abort_package = sys.modules.get("dramatiq_abort")
    if abort_package is not None and isinstance(exception, abort_package.Abort):
        return True
    ledger = getattr(broker, "ledger", None)
    return (
        ledger is not None
        and isinstance(message, PgMessageProxy)
        and ledger.abort_requested(message.attempt)
    )


def retries_exhausted(
    retries_middleware: DramatiqRetries, broker, message: MessageProxy, retries: int
) -> None:
    """A job ended failed without its actor's exception deciding it (the reaper failed
    it): send ``on_retry_exhausted`` as Dramatiq's Retries does after the last retry."""
    actor = broker.get_actor(message.actor_name)
    target = message.options.get("on_retry_exhausted") or actor.options.get("on_retry_exhausted")
    if target:
        max_retries = max_retries_of(message.options, actor.options, retries_middleware.max_retries)
        broker.get_actor(target).send(
            message.asdict(), {"retries": retries, "max_retries": max_retries}
        )


def end_reaped_job(broker: dramatiq.Broker, job: ReapedJob) -> None:
    """A job the reaper failed ends, for its callers, like one whose actor raised: in this
    (the reaping) process, Dramatiq's ``on_retry_exhausted``, the ``on_failure`` callbacks
    and the ``after_nack`` hooks (the Results middleware stores the failure, so a waiting
    ``get_result(block=True)`` raises) run through the broker's middleware."""
    if job.actor_name not in broker.actors:
        logger.warning(
            "Job %s failed (%s); its actor %r is not declared in this process, so no "
            "failure hooks ran here.",
            job.id,
            job.error,
            job.actor_name,
        )
        return
    try:
        message = MessageProxy(broker.decode_message(job.message, job.message_bytes))
        message.options["retries"] = job.failures
        exception = JobInterrupted(job.error)
        message.stuff_exception(exception)
        message.fail()
        for middleware in broker.middleware:
            if isinstance(middleware, DramatiqRetries):
                retries_exhausted(middleware, broker, message, job.failures)
            elif isinstance(middleware, Callbacks):
                middleware.after_process_message(broker, message, exception=exception)
        broker.emit_before("nack", message)
        broker.emit_after("nack", message)
    except Exception:
        logger.exception("The failure hooks of job %s could not run.", job.id)
