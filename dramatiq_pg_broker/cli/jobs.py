"""The operator's commands: ``jobs list|show|retry|requeue|cancel|abort``, ``prune`` and
``schedules`` (``stats``, ``queues`` and ``workers`` are in :mod:`.cli_control`).

Reads use the named statements of ``sql/operator.sql``; every change goes through the
:class:`~dramatiq_pg_broker.jobs.JobStore` transitions (the same functions, and so the same
events, as the admin API's). A job is shown in its state (:mod:`..jobs.states`: ready,
delayed, paused, running, lease expired, succeeded, failed, cancelled), the same words the
admin API, the dashboard and the metrics use. Output is aligned columns with relative
times for a terminal; ``--json`` prints the same data for scripts. Names and errors are
printed with control and bidirectional characters escaped (:func:`printable`). Bad
arguments print one line and exit 2. A queue name no worker declared is used as given,
with a warning on stderr (:func:`warn_undeclared`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import json
import sys
import unicodedata
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..config import Settings
from ..control import queues as queue_control
from ..db.core import ProcessPool
from ..db.queries import Queries
from ..errors import AmbiguousJobId, PgBrokerError
from ..jobs import states
from ..jobs.operator import ABORT_LOCK_WAIT, taken
from ..jobs.rows import ReapResult
from ..jobs.store import JobStore

#: How every command that takes a job id describes it.
ID_HELP = "the job's id, or at least its first 8 hex characters (a unique prefix)"

#: Failed jobs ``jobs retry --all-failed`` retries per statement (and commit).
RETRY_BATCH = 1000


class BadArgument(PgBrokerError):
    """A command-line argument that cannot be used."""


# -- formatting ---------------------------------------------------------------------------


def relative(when: dt.datetime | None, now: dt.datetime | None = None) -> str:
    """``12s ago``, ``in 3m``, ``2h ago``, ``5d ago``; empty for None."""
    if when is None:
        return ""
    now = now or dt.datetime.now(dt.timezone.utc)
    seconds = (now - when).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 1:
        return "now"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            amount = f"{int(seconds // size)}{unit}"
            break
    return f"in {amount}" if future else f"{amount} ago"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return relative(dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds)).replace(
        " ago", ""
    )


#: Unicode categories escaped when a name is printed: controls, format characters (the
#: bidirectional overrides and isolates, zero-width characters), line and paragraph
#: separators, unassigned and private-use code points.
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cn", "Co", "Cs"})


def printable(text: object) -> str:
    """``text`` with every character of :data:`ESCAPED_CATEGORIES` written as its escape
    (``\\u202e``), so that what a terminal shows is what the name holds."""
    if text is None:
        return ""
    out = []
    for char in str(text):
        if unicodedata.category(char) in ESCAPED_CATEGORIES:
            code = ord(char)
            out.append(
                f"\\x{code:02x}"
                if code < 0x100
                else f"\\u{code:04x}"
                if code < 0x10000
                else f"\\U{code:08x}"
            )
        else:
            out.append(char)
    return "".join(out)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Columns aligned to their widest cell; numbers right-aligned. Every cell is
    :func:`printable`: a name or an error cannot pass for another on a terminal."""
    rows = [[printable(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    numeric = [
        bool(rows) and all(r[i].lstrip("-").isdigit() for r in rows if r[i])
        for i in range(len(headers))
    ]

    def line(cells):
        return "  ".join(
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)
        ).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def to_json(data: Any) -> str:
    def default(value):
        if isinstance(value, (dt.datetime, dt.date)):
            return value.isoformat()
        if isinstance(value, uuid.UUID):
            return str(value)
        if isinstance(value, (bytes, memoryview)):
            return None
        return str(value)

    return json.dumps(data, default=default, indent=2)


def one_line(text: str | None, width: int = 60) -> str:
    if not text:
        return ""
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


# -- plumbing -----------------------------------------------------------------------------


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return number


class Context:
    """What every command needs: settings, a pool, the job store and the named reads."""

    def __init__(self, args: argparse.Namespace) -> None:
        from .common import settings_from

        self.settings: Settings = settings_from(args)
        self.pool = ProcessPool(self.settings)
        self.store = JobStore(self.pool, self.settings.schema)
        self.queries = Queries(self.settings.schema, "operator.sql")

    def _fetch(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        with self.pool.connection() as conn:
            cur = conn.execute(self.queries[name], params)
            names = [d.name for d in cur.description]
            return [dict(zip(names, row)) for row in cur.fetchall()]

    def close(self) -> None:
        self.pool.close()


def command(fn):
    """Run a command with a :class:`Context`, closed afterwards."""

    def run(args: argparse.Namespace) -> int:
        ctx = Context(args)
        try:
            return fn(ctx, args)
        except AmbiguousJobId as e:
            if getattr(args, "json", False):
                print(to_json({"error": str(e), "candidates": e.candidates}), file=sys.stderr)
            else:
                print_candidates(e)
            return 2
        finally:
            ctx.close()

    return run


def print_candidates(error: AmbiguousJobId) -> None:
    """The one-line error, then the jobs an ambiguous prefix matches (as git lists the
    objects an ambiguous short hash names), all on stderr."""
    now = dt.datetime.now(dt.timezone.utc)
    rows = [
        [c["id"], c["queue_name"], c["actor_name"], c["status"], relative(c["created_at"], now)]
        for c in error.candidates
    ]
    lines = table(["ID", "QUEUE", "ACTOR", "STATUS", "CREATED"], rows).splitlines()
    print(f"error: {error}", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    if error.more:
        print("  ...", file=sys.stderr)


def print_rows(
    args,
    rows: list[dict[str, Any]],
    headers: Sequence[str],
    cells: Callable[[dict[str, Any], dt.datetime], Sequence[Any]],
    empty: str,
) -> int:
    """Print ``rows`` as JSON with ``--json``, else as a table of ``cells(row, now)`` (and
    ``empty`` when there is no row); exit 0."""
    if args.json:
        print(to_json(rows))
        return 0
    now = dt.datetime.now(dt.timezone.utc)
    print(table(headers, (cells(r, now) for r in rows)))
    if not rows:
        print(empty)
    return 0


def listing(
    read: Callable[[Any, str], list[dict[str, Any]]],
    headers: Sequence[str],
    cells: Callable[[dict[str, Any], dt.datetime], Sequence[Any]],
    empty: str,
) -> Callable[[argparse.Namespace], int]:
    """A list command (the worker registry's, the actors', the queues', the schedules'): it
    prints, as :func:`print_rows` does, what ``read(conn, schema)`` returns, read on one of
    the pool's connections. Such a command is only its reader, its columns and its sentence
    for no rows, so it is written as those."""

    @command
    def run(ctx: Context, args) -> int:
        with ctx.pool.connection() as conn:
            rows = read(conn, ctx.settings.schema)
        return print_rows(args, rows, headers, cells, empty)

    return run


def warn_undeclared(ctx: Context, name: str | None) -> None:
    """The one rule for a queue name a command is given to read or retry jobs of: used as
    given, with a warning on stderr when no worker declared it (a misspelt name then says
    so, instead of an empty answer). The commands that would change a queue's state refuse
    such a name instead (``queues pause``, ``queues limit``: see their ``--force``)."""
    from .common import warn

    if name is None:
        return
    with ctx.pool.connection() as conn:
        declared = queue_control.is_declared(conn, ctx.settings.schema, name)
    if not declared:
        warn(queue_control.not_declared(name))


def state_cell(row: dict[str, Any], now: dt.datetime) -> str:
    """A job's state for a table: its label, and when it runs (delayed) or when its lease
    ended (lease expired)."""
    state = row["state"]
    label = states.STATES[state].label if state in states.STATES else state
    if state == states.DELAYED:
        return f"{label} ({relative(row['available_at'], now)})"
    if state == states.LEASE_EXPIRED:
        return f"{label} ({relative(row['locked_until'], now)})"
    return label


def with_state(row: dict[str, Any]) -> dict[str, Any]:
    """A row of ``list_jobs`` (or ``get_job``, with ``queue_paused`` and ``server_now``)
    with its ``state``; the columns that only served to find it are dropped."""
    row["state"] = states.state_of(
        row["status"],
        available_at=row["available_at"],
        locked_until=row["locked_until"],
        paused=row.pop("queue_paused", False),
        now=row.pop("server_now"),
    )
    return row


def operator_name() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # no user name in this environment
        return "cli"


# -- commands -----------------------------------------------------------------------------


@command
def run_jobs_list(ctx: Context, args) -> int:
    warn_undeclared(ctx, args.queue)
    rows = ctx._fetch(
        "list_jobs",
        {
            **states.filter_params(args.status),
            "queue": args.queue,
            "actor": args.actor,
            "limit": args.limit,
            "now": None,
        },
    )
    rows = [with_state(row) for row in rows]
    return print_rows(
        args,
        rows,
        ["ID", "QUEUE", "ACTOR", "STATE", "ATTEMPTS", "CREATED", "UPDATED", "ERROR"],
        lambda r, now: [
            r["id"],
            r["queue_name"],
            r["actor_name"],
            state_cell(r, now),
            f"{r['attempts']}/{r['max_attempts']}",
            relative(r["created_at"], now),
            relative(r["updated_at"], now),
            one_line(r["last_error"], 40),
        ],
        "(no jobs)",
    )


@command
def run_jobs_show(ctx: Context, args) -> int:
    job = ctx.store.get(ctx.store.resolve_id(args.id))
    events = ctx.store.events_of(job["id"])
    facts = ctx._fetch("job_state_facts", {"queue_name": job["queue_name"]})[0]
    job = with_state({**job, **facts})
    if args.json:
        job.pop("message_bytes", None)
        print(to_json({"job": job, "events": events}))
        return 0
    now = dt.datetime.now(dt.timezone.utc)
    state = states.STATES.get(job["state"])
    if state is not None:
        when = ""
        if job["state"] == states.DELAYED:
            when = f" until {job['available_at'].isoformat(timespec='seconds')}"
        elif job["state"] == states.LEASE_EXPIRED:
            when = f" at {job['locked_until'].isoformat(timespec='seconds')}"
        advice = " (`jobs requeue` puts it back now)" if state.name == states.LEASE_EXPIRED else ""
        job["state"] = f"{state.label}{when}: {state.description}{advice}"
    fields = [
        "id", "queue_name", "actor_name", "state", "status", "priority", "attempts",
        "max_attempts",
        "idempotency_key", "locked_by", "locked_until", "available_at", "created_at",
        "started_at", "finished_at", "updated_at", "last_error",
    ]  # fmt: skip
    width = max(len(f) for f in fields)
    for name in fields:
        value = job[name]
        if isinstance(value, dt.datetime):
            value = f"{value.isoformat(timespec='seconds')}  ({relative(value, now)})"
        # A multi-line error (a traceback) stays under its column, each line printable.
        lines = ("" if value is None else str(value)).split("\n")
        print(f"{name.ljust(width)}  " + ("\n" + " " * (width + 2)).join(map(printable, lines)))
    message = job["message"]
    if message is not None:
        shown = {k: message.get(k) for k in ("args", "kwargs") if k in message}
        print(f"{'message'.ljust(width)}  {one_line(json.dumps(shown), 100)}")
    elif job["message_bytes"] is not None:
        print(f"{'message'.ljust(width)}  ({len(job['message_bytes'])} bytes, not JSON)")
    print()
    print("timeline")
    print(
        table(
            ["AT", "WHEN", "EVENT", "ATTEMPT", "BY", "DATA"],
            (
                [
                    e["created_at"].isoformat(timespec="milliseconds"),
                    relative(e["created_at"], now),
                    e["type"],
                    e["attempt"],
                    e["actor"],
                    one_line(json.dumps(e["data"]) if e["data"] is not None else "", 60),
                ]
                for e in events
            ),
        )
    )
    return 0


@command
def run_jobs_retry(ctx: Context, args) -> int:
    if args.queue and not args.all_failed:
        raise BadArgument("--queue goes with --all-failed, not with a job id")
    by = operator_name()
    if args.all_failed:
        warn_undeclared(ctx, args.queue)
        # Batch by batch, each committed before the next: neither the process's memory nor
        # a transaction grows with the number of failed jobs (the JSON list is streamed).
        retried = 0
        skipped: list[str] = []
        if args.json:
            print('{"retried": [', end="")
        batches = ctx.store.retry_all_failed(
            queue_name=args.queue, by=by, batch=RETRY_BATCH, skipped=skipped
        )
        for ids in batches:
            if args.json and ids:
                print(("" if not retried else ", ") + ", ".join(json.dumps(i) for i in ids), end="")
            retried += len(ids)
        if args.json:
            # "skipped": the failed jobs whose id has a second row (DuplicateJobId).
            print(f'], "skipped": {json.dumps(sorted(skipped))}}}')
        else:
            where = f" of queue {args.queue!r}" if args.queue else ""
            print(f"retried {retried} failed job(s){where}")
            if skipped:
                print(
                    f"skipped {len(skipped)} failed job(s) whose id has a second row (queued "
                    "again while it finished, under an earlier release): look at their rows "
                    "with `jobs show` and delete the one that is not wanted:"
                )
                for job_id in sorted(skipped):
                    print(f"  {job_id}")
        return 0
    job = ctx.store.retry_failed(ctx.store.resolve_id(args.id), by=by)
    print(to_json(job) if args.json else f"job {job['id']} is {job['status']} again")
    return 0


@command
def run_jobs_requeue(ctx: Context, args) -> int:
    if args.queue and not args.all_expired:
        raise BadArgument("--queue goes with --all-expired, not with a job id")
    by = operator_name()
    if args.all_expired:
        warn_undeclared(ctx, args.queue)
        result = ctx.store.requeue_expired(settings=ctx.settings, queue_name=args.queue, by=by)
    else:
        result = ctx.store.requeue_expired(
            ctx.store.resolve_id(args.id), settings=ctx.settings, by=by
        )
    if args.json:
        print(
            to_json(
                {
                    "requeued": result.requeued + result.released,
                    "failed": result.failed,
                    "cancelled": result.aborted,
                }
            )
        )
        return 0
    print(describe_requeue(result, args.queue))
    return 0


def describe_requeue(result: ReapResult, queue: str | None) -> str:
    """What an operator's requeue did, in one sentence (or two)."""
    where = f" of queue {printable(queue)}" if queue else ""
    if not taken(result):
        return f"no job{where} has an expired lease: nothing to requeue"
    back = len(result.requeued) + len(result.released)
    lines = [f"requeued {back} job(s){where} whose lease expired: runnable now"]
    if result.failed:
        lines.append(
            f"failed {len(result.failed)} job(s) whose interruptions reached the limit "
            "(max_interruptions), as the reaper does: `jobs retry` runs them again"
        )
    if result.aborted:
        lines.append(f"cancelled {len(result.aborted)} job(s) whose abort was requested")
    return "\n".join(lines)


@command
def run_jobs_cancel(ctx: Context, args) -> int:
    job = ctx.store.cancel(ctx.store.resolve_id(args.id), by=operator_name())
    print(to_json(job) if args.json else f"job {job['id']} is {job['status']}")
    return 0


@command
def run_jobs_abort(ctx: Context, args) -> int:
    import time

    # The whole answer within --wait (or about a second without it): the request's own
    # wait for the job's row (held by a complete_in() block's transaction), then the wait
    # for the job to end.
    began = time.monotonic()
    which = ctx.store.resolve_id(args.id)
    lock_wait = args.wait if args.wait else ABORT_LOCK_WAIT
    job = ctx.store.abort(which, by=operator_name(), lock_wait=lock_wait)
    if job["status"] == "running" and args.wait:
        job = wait_until_finished(ctx, job["id"], args.wait - (time.monotonic() - began))
    if args.json:
        print(to_json(job))
    elif job["status"] == "running":
        waited = f" after {args.wait:g}s" if args.wait else ""
        print(
            f"job {job['id']} is still running{waited}: its worker was asked to stop it and "
            "ends it cancelled (see `jobs show`)"
        )
    else:
        print(f"job {job['id']} is {job['status']}")
    return 0


def wait_until_finished(ctx: Context, which: str, seconds: float) -> dict[str, Any]:
    """The job once it is no longer running, or as it is after ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        row = ctx.store.get(which)
        if row["status"] != "running" or time.monotonic() >= deadline:
            return row
        time.sleep(0.1)


def non_negative_seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0 <= number <= 3600:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds from 0 to 3600")
    return number


@command
def run_prune(ctx: Context, args) -> int:
    from ..history.retention import RetentionPolicy, prune

    policy = RetentionPolicy.from_settings(ctx.settings)
    report = prune(
        ctx.pool,
        ctx.settings.schema,
        policy,
        batch=ctx.settings.retention_batch,
        dry_run=args.dry_run,
        rest=False,
        partitions_ahead=ctx.settings.history_partitions_ahead,
    )
    if args.json:
        print(to_json(report.as_dict()))
        return 1 if report.failed else 0
    ages = policy.ages()
    verb = "would delete" if args.dry_run else "deleted"
    rows = []
    for status in ("succeeded", "failed", "cancelled"):
        if status in ages:
            days = ages[status].total_seconds() / 86400
            rows.append([status, f"{days:g}d", report.jobs[status], report.events[status]])
        else:
            rows.append([status, "forever", 0, 0])
    print(table(["STATUS", "KEPT FOR", "JOBS", "EVENTS"], rows))
    if report.expired_events:
        print(f"events {verb} by their own day: {report.expired_events}")
    if report.dropped:
        print(f"partitions dropped: {', '.join(report.dropped)}")
    for name, count in report.moved.items():
        if count:
            print(f"{name}: {count} row(s) moved into their day's partition")
    print(f"{verb} {report.total_jobs} finished job(s)" + (" (dry run)" if args.dry_run else ""))
    print(
        table(
            ["STEP", "RESULT", "SECONDS", "DETAIL"],
            (
                [name, step.state, f"{step.seconds:.2f}", step.error or step.detail]
                for name, step in report.steps.items()
            ),
        )
    )
    if report.failed:
        # Exit 1: the run happened, a step of it failed (2 is for a run that could not
        # start: bad arguments, no database).
        print(
            "error: maintenance step(s) failed: "
            + "; ".join(f"{n}: {report.steps[n].error}" for n in report.failed),
            file=sys.stderr,
        )
        return 1
    return 0


def _list_schedules(conn, schema: str) -> list[dict[str, Any]]:
    # Imported here: the scheduler's module (and APScheduler) only for this command.
    from ..history.periodic import list_schedules

    return list_schedules(conn, schema)


run_schedules = listing(
    _list_schedules,
    ["NAME", "KIND", "QUEUE", "TRIGGER", "TZ", "MISSED", "LAST TICK", "NEXT RUN", "LAST JOB"],
    lambda r, now: [
        r["name"],
        r["kind"],
        r["queue_name"] or "-",
        r["trigger"],
        r["timezone"],
        r["missed"] if r["kind"] == "actor" else "-",
        relative(r["last_tick"], now) or "never",
        relative(r["next_run"], now),
        r["last_job_status"] or "-",
    ],
    "(no schedules: a worker registers them when it boots)",
)


# -- registration -------------------------------------------------------------------------


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def _plain_command(
    sub: argparse._SubParsersAction, name: str, func, help: str, *, job_id: bool = False
) -> None:
    """Add a command whose only arguments are ``--json`` and, with ``job_id``, a job id."""
    parser = sub.add_parser(name, help=help)
    if job_id:
        parser.add_argument("id", help=ID_HELP)
    _json_flag(parser)
    parser.set_defaults(func=func)


def add_operator_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``jobs``, ``prune`` and ``schedules`` to the CLI."""
    jobs = sub.add_parser("jobs", help="list, show, retry, requeue, cancel and abort jobs")
    jobs_sub = jobs.add_subparsers(
        dest="jobs_command", metavar="{list,show,retry,requeue,cancel,abort}", required=True
    )

    listing = jobs_sub.add_parser("list", help="the newest jobs first")
    listing.add_argument(
        "--status",
        "--state",
        dest="status",
        choices=states.FILTERS,
        help="only jobs in this state (queued: every waiting job, ready, delayed or paused)",
    )
    listing.add_argument("--queue")
    listing.add_argument("--actor")
    listing.add_argument("--limit", type=positive_int, default=50, help="default 50")
    _json_flag(listing)
    listing.set_defaults(func=run_jobs_list)

    _plain_command(jobs_sub, "show", run_jobs_show, "a job's row and its timeline", job_id=True)

    retry = jobs_sub.add_parser("retry", help="put failed jobs back in their queue")
    which = retry.add_mutually_exclusive_group(required=True)
    which.add_argument("id", nargs="?", help=ID_HELP)
    which.add_argument("--all-failed", action="store_true", help="every failed job")
    retry.add_argument("--queue", help="with --all-failed: only this queue's")
    _json_flag(retry)
    retry.set_defaults(func=run_jobs_retry)

    requeue = jobs_sub.add_parser(
        "requeue",
        help="put jobs whose lease expired (their worker died) back in their queue now",
    )
    which = requeue.add_mutually_exclusive_group(required=True)
    which.add_argument("id", nargs="?", help=ID_HELP)
    which.add_argument("--all-expired", action="store_true", help="every job whose lease expired")
    requeue.add_argument("--queue", help="with --all-expired: only this queue's")
    _json_flag(requeue)
    requeue.set_defaults(func=run_jobs_requeue)

    _plain_command(jobs_sub, "cancel", run_jobs_cancel, "cancel a waiting job", job_id=True)

    abort = jobs_sub.add_parser(
        "abort", help="cancel a waiting job, or stop a running one (it ends cancelled)"
    )
    abort.add_argument("id", help=ID_HELP)
    abort.add_argument(
        "--wait",
        type=non_negative_seconds,
        default=0.0,
        metavar="SECONDS",
        help=(
            "wait up to SECONDS for a running job to stop, the wait for its row included "
            "(default: do not wait; the row is waited for about a second)"
        ),
    )
    _json_flag(abort)
    abort.set_defaults(func=run_jobs_abort)

    prune = sub.add_parser(
        "prune",
        help="run maintenance: partitions ahead, expired days, DEFAULT partitions, expired "
        "rows; prints each step (exit 1 when one failed)",
    )
    prune.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    _json_flag(prune)
    prune.set_defaults(func=run_prune)

    _plain_command(sub, "schedules", run_schedules, "periodic schedules, last tick, next run")
