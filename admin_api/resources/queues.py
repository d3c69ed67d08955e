"""One queue. ``GET /api/queues/{name}``: the queue as the CLI's ``queues show`` shows it
(see :mod:`dramatiq_pg_broker.control.overview`). ``POST /api/queues/{name}/pause`` and
``POST /api/queues/{name}/resume``: an operator stops every worker claiming a queue's jobs,
and lets them again (see :mod:`dramatiq_pg_broker.control.queues`).
``PUT /api/queues/{name}/limit``: at most N of its jobs run at a time across every worker,
or no limit (see :mod:`dramatiq_pg_broker.control.limits`).
``POST /api/queues/{name}/requeue-expired``: its jobs whose lease expired go back to the
queue now. The queue list is ``GET /api/queues`` (:mod:`.dashboard`)."""

from __future__ import annotations

import falcon
from pydantic import Field

from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.control import limits as queue_limits
from dramatiq_pg_broker.control import queues as queue_control
from dramatiq_pg_broker.errors import QueueNotDeclared
from dramatiq_pg_broker.jobs import JobStore
from dramatiq_pg_broker.queue_rules import MAX_LIMIT, check_queue_name

from .. import responses
from ..auth import OBSERVERS, OPERATORS
from ..monitoring import Monitor
from ..operations import operation
from ..validation import Body
from .jobs import action

#: The 404 of an operation on a queue.
UNDECLARED = "No worker has declared this queue."


class QueueDetail:
    """``GET /api/queues/{name}``: one queue as ``GET /api/queues`` lists it, with its last
    hour's throughput (succeeded and failed per minute). 404 for a queue that is unknown
    (no worker declared it, and it has no unfinished or failed job nor a limit).

    Parameters:
      monitor(Monitor): the monitoring reads.
    """

    route = "/api/queues/{queue_name}"

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    @operation(
        roles=OBSERVERS,
        summary="One queue: its state, its jobs in each state, its pause and its limit (and "
        "who set them), its live workers, why its jobs wait, and the last hour's succeeded "
        "and failed jobs per minute.",
        responses={
            200: (responses.QueueDetail, "The queue."),
            404: "No worker declared the queue, and it has no unfinished or failed job nor a "
            "limit.",
        },
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response, queue_name: str) -> None:
        check_queue_name(queue_name)
        queue = self.monitor.queue(queue_name)
        if queue is None:
            raise QueueNotDeclared(
                f"{queue_control.not_declared(queue_name)} (and it has no unfinished or failed "
                "job, nor a limit)"
            )
        resp.media = {**queue.as_dict(), "throughput": self.monitor.queue_throughput(queue_name)}


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


class RequeueExpired:
    """``POST /api/queues/{name}/requeue-expired``: every job of a queue a worker declared
    whose lease expired goes back to the queue now, through the reaper's own transition
    (:meth:`dramatiq_pg_broker.jobs.JobStore.requeue_expired`); a job whose worker still
    holds its lease is never taken. Answers the ids requeued, failed (interruptions at
    their bound) and cancelled (abort requested). 404 for a queue no worker declared.

    Parameters:
      store(JobStore): the state machine.
      settings(Settings): the interruption bound and the lease the reaper goes by.
    """

    route = "/api/queues/{queue_name}/requeue-expired"

    def __init__(self, store: JobStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings

    @action(
        "Put every job of the queue whose lease expired back in the queue now.",
        {200: (responses.RequeuedJobs, "What was done with each job taken."), 404: UNDECLARED},
        description="The reaper's own transition, as for one job "
        "(POST /api/jobs/{job_id}/requeue); a job whose worker holds its lease is never taken.",
    )
    def on_post(self, req: falcon.Request, resp: falcon.Response, queue_name: str, body) -> None:
        check_queue_name(queue_name)
        with self.store.pool.connection() as conn:
            if not queue_control.is_declared(conn, self.store.schema, queue_name):
                raise QueueNotDeclared(queue_control.not_declared(queue_name))
        result = self.store.requeue_expired(
            settings=self.settings, queue_name=queue_name, by=req.context.user.email
        )
        resp.media = {
            "queue_name": queue_name,
            "requeued": result.requeued + result.released,
            "failed": result.failed,
            "cancelled": result.aborted,
        }
