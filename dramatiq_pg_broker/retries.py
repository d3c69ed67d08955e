"""Retries that reschedule the same job row.

:class:`Retries` is Dramatiq's own middleware of the same name, extended: Dramatiq's
``after_process_message`` decides (``max_retries``, ``retry_when``, ``throws``,
``on_retry_exhausted``, ``Retry(delay=...)``) and sets ``options["retries"]``,
``options["traceback"]`` and ``options["requeue_timestamp"]`` as it always does; its
re-enqueue of the message reaches :meth:`PostgresBroker.enqueue`, which moves the same row
back to ``queued`` with ``available_at = now + backoff`` and a ``retry_scheduled`` event,
instead of adding a copy.

An aborted job is never retried: an actor stopped by an abort fails its message at once.
The broker's own abort (:class:`~.errors.JobAborted`) ends the job ``cancelled``;
dramatiq-abort's ``Abort`` ends it ``failed``, with that error, as its middleware
intends.

``options["retries"]`` counts the job's failed attempts (an exception or a time limit),
from the row; interruptions (a worker that died, a lost lease, a shutdown) are not retries.
Backoff is deterministic, from :func:`~.backoff.backoff_ms`:
``min(min_backoff * 2 ** (failures - 1), max_backoff)`` milliseconds; set ``jitter=True``
for Dramatiq's randomised backoff instead.
"""

from __future__ import annotations

import logging
import sys

import dramatiq
from dramatiq.broker import MessageProxy
from dramatiq.errors import Retry
from dramatiq.middleware import Callbacks
from dramatiq.middleware.retries import DEFAULT_MAX_BACKOFF
from dramatiq.middleware.retries import Retries as DramatiqRetries

from .backoff import backoff_ms
from .consumer import PgMessageProxy
from .errors import JobAborted, JobInterrupted
from .jobs import ReapedJob
from .messages import max_retries_of

__all__ = ["Retries", "backoff_ms", "end_reaped_job"]

logger = logging.getLogger(__name__)


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

    def after_process_message(self, broker, message, *, result=None, exception=None):
        if exception is not None and _aborted(broker, message, exception):
            # An operator aborted the job: it is never retried (the ledger ends it
            # cancelled), nor reported as out of retries.
            message.fail()
            return
        if (
            exception is not None
            and isinstance(message, PgMessageProxy)
            and not self.jitter
            and not (isinstance(exception, Retry) and exception.delay is not None)
        ):
            # Dramatiq decides whether to retry; the delay of a retry comes from the one
            # backoff function (Dramatiq's own is randomised).
            message.backoff_ms = self._backoff_ms(broker, message)
        super().after_process_message(broker, message, result=result, exception=exception)

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
