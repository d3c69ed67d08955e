"""``dramatiq-pg-broker workflows``: list, show, abort and retry workflows.

Reads and changes go through :class:`~dramatiq_pg_broker.workflows.WorkflowStore`, which
the admin API uses too; an abort ends each running step's job through the job store's own
transition (``jobs abort``)."""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

from ..workflows import STATUSES, WorkflowStore
from .jobs import (
    Context,
    _json_flag,
    command,
    operator_name,
    positive_int,
    relative,
    table,
    to_json,
)


def _store(ctx: Context) -> WorkflowStore:
    return WorkflowStore(ctx.pool, ctx.settings.schema)


def _progress(steps: dict[str, int]) -> str:
    total = sum(steps.values())
    return f"{steps['succeeded']}/{total}"


@command
def run_workflows_list(ctx: Context, args) -> int:
    rows = _store(ctx).list(status=args.status, limit=args.limit)
    if args.json:
        print(to_json(rows))
        return 0
    now = dt.datetime.now(dt.timezone.utc)
    print(
        table(
            ["ID", "NAME", "STATUS", "DONE", "RUNNING", "CREATED", "FINISHED"],
            (
                [
                    r["id"],
                    r["name"] or "",
                    r["status"],
                    _progress(r["steps"]),
                    r["steps"]["running"],
                    relative(r["created_at"], now),
                    relative(r["finished_at"], now),
                ]
                for r in rows
            ),
        )
    )
    if not rows:
        print("no workflow")
    return 0


def print_workflow(flow: dict[str, Any]) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    print(f"workflow {flow['id']}" + (f" ({flow['name']})" if flow["name"] else ""))
    print(f"  status:   {flow['status']}")
    print(
        f"  created:  {flow['created_at']:%Y-%m-%d %H:%M:%S} ({relative(flow['created_at'], now)})"
    )
    if flow["finished_at"]:
        print(f"  finished: {flow['finished_at']:%Y-%m-%d %H:%M:%S}")
    if flow["cancelled_by"]:
        print(f"  cancelled by: {flow['cancelled_by']}")
    if flow["error"]:
        print(f"  failed: job {flow['ended_by_job']}: {flow['error'].splitlines()[-1]}")
    print()
    rows = []
    for node in flow["nodes"]:
        rows.append(
            [
                node["step"] + 1,
                ("  child of " + node["parent"][:8]) if node["parent"] else "",
                node["actor_name"],
                node["status"],
                node["job_id"],
                node["job_status"] or "-",
            ]
        )
    print(table(["STEP", "", "ACTOR", "STATUS", "JOB", "JOB STATUS"], rows))


@command
def run_workflows_show(ctx: Context, args) -> int:
    store = _store(ctx)
    flow = store.get(store.resolve(args.id))
    if args.json:
        print(to_json(flow))
    else:
        print_workflow(flow)
    return 0


@command
def run_workflows_abort(ctx: Context, args) -> int:
    store = _store(ctx)
    flow = store.abort(store.resolve(args.id), ctx.store, by=operator_name())
    if args.json:
        print(to_json(flow))
    else:
        running = [n for n in flow["nodes"] if n["job_status"] == "running"]
        print(
            f"workflow {flow['id']} is cancelled"
            + (
                f"; the workers of its {len(running)} running job(s) were asked to stop them"
                if running
                else ""
            )
        )
    return 0


@command
def run_workflows_retry(ctx: Context, args) -> int:
    store = _store(ctx)
    flow = store.retry(store.resolve(args.id))
    if args.json:
        print(to_json(flow))
    else:
        print(f"workflow {flow['id']} is {flow['status']} again")
    return 0


def add_workflow_commands(sub: argparse._SubParsersAction) -> None:
    flows = sub.add_parser("workflows", help="list, show, abort and retry workflows")
    flows_sub = flows.add_subparsers(dest="workflows_command", required=True)
    help_id = "the workflow's id, or its first 8 characters or more"

    listing = flows_sub.add_parser("list", help="the newest workflows first")
    listing.add_argument("--status", choices=STATUSES)
    listing.add_argument("--limit", type=positive_int, default=50, help="default 50")
    _json_flag(listing)
    listing.set_defaults(func=run_workflows_list)

    show = flows_sub.add_parser("show", help="a workflow and each of its steps with its job")
    show.add_argument("id", help=help_id)
    _json_flag(show)
    show.set_defaults(func=run_workflows_show)

    abort = flows_sub.add_parser(
        "abort", help="cancel a running workflow and abort its running steps' jobs"
    )
    abort.add_argument("id", help=help_id)
    _json_flag(abort)
    abort.set_defaults(func=run_workflows_abort)

    retry = flows_sub.add_parser(
        "retry", help="run a failed or cancelled workflow again from its failed steps"
    )
    retry.add_argument("id", help=help_id)
    _json_flag(retry)
    retry.set_defaults(func=run_workflows_retry)
