"""Workflows' rows: create, spawn, pass results on, read, and the operator's abort and
retry. Each change of a job goes through the job store's transitions; the workflow moves
on in the database, in the transaction that ends each of its jobs (migration 0025)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

import dramatiq
import psycopg
from psycopg.types.json import Jsonb

from ..db.core import ProcessPool, read_committed
from ..db.queries import statements_for
from ..errors import (
    AmbiguousJobId,
    InvalidJobId,
    InvalidMessage,
    InvalidTransition,
    JobBusy,
    JobNotFound,
    WorkflowInvalidTransition,
    WorkflowNotFound,
    WorkflowStillStopping,
)
from ..jobs.rows import NewJob, channel_name
from ..sending import messages
from .building import NODE_OPTION, Node

#: The statuses of a workflow, and of each of its nodes (a node is also ``pending``).
STATUSES = ("running", "succeeded", "failed", "cancelled")
NODE_STATUSES = ("pending", "running", "succeeded", "failed", "cancelled")

_HEX_PREFIX = re.compile(r"[0-9a-f-]{8,36}")

#: Why a workflow whose messages were sent already is refused (also building.Workflow.run).
SENT_ALREADY = (
    "a message of this workflow was sent already (a Workflow run a second time?): each "
    "message is one job and runs once; build the steps' messages again (actor.message(...)) "
    "to run the workflow again. Nothing was stored"
)


class WorkflowStore:
    """The workflows of one schema.

    Parameters:
      pool(ProcessPool): the broker's (or the admin API's) pool.
      schema(str): the broker's schema.
    """

    def __init__(self, pool: ProcessPool, schema: str) -> None:
        self.pool = pool
        self.schema = schema
        self.queries = statements_for(schema, "workflows.sql")

    def _fetch(self, name: str, params: dict[str, Any], conn) -> list[tuple]:
        return conn.execute(self.queries[name], params).fetchall()

    def _node_row(self, workflow_id: str, node: Node, job: NewJob, parent: str | None) -> dict:
        return {
            "id": node.id,
            "workflow_id": workflow_id,
            "step": node.step,
            "position": node.position,
            "parent_id": parent,
            "waits_for": len(node.waits_for),
            "dependents": node.dependents,
            "job_id": job.id,
            "queue_name": job.queue_name,
            "actor_name": job.actor_name,
            "message": None if job.message is None else Jsonb(job.message),
            "message_bytes": job.message_bytes,
            "priority": job.priority,
            "max_attempts": job.max_attempts,
            "channel": channel_name(self.schema, job.queue_name),
            "input": None if node.input is None else Jsonb(node.input),
        }

    # -- running ----------------------------------------------------------------------

    def create(
        self,
        workflow_id: str,
        nodes: Sequence[tuple[Node, NewJob]],
        remaining: int,
        *,
        name: str | None = None,
        created_by: str | None = None,
        conn=None,
    ) -> list[str]:
        """Store a workflow and its nodes, and send the jobs of the nodes that wait for
        none, in one transaction (on ``conn``, the application's, when given: then they
        commit or roll back with it). Returns the nodes started.

        Raises:
          InvalidMessage: a job of the first step's messages is stored already (the same
            messages run twice at once, or again while the first run's first step is
            unfinished): a node whose job exists would never start.
        """
        if conn is None:
            with self.pool.connection() as own:
                return self.create(
                    workflow_id, nodes, remaining, name=name, created_by=created_by, conn=own
                )
        with conn.transaction():
            conn.execute(
                self.queries["insert_workflow"],
                {
                    "id": workflow_id,
                    "name": name,
                    "remaining": remaining,
                    "created_by": created_by,
                },
            )
            with conn.cursor() as cur:
                cur.executemany(
                    self.queries["insert_node"],
                    [self._node_row(workflow_id, node, job, None) for node, job in nodes],
                )
            conn.execute(self.queries["insert_waits"], {"id": workflow_id})
            first = [node.id for node, _ in nodes if not node.waits_for]
            try:
                started = [str(r[0]) for r in self._fetch("start_nodes", {"ids": first}, conn)]
            except psycopg.errors.UniqueViolation as e:
                # A run of the same messages at once, whose jobs went in first.
                raise InvalidMessage(SENT_ALREADY) from e
            if len(started) < len(first):
                # The same messages' jobs, committed before this start looked: a node whose
                # job is in jobs already is not started (and never would be).
                raise InvalidMessage(SENT_ALREADY)
            return started

    def spawn(self, parent: str, children: Sequence[tuple[Node, NewJob]]) -> list[str]:
        """Add ``children`` to node ``parent`` (whose actor runs) and send their jobs, in
        one transaction; a child already added (the same id, by an earlier attempt of the
        same actor) is left as it is. Returns the children added.

        Raises:
          WorkflowInvalidTransition: the node's part of its workflow is over.
        """
        with self.pool.connection() as conn, conn.transaction():
            rows = self._fetch("lock_spawning_node", {"id": parent}, conn)
            if not rows:
                raise WorkflowInvalidTransition(parent, "ended", "spawned from", "running")
            workflow_id, step, _, last = rows[0]
            added = []
            for offset, (node, job) in enumerate(children, start=1):
                node.step = step
                node.position = last + offset
                row = self._node_row(str(workflow_id), node, job, parent)
                if self._fetch("insert_node", row, conn):
                    added.append(node.id)
            if added:
                conn.execute(self.queries["add_children"], {"id": parent, "count": len(added)})
                self._fetch("start_nodes", {"ids": added}, conn)
            return added

    def node_input(self, node_id: str) -> tuple[Any, dict[str, bytes]]:
        """A node's input spec, and the stored results of the nodes it names, by node id
        (one statement)."""
        with self.pool.connection() as conn:
            rows = self._fetch("node_input", {"id": node_id}, conn)
        if not rows:
            return None, {}
        spec, ids, results = rows[0]
        return spec, {i: r for i, r in zip(ids or (), results or ()) if i is not None}

    def node_inputs(self, node_ids: Sequence[str]) -> dict[str, tuple[Any, dict[str, bytes]]]:
        """:meth:`node_input` of several nodes in one statement, by node id (a node that
        does not exist is left out)."""
        with self.pool.connection() as conn:
            rows = self._fetch("node_inputs", {"ids": list(node_ids)}, conn)
        return {
            node: (spec, {i: r for i, r in zip(ids or (), results or ()) if i is not None})
            for node, spec, ids, results in rows
        }

    def result_wanted(self, node_id: str) -> bool:
        """Whether a step after node ``node_id`` takes its result as input."""
        with self.pool.connection() as conn:
            return bool(self._fetch("node_result_wanted", {"id": node_id}, conn)[0][0])

    def store_result(self, node_id: str, job_id: str, result: bytes | None) -> None:
        with self.pool.connection() as conn:
            conn.execute(
                self.queries["store_node_result"],
                {"id": node_id, "job_id": job_id, "result": result},
            )

    # -- reading ------------------------------------------------------------------------

    def resolve(self, workflow_id: str) -> str:
        """The full id of a workflow given by its id or its first 8 (or more) characters.

        Raises:
          InvalidJobId: not a UUID nor the start of one.
          WorkflowNotFound, AmbiguousJobId.
        """
        text = str(workflow_id).strip().lower()
        try:
            return str(uuid.UUID(text))
        except ValueError:
            pass
        if not _HEX_PREFIX.fullmatch(text):
            raise InvalidJobId(
                f"{workflow_id!r} is not a workflow id: give its UUID or its first 8 "
                "characters at least"
            )
        with self.pool.connection() as conn:
            rows = self._fetch("find_workflow", {"prefix": text}, conn)
        if not rows:
            raise WorkflowNotFound(f"no workflow has an id starting with {text}")
        if len(rows) > 1:
            raise AmbiguousJobId(f"more than one workflow's id starts with {text}: give more")
        return rows[0][0]

    def status(self, workflow_id: str) -> str:
        with self.pool.connection() as conn:
            rows = self._fetch("workflow_status", {"id": workflow_id}, conn)
        if not rows:
            raise WorkflowNotFound(f"No workflow has the id {workflow_id}")
        return rows[0][0]

    def list(
        self,
        *,
        status: str | None = None,
        created_by: str | None = None,
        limit: int = 50,
        before: tuple[Any, str] | None = None,
    ) -> list[dict]:
        """The newest workflows first (before ``before``, a ``(created_at, id)``)."""
        params = {
            "status": status,
            "created_by": created_by,
            "limit": limit,
            "before_at": before[0] if before else None,
            "before_id": before[1] if before else None,
        }
        with self.pool.connection() as conn:
            rows = self._fetch("list_workflows", params, conn)
        keys = (
            "id name status created_by created_at updated_at finished_at error nodes "
            "succeeded running pending failed cancelled"
        ).split()
        out = []
        for row in rows:
            item = dict(zip(keys, row))
            item["steps"] = {k: item.pop(k) for k in NODE_STATUSES}
            out.append(item)
        return out

    def get(self, workflow_id: str, *, created_by: str | None = None) -> dict:
        """A workflow and every node in its order, with its job's id and status.

        Raises:
          WorkflowNotFound: no such workflow (or, with ``created_by``, not theirs).
        """
        with self.pool.connection() as conn:
            rows = self._fetch("get_workflow", {"id": workflow_id}, conn)
            if not rows or (created_by is not None and rows[0][3] != created_by):
                raise WorkflowNotFound(f"No workflow has the id {workflow_id}")
            nodes = self._fetch("workflow_nodes", {"id": workflow_id}, conn)
        keys = (
            "id name status created_by created_at updated_at finished_at ended_by_job error "
            "cancelled_by remaining"
        ).split()
        flow = dict(zip(keys, rows[0]))
        node_keys = (
            "id step position parent status waiting_for open dependents job_id queue_name "
            "actor_name job_status attempts last_error input updated_at"
        ).split()
        flow["nodes"] = []
        for row in nodes:
            node = dict(zip(node_keys, row))
            node["dependents"] = list(node["dependents"] or [])
            flow["nodes"].append(node)
        return flow

    def workflow_of_job(self, job_id: str) -> tuple[str, str] | None:
        """(workflow id, node id) of a job that is one of a workflow's, else None."""
        with self.pool.connection() as conn:
            rows = self._fetch("workflow_of_job", {"job_id": job_id}, conn)
        return (rows[0][0], rows[0][1]) if rows else None

    # -- the operator's transitions ----------------------------------------------------

    def abort(self, workflow_id: str, jobs, *, by: str | None = None) -> dict:
        """running -> cancelled: the steps that have not started never will, and the jobs
        of its running steps are aborted through the job store's own transition
        (``jobs.abort``: a queued job is cancelled at once, a running one is interrupted
        and ends cancelled).

        Raises:
          WorkflowNotFound; WorkflowInvalidTransition: the workflow is not running.
          JobBusy: a job's row was held past the abort's wait (a complete_in() block's
            transaction); the workflow is cancelled and its other jobs were aborted.
        """
        # READ COMMITTED whatever the database's default isolation: the next statement's
        # snapshot is taken after the lock's wait.
        with self.pool.connection() as conn, read_committed(conn).transaction():
            # First, in a statement of its own: a step's start that another transaction
            # holds (migration 0027) commits before, and the next statement sees its job.
            self._fetch("lock_workflow", {"id": workflow_id}, conn)
            rows = self._fetch("cancel_workflow", {"id": workflow_id, "by": by}, conn)
        if not rows:
            raise WorkflowNotFound(f"No workflow has the id {workflow_id}")
        status, cancelled, job_ids = rows[0]
        if not cancelled:
            raise WorkflowInvalidTransition(workflow_id, status, "aborted", "running")
        busy: JobBusy | None = None
        for job_id in job_ids:
            try:
                jobs.abort(job_id, by=by)
            except (InvalidTransition, JobNotFound):
                pass  # it ended meanwhile (its end found the workflow cancelled)
            except JobBusy as e:
                # Its complete_in() block holds it: the others are aborted all the same,
                # and this one is named once they are (`jobs abort` it if that block
                # rolls back).
                busy = busy or e
        if busy is not None:
            raise busy
        return self.get(workflow_id)

    def retry(self, workflow_id: str) -> dict:
        """failed or cancelled -> running: its failed and cancelled steps run again (a
        step whose job was sent gets a new job, with a new message id), what succeeded
        is kept.

        Raises:
          WorkflowNotFound; WorkflowInvalidTransition: the workflow is running or
          succeeded; WorkflowStillStopping (one of those): jobs its abort interrupted
          have not ended yet (each would cancel it again).
        """
        with self.pool.connection() as conn, conn.transaction():
            rows = self._fetch("lock_workflow", {"id": workflow_id}, conn)
            if not rows:
                raise WorkflowNotFound(f"No workflow has the id {workflow_id}")
            status = rows[0][0]
            if status not in ("failed", "cancelled"):
                raise WorkflowInvalidTransition(
                    workflow_id, status, "retried", "failed or cancelled"
                )
            stopping = self._fetch("stopping_jobs", {"id": workflow_id}, conn)[0][0]
            if stopping:
                raise WorkflowStillStopping(workflow_id, stopping)
            for node_id, job_id, data, view, sent in self._fetch(
                "nodes_to_retry", {"id": workflow_id}, conn
            ):
                if sent:
                    message = messages.decode(view, data)
                    job_id = str(uuid.uuid4())
                    stored = messages.encode(
                        message.copy(message_id=job_id, options={NODE_OPTION: node_id})
                    )
                    data, view = stored.data, stored.view
                conn.execute(
                    self.queries["renew_node"],
                    {
                        "id": node_id,
                        "job_id": job_id,
                        "message_bytes": data,
                        "message": None if view is None else Jsonb(view),
                    },
                )
            ready = [r[0] for r in self._fetch("reopen_workflow", {"id": workflow_id}, conn)]
            self._fetch("start_nodes", {"ids": ready}, conn)
        return self.get(workflow_id)


def encode_result(value: Any) -> bytes | None:
    """A result as the message encoder writes it; None when it cannot be encoded."""
    try:
        data = dramatiq.get_encoder().encode(value)
    except Exception:
        return None
    return bytes(data)


def decode_result(data: bytes | None) -> Any:
    if data is None:
        return None
    return dramatiq.get_encoder().decode(bytes(data))
