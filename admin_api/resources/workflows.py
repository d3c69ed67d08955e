"""Workflows. ``GET /api/workflows`` (newest first; ``job=`` finds the workflow a job
belongs to) and ``GET /api/workflows/{id}`` (its status and every step with its job's id
and state); ``POST /api/workflows/{id}/abort`` and ``POST /api/workflows/{id}/retry``, the
operator's transitions of :class:`~dramatiq_pg_broker.workflows.WorkflowStore` (an abort
ends each running step's job through the job store's own abort). Members see only the
workflows they created (``created_by``: their user id)."""

from __future__ import annotations

from typing import Literal

import falcon
from pydantic import Field

from dramatiq_pg_broker.errors import WorkflowNotFound
from dramatiq_pg_broker.jobs import JobStore
from dramatiq_pg_broker.workflows import STATUSES, WorkflowStore

from .. import responses
from ..auth import READERS, owner_scope
from ..operations import operation
from ..validation import Params, QueryInt, QueryUuid
from .jobs import action

#: The 404 of an operation on one workflow.
NO_WORKFLOW = "No workflow has this id (or, for a member, they did not create it)."
MAX_LIMIT = 100


class WorkflowListParams(Params):
    """The filters of ``GET /api/workflows``."""

    limit: QueryInt = Field(25, ge=1, le=MAX_LIMIT, description="Page size.")
    status: Literal[STATUSES] = Field(None, description="running, succeeded, failed or cancelled.")
    job: QueryUuid = Field(None, description="Only the workflow this job is a step of.")


def _creator(req: falcon.Request) -> str | None:
    owner = owner_scope(req.context.user)
    return None if owner is None else str(owner)


class WorkflowList:
    """``GET /api/workflows``."""

    route = "/api/workflows"

    def __init__(self, store: JobStore) -> None:
        self.workflows = WorkflowStore(store.pool, store.schema)

    @operation(
        roles=READERS,
        scope="members: the workflows they created",
        summary="List workflows, newest first, with how many of their steps are in each status.",
        query=WorkflowListParams,
        responses={200: (responses.WorkflowPage, "The workflows.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response, query: WorkflowListParams):
        creator = _creator(req)
        if query.job is not None:
            found = self.workflows.workflow_of_job(query.job)
            rows = []
            if found is not None:
                rows = [
                    w
                    for w in self.workflows.list(created_by=creator, limit=MAX_LIMIT)
                    if w["id"] == found[0]
                ] or self._one(found[0], creator)
            resp.media = {"results": rows}
            return
        rows = self.workflows.list(status=query.status, created_by=creator, limit=query.limit)
        resp.media = {"results": rows}

    def _one(self, workflow_id: str, creator: str | None) -> list[dict]:
        try:
            flow = self.workflows.get(workflow_id, created_by=creator)
        except WorkflowNotFound:
            return []
        steps = dict.fromkeys(("pending", "running", "succeeded", "failed", "cancelled"), 0)
        for node in flow["nodes"]:
            steps[node["status"]] += 1
        keys = ("id", "name", "status", "created_by", "created_at", "updated_at")
        return [
            {
                **{k: flow[k] for k in keys},
                "finished_at": flow["finished_at"],
                "error": flow["error"],
                "nodes": len(flow["nodes"]),
                "steps": steps,
            }
        ]


class WorkflowDetail:
    """``GET /api/workflows/{id}``."""

    route = "/api/workflows/{workflow_id}"

    def __init__(self, store: JobStore) -> None:
        self.workflows = WorkflowStore(store.pool, store.schema)

    @operation(
        roles=READERS,
        scope="members: the workflows they created",
        summary="One workflow: its status and every step in order, with its job's id and state.",
        responses={200: (responses.WorkflowDetail, "The workflow."), 404: NO_WORKFLOW},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response, workflow_id: str) -> None:
        resp.media = self.workflows.get(workflow_id, created_by=_creator(req))


class WorkflowTransition:
    """An operator's transition of one workflow; 409 for a workflow in another status."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.workflows = WorkflowStore(store.pool, store.schema)


class AbortWorkflow(WorkflowTransition):
    """``POST /api/workflows/{id}/abort``."""

    route = "/api/workflows/{workflow_id}/abort"

    @action(
        "Cancel a running workflow: its steps that have not started never will, its queued "
        "jobs are cancelled and its running ones aborted (they end cancelled).",
        {
            200: (responses.WorkflowDetail, "The workflow, cancelled."),
            404: NO_WORKFLOW,
            409: "The workflow is not running.",
        },
    )
    def on_post(self, req: falcon.Request, resp: falcon.Response, workflow_id: str, body):
        resp.media = self.workflows.abort(workflow_id, self.store, by=req.context.user.email)


class RetryWorkflow(WorkflowTransition):
    """``POST /api/workflows/{id}/retry``."""

    route = "/api/workflows/{workflow_id}/retry"

    @action(
        "Run a failed or cancelled workflow again from its failed and cancelled steps; "
        "what succeeded is kept.",
        {
            200: (responses.WorkflowDetail, "The workflow, running again."),
            404: NO_WORKFLOW,
            409: "The workflow is running or succeeded, or jobs its abort interrupted are "
            "still stopping.",
        },
    )
    def on_post(self, req: falcon.Request, resp: falcon.Response, workflow_id: str, body):
        resp.media = self.workflows.retry(workflow_id)
