"""The operator's control commands: ``stats``, ``queues list|show|pause|resume|limit``,
``workers`` and ``actors``.

``stats`` and ``queues list`` print the same table, each queue as
:mod:`..control.overview` reads it for the admin API too: its state, its limit and its
jobs in each state (:mod:`..jobs.states`). Pauses go through :mod:`.queues` and limits
through :mod:`.limits` (the functions the admin API uses too); the lists read the worker
registry (:mod:`.workers`). Names are printed with control and bidirectional
characters escaped (``\\u202e``), so that a name cannot pass for another on a terminal.
Output is aligned columns; ``--json`` prints the same data for scripts. Bad arguments print
one line and exit 2.
"""

from __future__ import annotations

import argparse
import datetime as dt

from ..control import limits as queue_limits
from ..control import overview as queue_overview
from ..control import queues as queue_control
from ..control.workers import list_actors, list_workers
from ..errors import QueueNotDeclared
from ..jobs import states
from ..queue_rules import MAX_LIMIT, check_limit
from .jobs import (
    Context,
    _json_flag,
    _plain_command,
    command,
    duration,
    listing,
    operator_name,
    printable,
    relative,
    table,
    to_json,
    warn_undeclared,
)

#: The columns of ``stats`` and ``queues list``: a queue's state and limit, then its jobs
#: in each state (the vocabulary's order), then how long its oldest runnable job waited.
QUEUE_COUNTS = (*states.UNFINISHED, states.FAILED)
QUEUE_COLUMNS = [
    "QUEUE",
    "STATE",
    "LIMIT",
    *(states.STATES[name].label.upper() for name in QUEUE_COUNTS),
    "OLDEST WAITING",
]


def queue_row(queue: queue_overview.QueueOverview) -> list:
    """A queue's line of :data:`QUEUE_COLUMNS`."""
    return [
        queue.queue_name,
        queue.state.replace("_", " "),
        "-" if queue.limit is None else queue.limit.limit,
        *(getattr(queue.jobs, name) for name in QUEUE_COUNTS),
        duration(queue.jobs.oldest_waiting_seconds) if queue.jobs.oldest_waiting_seconds else "-",
    ]


@command
def run_queues_list(ctx: Context, args) -> int:
    """``stats`` and ``queues list``: every queue (see :mod:`..control.overview`)."""
    with ctx.pool.connection() as conn:
        queues = queue_overview.overview(conn, ctx.settings.schema)
    if args.json:
        print(to_json([queue.as_dict() for queue in queues.values()]))
        return 0
    if not queues:
        # Finished jobs are not counted: "no jobs" would be false when every job succeeded.
        print(
            "no queue: no worker has declared one, and no job is unfinished or failed "
            "(finished jobs are not counted: `jobs list --status succeeded` lists them)"
        )
        return 0
    print(table(QUEUE_COLUMNS, (queue_row(queue) for queue in queues.values())))
    return 0


def at(when: dt.datetime, now: dt.datetime) -> str:
    """``at 2026-12-06T10:00:00+00:00 (5m ago)``."""
    return f"at {when.isoformat(timespec='seconds')} ({relative(when, now)})"


@command
def run_queues_show(ctx: Context, args) -> int:
    """``queues show NAME``: one queue, with its pause, its limit and who set it, its
    throughput and why its jobs wait."""
    with ctx.pool.connection() as conn:
        queue = queue_overview.queue(conn, ctx.settings.schema, args.name)
        if queue is None:
            raise QueueNotDeclared(
                f"{queue_control.not_declared(args.name)} (and it has no unfinished or "
                "failed job, nor a limit)"
            )
        flow = queue_overview.throughput(conn, ctx.settings.schema, args.name)
    if not queue.declared:
        warn_undeclared(ctx, args.name)
    if args.json:
        print(to_json({**queue.as_dict(), "throughput": flow}))
        return 0
    now = dt.datetime.now(dt.timezone.utc)
    width = 12
    lines = [("queue", printable(queue.queue_name)), ("state", queue.state.replace("_", " "))]
    pause = queue.pause
    if pause is not None and pause.paused:
        lines.append(("paused", f"by {printable(pause.paused_by)} {at(pause.paused_at, now)}"))
    elif pause is not None and pause.resumed_at is not None:
        lines.append(("resumed", f"by {printable(pause.resumed_by)} {at(pause.resumed_at, now)}"))
    limit = queue.limit
    lines.append(
        (
            "limit",
            "none"
            if limit is None
            else f"{limit.limit} running at once, set by {limit.source} "
            f"({printable(limit.set_by)}) {at(limit.set_at, now)}",
        )
    )
    lines.append(("workers", f"{queue.live_workers} live worker process(es) consume it"))
    counts = (f"{getattr(queue.jobs, name)} {states.STATES[name].label}" for name in QUEUE_COUNTS)
    lines.append(("jobs", ", ".join(counts)))
    lines.append(
        (
            "last hour",
            f"{flow['succeeded']} succeeded, {flow['failed']} failed"
            + (" (the most recent only: a busy hour)" if flow["truncated"] else ""),
        )
    )
    if queue.jobs.oldest_waiting_seconds:
        waited = duration(queue.jobs.oldest_waiting_seconds)
        waited = "under a second" if waited == "now" else waited
        lines.append(("oldest", f"the oldest runnable job has waited {waited}"))
    for line_name, value in lines:
        print(f"{line_name.ljust(width)}  {value}")
    reasons = queue.waiting_because()
    if reasons:
        print()
        print("why jobs wait")
        for reason in reasons:
            print(f"  - {printable(reason['text'])}")
    return 0


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
        from .common import fail

        return fail("give either a limit (a whole number of at least 1) or --clear")
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
    ["HOST", "PID", "VERSION", "LEVEL", "STARTED", "HEARTBEAT", "IN FLIGHT", "QUEUES"],
    lambda r, now: [
        printable(r["host"]),
        r["pid"],
        printable(r["version"]) or "-",
        f"{r['schema_level']:04d}" if r["schema_level"] is not None else "-",
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
    """Add ``stats``, ``queues``, ``workers`` and ``actors`` to the CLI."""
    _plain_command(
        sub,
        "stats",
        run_queues_list,
        "per queue: its state, its limit and its jobs in each state (as queues list)",
    )
    queues = sub.add_parser("queues", help="list, show, pause, resume and limit queues")
    queues_sub = queues.add_subparsers(
        dest="queues_command", metavar="{list,show,pause,resume,limit}", required=True
    )
    _plain_command(
        queues_sub,
        "list",
        run_queues_list,
        "every queue: its state, its limit and its jobs in each state (as stats)",
    )
    show = queues_sub.add_parser(
        "show",
        help="one queue: its pause, its limit and who set it, its jobs in each state, the "
        "last hour's throughput, and why its jobs wait",
    )
    show.add_argument("name")
    _json_flag(show)
    show.set_defaults(func=run_queues_show)

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
