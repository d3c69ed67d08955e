"""``POST /api/queues/{name}/pause`` and ``POST /api/queues/{name}/resume``: an operator
stops every worker claiming a queue's jobs, and lets them again (see
:mod:`dramatiq_pg_broker.queues`). The queue list with its pause state is
``GET /api/queues`` (:mod:`.dashboard`)."""

from __future__ import annotations

import falcon

from dramatiq_pg_broker import queues as queue_control
from dramatiq_pg_broker.jobs import JobStore

from ..auth import OPERATORS
from ..validation import check_name, read_optional_body, read_query
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
