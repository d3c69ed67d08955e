"""Workflows: Dramatiq's messages, groups and pipelines composed into steps that run in
order, kept as rows and moved on in the transaction that ends each of their jobs.

::

    from dramatiq import group
    from dramatiq_pg_broker import workflow

    run = workflow(
        fetch.message(url),
        group(resize.message(size) for size in (64, 256, 1024)),
        publish.message(),
    ).run()
    run.wait(timeout=60)   # "succeeded"

See the workflows guide.
"""

from __future__ import annotations

from .building import Workflow, workflow
from .runs import WorkflowRun
from .store import NODE_STATUSES, STATUSES, WorkflowStore

__all__ = ["NODE_STATUSES", "STATUSES", "Workflow", "WorkflowRun", "WorkflowStore", "workflow"]
