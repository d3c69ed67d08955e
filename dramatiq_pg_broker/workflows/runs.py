"""Running a workflow, and its handle."""

from __future__ import annotations

import time
import uuid
from typing import Any

import dramatiq

from ..errors import ConfigurationError, WorkflowTimeout
from .building import Node, Workflow, compile_steps
from .store import WorkflowStore

#: The longest pause between two looks of :meth:`WorkflowRun.wait` at the workflow's row.
WAIT_POLL_CAP_SECONDS = 0.5


def store_of(broker: Any) -> WorkflowStore:
    """The broker's workflow store (one per broker)."""
    store = getattr(broker, "_workflow_store", None)
    if store is None:
        if not hasattr(broker, "sender") or not hasattr(broker, "pool"):
            raise ConfigurationError(
                f"workflows run on a PostgresBroker, not on {type(broker).__name__}"
            )
        store = WorkflowStore(broker.pool, broker.settings.schema)
        broker._workflow_store = store
    return store


def _broker_for(flow_nodes: list[Node], broker: Any) -> Any:
    if broker is not None:
        return broker
    return dramatiq.get_broker()


def run_workflow(flow: Workflow, *, broker: Any = None, created_by: str | None = None):
    nodes, remaining = compile_steps(flow)
    broker = _broker_for(nodes, broker)
    store = store_of(broker)
    rows = [(node, broker.sender.job_for(node.message)[0]) for node in nodes]
    workflow_id = str(uuid.uuid4())
    # Inside broker.transaction(conn) (or Django's atomic()), as a send is: on the
    # application's connection, committed or rolled back with its transaction.
    block = broker.sender.app_transaction()
    if block is None:
        store.create(workflow_id, rows, remaining, name=flow.name, created_by=created_by)
    else:
        with block.writing():
            store.create(
                workflow_id, rows, remaining, name=flow.name, created_by=created_by, conn=block.view
            )
    return WorkflowRun(workflow_id, broker=broker)


class WorkflowRun:
    """A workflow that was run: its ``id``, its ``status()``, and ``wait()`` for its end.

    Parameters:
      id(str): the workflow's id.
      broker(PostgresBroker): the broker whose database holds it (default:
        ``dramatiq.get_broker()``).
    """

    def __init__(self, id: str, *, broker: Any = None) -> None:
        self.id = str(id)
        self.broker = broker if broker is not None else dramatiq.get_broker()

    def __repr__(self) -> str:
        return f"WorkflowRun({self.id!r})"

    def status(self) -> str:
        """``running``, ``succeeded``, ``failed`` or ``cancelled``."""
        return store_of(self.broker).status(self.id)

    def wait(self, timeout: float = 60.0) -> str:
        """Wait until the workflow ends; return its final status.

        Parameters:
          timeout(float): the longest wait, in seconds.

        Raises:
          WorkflowTimeout: it was still running after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        pause = 0.02
        while True:
            status = self.status()
            if status != "running":
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkflowTimeout(f"workflow {self.id} was still running after {timeout:g}s")
            time.sleep(min(pause, left))
            pause = min(pause * 2, WAIT_POLL_CAP_SECONDS)

    def show(self) -> dict:
        """The workflow and every step, with its job's id and status."""
        return store_of(self.broker).get(self.id)
