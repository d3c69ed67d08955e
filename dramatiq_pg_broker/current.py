"""The current job, for actors: renew the lease, report progress.

::

    from dramatiq_pg_broker import current_job

    @dramatiq.actor(heartbeat=False)      # no automatic lease renewal for this actor
    def export(report_id):
        job = current_job()
        for i, chunk in enumerate(chunks(report_id)):
            write(chunk)
            job.progress({"done": i + 1})   # a `progress` event; renews the lease too
            job.renew()                     # or just renew (a `lease_renewed` event)

Both return False when the worker no longer owns the attempt (its lease expired and another
worker took the job): the actor may then stop, since its outcome will be discarded.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

from dramatiq.middleware import Middleware

from .consumer import PgMessageProxy

if TYPE_CHECKING:
    from .broker import PostgresBroker

#: A context variable, not a thread-local: async actors run on Dramatiq's event loop thread,
#: and the coroutine inherits the worker thread's context (as Dramatiq's CurrentMessage does).
_current: contextvars.ContextVar[CurrentJob | None] = contextvars.ContextVar(
    "dramatiq_pg_broker_current_job", default=None
)


class CurrentJob:
    """The job row behind the message an actor is running."""

    def __init__(self, broker: PostgresBroker, message: PgMessageProxy) -> None:
        self.broker = broker
        self.message = message

    @property
    def id(self) -> str:
        return self.message.attempt.id

    @property
    def attempt(self) -> int:
        """This attempt's number, from 1."""
        return self.message.attempt.attempt

    def renew(self, lease_seconds: float | None = None) -> bool:
        """Extend this attempt's lease (default: the broker's lease length) and record a
        ``lease_renewed`` event. Returns False if the attempt is no longer owned."""
        seconds = lease_seconds or self.broker.settings.lease_seconds
        owned = self.broker.store.renew([self.message.attempt], seconds, record=True)
        return self.id in owned

    def progress(self, data: Any, *, lease_seconds: float | None = None) -> bool:
        """Record a ``progress`` event with ``data`` (anything JSON can hold) and renew the
        lease. Returns False if the attempt is no longer owned."""
        seconds = lease_seconds or self.broker.settings.lease_seconds
        return self.broker.store.progress(self.message.attempt, data, seconds)


def current_job() -> CurrentJob | None:
    """The job of the message this thread is processing, or None outside an actor (or for
    a message that did not come from a PostgresBroker)."""
    return _current.get()


class JobContext(Middleware):
    """Makes :func:`current_job` work, and declares the ``heartbeat`` actor option
    (``heartbeat=False`` turns automatic lease renewal off for an actor)."""

    @property
    def actor_options(self) -> set[str]:
        return {"heartbeat"}

    def before_process_message(self, broker, message) -> None:
        if isinstance(message, PgMessageProxy):
            _current.set(CurrentJob(broker, message))
            actor = broker.actors.get(message.actor_name)
            if actor is not None and actor.options.get("heartbeat") is False:
                broker.leases.started_without_heartbeat(message.attempt)

    def after_process_message(self, broker, message, *, result=None, exception=None) -> None:
        _current.set(None)

    after_skip_message = after_process_message
