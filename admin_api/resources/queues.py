"""``POST /api/queues/{name}/pause`` and ``POST /api/queues/{name}/resume``: an operator
stops every worker claiming a queue's jobs, and lets them again (see
:mod:`dramatiq_pg_broker.control.queues`). ``PUT /api/queues/{name}/limit``: at most N of its
jobs run at a time across every worker, or no limit (see :mod:`dramatiq_pg_broker.control.limits`).
The queue list with its pause state and limit is ``GET /api/queues`` (:mod:`.dashboard`)."""

from __future__ import annotations

import falcon
from pydantic import Field

from dramatiq_pg_broker import queues as queue_control
from dramatiq_pg_broker.control import limits as queue_limits
from dramatiq_pg_broker.jobs import JobStore
from dramatiq_pg_broker.queue_rules import MAX_LIMIT

from ..auth import OPERATORS
from ..validation import Body, check_name, read_body, read_optional_body, read_query
from .jobs import ActionRequest


class QueueAction:
    """Pause or resume one queue a worker declared (404 for another name, 400 for a name
    no queue can have). Pausing a paused queue, or resuming an active one, changes nothing
    and answers 200 with its state.

    Parameters:
      store(JobStore): whose pool and schema to use.
      action(str): ``pause`` or ``resume``.
    """

    permissions = {"POST": OPERATORS}

    def __init__(self, store: JobStore, action: str) -> None:
        self.store = store
        self.action = getattr(queue_control, action)

    def on_post(self, req: falcon.Request, resp: falcon.Response, queue_name: str) -> None:
        read_query(req)
        # A name with a line break at its end would pass the queue-name pattern's "$": said
        # here, as for the names of a new job, instead of a 404 for a queue that looks real.
        check_name("queue name", queue_name)
        read_optional_body(req, ActionRequest)
        with self.store.pool.connection() as conn:
            state = self.action(conn, self.store.schema, queue_name, by=req.context.user.email)
        resp.media = state.as_dict()


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

    permissions = {"PUT": OPERATORS}

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def on_put(self, req: falcon.Request, resp: falcon.Response, queue_name: str) -> None:
        read_query(req)
        check_name("queue name", queue_name)
        body = read_body(req, LimitRequest)
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
