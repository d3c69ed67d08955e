"""The operator's control commands: ``queues list|pause|resume|limit``, ``workers`` and
``actors``.

Pauses go through :mod:`.queues` and limits through :mod:`.limits` (the functions the
admin API uses too); the lists read the
worker registry (:mod:`.workers`). Names are printed with control and bidirectional
characters escaped (``\\u202e``), so that a name cannot pass for another on a terminal.
Output is aligned columns; ``--json`` prints the same data for scripts. Bad arguments print
one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from ..control import limits as queue_limits
from ..control import queues as queue_control
from ..control.workers import list_actors, list_workers
from ..queue_rules import MAX_LIMIT, check_limit
from .jobs import (
    Context,
    _json_flag,
    _plain_command,
    command,
    listing,
    operator_name,
    printable,
    relative,
    to_json,
)

run_queues_list = listing(
    queue_control.list_queues,
    ["QUEUE", "STATE", "SINCE", "BY", "LIMIT", "QUEUED", "DELAYED", "RUNNING"],
    lambda r, now: [
        printable(r["queue_name"]),
        "paused" if r["paused"] else "active",
        relative(r["paused_at"] if r["paused"] else r["resumed_at"], now) or "-",
        printable(r["paused_by"] if r["paused"] else r["resumed_by"]) or "-",
        "-" if r["limit"] is None else r["limit"],
        r["queued"],
        r["delayed"],
        r["running"],
    ],
    "(no queues: a worker declares its queues when it boots)",
)


def _print_state(state: queue_control.QueueState, args, verb: str, changed: bool) -> None:
    if args.json:
        print(to_json(state.as_dict()))
        return
    name = printable(state.queue_name)
    if state.paused:
        who = f" by {printable(state.paused_by)}" if state.paused_by else ""
        when = state.paused_at.isoformat(timespec="seconds") if state.paused_at else ""
        lead = f"queue {name} is paused" if changed else f"queue {name} was already paused"
        print(f"{lead}{who} since {when}: workers claim none of its jobs; sends are kept")
    else:
        lead = f"queue {name} is {verb}" if changed else f"queue {name} was not paused"
        print(f"{lead}: workers claim its jobs")


@command
def run_queues_pause(ctx: Context, args) -> int:
    with ctx.pool.connection() as conn:
        before = queue_control.get(conn, ctx.settings.schema, args.name)
        state = queue_control.pause(
            conn, ctx.settings.schema, args.name, by=operator_name(), force=args.force
        )
    _print_state(state, args, "paused", before is None or not before.paused)
    return 0


@command
def run_queues_resume(ctx: Context, args) -> int:
    with ctx.pool.connection() as conn:
        before = queue_control.get(conn, ctx.settings.schema, args.name)
        state = queue_control.resume(conn, ctx.settings.schema, args.name, by=operator_name())
    _print_state(state, args, "resumed", before is not None and before.paused)
    return 0


@command
def run_queues_limit(ctx: Context, args) -> int:
    if args.clear == (args.limit is not None):
        print(
            "error: give either a limit (a whole number of at least 1) or --clear",
            file=sys.stderr,
        )
        return 2
    with ctx.pool.connection() as conn:
        limit = queue_limits.set_limit(
            conn,
            ctx.settings.schema,
            args.name,
            None if args.clear else args.limit,
            by=operator_name(),
            force=args.force,
        )
    name = printable(args.name)
    if args.json:
        print(to_json({"queue_name": args.name, **(limit.as_dict() if limit else {"limit": None})}))
    elif limit is None:
        print(f"queue {name} has no limit: workers claim its jobs as they can run them")
    else:
        print(
            f"queue {name} is limited to {limit.limit} running job(s) at a time, on every "
            "worker, from the next claim on"
        )
    return 0


run_workers = listing(
    list_workers,
    ["HOST", "PID", "VERSION", "STARTED", "HEARTBEAT", "IN FLIGHT", "QUEUES"],
    lambda r, now: [
        printable(r["host"]),
        r["pid"],
        printable(r["version"]) or "-",
        relative(r["started_at"], now),
        relative(r["heartbeat_at"], now),
        r["in_flight"],
        ", ".join(printable(q) for q in r["queues"]),
    ],
    "(no live worker processes)",
)


run_actors = listing(
    list_actors,
    ["ACTOR", "QUEUE", "LIVE WORKERS", "LAST DECLARED"],
    lambda r, now: [
        printable(r["actor_name"]),
        printable(r["queue_name"]),
        r["live_workers"],
        relative(r["seen_at"], now),
    ],
    "(no actors: a worker declares its actors when it boots)",
)


def _limit(text: str) -> int:
    try:
        return check_limit(int(text))
    except ValueError:  # not a number, or InvalidQueueLimit
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a limit: give a whole number from 1 to {MAX_LIMIT} "
            "(pause a queue to stop it; --clear lifts its limit)"
        ) from None


def add_control_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``queues``, ``workers`` and ``actors`` to the CLI."""
    queues = sub.add_parser("queues", help="list, pause, resume and limit queues")
    queues_sub = queues.add_subparsers(
        dest="queues_command", metavar="{list,pause,resume,limit}", required=True
    )
    _plain_command(
        queues_sub,
        "list",
        run_queues_list,
        "known queues: paused or not, their limits, jobs waiting",
    )

    pause = queues_sub.add_parser(
        "pause", help="stop every worker claiming a queue's jobs (sends are still accepted)"
    )
    pause.add_argument("name")
    pause.add_argument(
        "--force", action="store_true", help="pause a queue no worker has declared yet"
    )
    _json_flag(pause)
    pause.set_defaults(func=run_queues_pause)

    resume = queues_sub.add_parser("resume", help="let workers claim a paused queue's jobs again")
    resume.add_argument("name")
    _json_flag(resume)
    resume.set_defaults(func=run_queues_resume)

    limit = queues_sub.add_parser(
        "limit",
        help="at most N running jobs of a queue at a time, across every worker (or --clear)",
    )
    limit.add_argument("name")
    limit.add_argument(
        "limit", nargs="?", type=_limit, help="the most jobs of the queue running at once"
    )
    limit.add_argument("--clear", action="store_true", help="lift the queue's limit")
    limit.add_argument(
        "--force", action="store_true", help="limit a queue no worker has declared yet"
    )
    _json_flag(limit)
    limit.set_defaults(func=run_queues_limit)

    _plain_command(sub, "workers", run_workers, "the live worker processes")
    _plain_command(sub, "actors", run_actors, "the actors workers declared, with their queues")
