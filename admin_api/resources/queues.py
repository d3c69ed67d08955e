"""``POST /api/queues/{name}/pause`` and ``POST /api/queues/{name}/resume``: an operator
stops every worker claiming a queue's jobs, and lets them again (see
:mod:`dramatiq_pg_broker.control.queues`). ``PUT /api/queues/{name}/limit``: at most N of its
jobs run at a time across every worker, or no limit (see :mod:`dramatiq_pg_broker.control.limits`).
The queue list with its pause state and limit is ``GET /api/queues`` (:mod:`.dashboard`)."""

from __future__ import annotations

import falcon
from pydantic import Field

from dramatiq_pg_broker.control import limits as queue_limits
from dramatiq_pg_broker.control import queues as queue_control
from dramatiq_pg_broker.jobs import JobStore
from dramatiq_pg_broker.queue_rules import MAX_LIMIT

from .. import responses
from ..auth import OPERATORS
from ..operations import operation
from ..validation import Body
from .jobs import action

#: The 404 of an operation on a queue.
UNDECLARED = "No worker has declared this queue."


class QueueAction:
    """Pause or resume one queue a worker declared (404 for another name, 400 for a name
    no queue can have). Pausing a paused queue, or resuming an active one, changes nothing
    and answers 200 with its state. Each subclass declares its ``on_post``: :meth:`act`
    with its :func:`~.jobs.action`.

    Parameters:
      store(JobStore): whose pool and schema to use.
    """

    #: The function of :mod:`dramatiq_pg_broker.control.queues`: ``pause`` or ``resume``.
    change: str

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def act(self, req: falcon.Request, resp: falcon.Response, queue_name: str, body) -> None:
        change = getattr(queue_control, self.change)
        with self.store.pool.connection() as conn:
            state = change(conn, self.store.schema, queue_name, by=req.context.user.email)
        resp.media = state.as_dict()


class PauseQueue(QueueAction):
    """``POST /api/queues/{name}/pause``."""

    route = "/api/queues/{queue_name}/pause"
    change = "pause"
    on_post = action(
        "Pause a queue: no worker on any host claims its jobs from now on; sends are still "
        "accepted; the pause survives worker restarts.",
        {200: (responses.QueueState, "The queue, paused."), 404: UNDECLARED},
        description="Its workers give back the messages they prefetched and had not started; "
        "running jobs finish. Pausing a paused queue changes nothing.",
    )(QueueAction.act)


class ResumeQueue(QueueAction):
    """``POST /api/queues/{name}/resume``."""

    route = "/api/queues/{queue_name}/resume"
    change = "resume"
    on_post = action(
        "Resume a paused queue: its workers claim its jobs at once.",
        {200: (responses.QueueState, "The queue, active."), 404: UNDECLARED},
    )(QueueAction.act)


class LimitRequest(Body):
    """The body of ``PUT /api/queues/{name}/limit``: ``{"limit": N}`` or
    ``{"limit": null}``."""

    limit: int | None = Field(
        ge=1,
        le=MAX_LIMIT,
        description="At most this many jobs of the queue run at a time, across every worker "
        "on every host; null lifts the limit.",
    )


class QueueLimit:
    """Set or lift the limit of one queue a worker declared (404 for another name, 400 for
    a name no queue can have or a body that is not ``{"limit": N}`` or
    ``{"limit": null}``). Answers 200 with the queue's limit (``limit`` null: none), in
    force from the next claim of every worker.

    Parameters:
      store(JobStore): whose pool and schema to use.
    """

    route = "/api/queues/{queue_name}/limit"

    def __init__(self, store: JobStore) -> None:
        self.store = store

    @operation(
        roles=OPERATORS,
        summary="Limit a queue: at most N of its jobs run at a time, across every worker on "
        "every host; null lifts the limit.",
        description="In force from the next claim of every worker; jobs already running beyond "
        "a lowered limit finish. An operator's limit wins over the queue_limits setting "
        "workers boot with. A job counts as running from its claim until its outcome is "
        "written, or, if its worker died, until the reaper takes it back.",
        body=LimitRequest,
        responses={200: (responses.QueueLimit, "The queue's limit now."), 404: UNDECLARED},
    )
    def on_put(
        self, req: falcon.Request, resp: falcon.Response, queue_name: str, body: LimitRequest
    ) -> None:
        with self.store.pool.connection() as conn:
            limit = queue_limits.set_limit(
                conn, self.store.schema, queue_name, body.limit, by=req.context.user.email
            )
        resp.media = limit_view(queue_name, limit)


def limit_view(queue_name: str, limit: queue_limits.QueueLimit | None) -> dict:
    """A queue's limit as the API shows it (every field but the name null when it has
    none)."""
    if limit is None:
        return {
            "queue_name": queue_name,
            "limit": None,
            "source": None,
            "set_by": None,
            "set_at": None,
        }
    return limit.as_dict()
