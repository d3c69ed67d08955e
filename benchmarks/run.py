"""The benchmark command: ``python -m benchmarks.run`` (``make bench``).

Runs each workload on each broker, taking turns within one run and repeating the whole
round, then prints a table (median and spread), and writes a JSON file and a PNG chart
under ``benchmarks/results/``. A full run also rewrites ``benchmarks/RESULTS.md``.

PostgreSQL: every workload of this broker runs on two server set-ups, reported as two
columns: ``embedded`` (the local pgserver PostgreSQL a newcomer gets) and ``tcp`` (a standalone
server over TCP, as production runs it: ``BENCH_TCP_URL``, else ``DRAMATIQ_PG_URL``, else
``postgresql://postgres@127.0.0.1:5432/postgres``). Server settings are used as they are;
the run records the ones that matter (``synchronous_commit`` and others) per server. The
benchmark uses its own schemas (``bench`` and ``bench_backlog``), dropped and migrated
afresh at the start and dropped at the end, and for the idle-cost workload a database of
its own (``dramatiq_bench_idle``), dropped after. Redis (127.0.0.1:6379) and RabbitMQ
(127.0.0.1:5672) take part when they answer; their benchmark queues are deleted before and
after every step.

``--against REF`` builds an earlier release of this broker (:mod:`.release`) and runs it as
one more broker, in turns with this checkout, on a schema of its own (``bench_ref``).
The ``life`` workload creates the ``pg_walinspect`` extension where it may, and drops it
at the end if it did (:mod:`.cost`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

from dramatiq_pg_broker.config import mask_url

from . import cost, notify, pgdata, release, report, retention, xmin
from .harness import VARIANTS, BenchError, Harness, group_drain, idle_cost, reachable

WORKLOADS = (
    "enqueue", "enqueue8", "bulk", "drain", "latency", "life", "backlog", "memory", "retention",
    "churn", "scaling", "pgbouncer", "idle", "workflow", "notify", "xmin", "soak",
)  # fmt: skip
#: Long workloads that a full run leaves out unless they are named (``--workloads xmin``).
NAMED_ONLY = ("xmin", "soak")
SERVERS = ("embedded", "tcp")
DEFAULT_TCP_URL = "postgresql://postgres@127.0.0.1:5432/postgres"

FULL = {
    "repeat": 3,
    "enqueue": 10_000,
    "raw": 10_000,
    "bulk": 100_000,
    "drain": 20_000,
    "latency": 300,
    "latency_gap": 0.01,
    "life": 10_000,
    "backlog_finished": 1_000_000,
    "backlog_queued": 100_000,
    "delayed": 100_000,
    "settle": 10.0,
    "enqueue8": 10_000,
    "scaling": 20_000,
    "processes": (1, 2, 4, 8, 16),
    "pool_size": 4,
    "idle_queues": 3,
    "idle_seconds": 20.0,
    "retention_finished": 1_000_000,
    "churn_seconds": 600,
    "churn_rate": 500,
    "workflows": 1_000,
    "workflow_width": 100,
    "notify": 20_000,
    "xmin_seconds": 600,
    "xmin_rate": 300,
    "xmin_recover_seconds": 180,
    "soak_seconds": 1800,
    "soak_rate": 300,
}
QUICK = {
    "repeat": 1,
    "enqueue": 2_000,
    "raw": 2_000,
    "bulk": 20_000,
    "drain": 5_000,
    "latency": 100,
    "latency_gap": 0.01,
    "life": 1_000,
    "backlog_finished": 100_000,
    "backlog_queued": 20_000,
    "delayed": 20_000,
    "settle": 10.0,
    "enqueue8": 2_000,
    "scaling": 3_000,
    "processes": (1, 2, 4, 8, 16),
    "pool_size": 4,
    "idle_queues": 3,
    "idle_seconds": 5.0,
    "retention_finished": 100_000,
    "churn_seconds": 60,
    "churn_rate": 300,
    "workflows": 20,
    "workflow_width": 100,
    "notify": 8_000,
    "xmin_seconds": 180,
    "xmin_rate": 300,
    "xmin_recover_seconds": 120,
    "soak_seconds": 600,
    "soak_rate": 300,
}

#: Which variants each workload runs on.
APPLIES = {
    "enqueue": ("postgres", "postgres-noevents", "postgres-nondurable", "redis", "rabbitmq"),
    "drain": ("postgres", "postgres-noevents", "redis", "rabbitmq"),
    "latency": ("postgres", "postgres-noevents", "postgres-nondurable", "redis", "rabbitmq"),
    "life": ("postgres", "postgres-noevents"),
    "backlog": ("postgres",),
    "memory": ("postgres", "redis", "rabbitmq"),
    "enqueue8": ("postgres", "redis", "rabbitmq"),
    "bulk": ("postgres",),
    "scaling": ("postgres",),
    "pgbouncer": ("postgres",),
    "idle": ("postgres",),
    "retention": ("postgres",),
    "churn": ("postgres",),
    "workflow": ("postgres",),
    "notify": ("postgres", "postgres-notify-statement", "postgres-notify-off"),
    "xmin": ("postgres",),
    "soak": ("postgres",),
}
#: Server settings recorded with the results (never changed by the benchmark).
SERVER_SETTINGS = (
    "server_version", "synchronous_commit", "fsync", "wal_writer_delay", "commit_delay",
    "shared_buffers", "max_connections", "deadlock_timeout",
)  # fmt: skip

#: The run's schemas are named from this (``BENCH_SCHEMA``, default ``bench``): two runs
#: on one shared server at once need two names, or each empties the other's tables.
SCHEMA = os.environ.get("BENCH_SCHEMA", "bench")
IDLE_DATABASE = "dramatiq_bench_idle"
BACKLOG_SCHEMA = f"{SCHEMA}_backlog"
#: The schema of the release named by ``--against``, migrated by that release.
REF_SCHEMA = f"{SCHEMA}_ref"
HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Benchmark this broker side by side with Dramatiq's Redis and RabbitMQ "
        "brokers.",
    )
    p.add_argument("--quick", action="store_true", help="smaller counts, 1 repetition (~3 min)")
    p.add_argument("--repeat", type=int, help="repetitions of the whole round (default 3)")
    p.add_argument(
        "--brokers",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of: {', '.join(VARIANTS)}",
    )
    p.add_argument(
        "--workloads",
        default=",".join(w for w in WORKLOADS if w not in NAMED_ONLY),
        help=f"comma-separated subset of: {', '.join(WORKLOADS)}",
    )
    p.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help="PostgreSQL set-ups, comma-separated: embedded (local pgserver), tcp "
        "(BENCH_TCP_URL, else DRAMATIQ_PG_URL, else 127.0.0.1:5432)",
    )
    p.add_argument(
        "--processes",
        help="worker process counts of the scaling and pgbouncer workloads (default 1,2,4,8,16)",
    )
    p.add_argument(
        "--retention-finished",
        type=int,
        help="finished jobs the retention workload deletes (default 1,000,000)",
    )
    p.add_argument("--churn-seconds", type=int, help="length of the churn workload (default 600)")
    p.add_argument(
        "--churn-rate", type=int, help="jobs a second of the churn workload (default 500)"
    )
    p.add_argument(
        "--workflows",
        type=int,
        help="workflows of a step, a group and a step the workflow workload runs at once "
        "(default 1,000; --quick 20)",
    )
    p.add_argument(
        "--xmin-seconds", type=int, help="length of each run of the xmin workload (default 600)"
    )
    p.add_argument("--xmin-rate", type=int, help="jobs a second of the xmin workload (default 300)")
    p.add_argument(
        "--xmin-recover-seconds",
        type=int,
        help="how long the held run of the xmin workload watches the hot table after the "
        "release (default 180)",
    )
    p.add_argument("--soak-seconds", type=int, help="length of the soak workload (default 1800)")
    p.add_argument("--soak-rate", type=int, help="jobs a second of the soak workload (default 300)")
    p.add_argument(
        "--soak-hold",
        metavar="START:END",
        help="hold a REPEATABLE READ snapshot from minute START to minute END of the soak",
    )
    p.add_argument(
        "--hot-table-options",
        help="storage parameters the churn workload sets on its jobs table after migrating it "
        "(`autovacuum_vacuum_cost_delay=0,autovacuum_vacuum_threshold=100`), to measure "
        "autovacuum settings against the migrations' own",
    )
    p.add_argument(
        "--backlog-finished",
        type=int,
        help="finished jobs in history for the backlog workload (default 1,000,000)",
    )
    p.add_argument(
        "--backlog-queued",
        type=int,
        help="queued jobs of the backlog workload (default 100,000); equal to the drain's "
        "count, the backlog drain differs from the plain drain by the history alone",
    )
    p.add_argument(
        "--against",
        metavar="REF",
        help="also run an earlier release (a git tag, branch or commit, e.g. 994d6c9 for "
        "0.1.0), built once into its own virtualenv under benchmarks/results/.releases/, on "
        f"the workloads {', '.join(release.WORKLOADS)}, in turns with this checkout",
    )
    p.add_argument("--out", type=Path, default=HERE / "results", help="output folder")
    p.add_argument(
        "--results-md",
        choices=("auto", "yes", "no"),
        default="auto",
        help="rewrite benchmarks/RESULTS.md (auto: only after a full run of everything)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="print every measurement")
    args = p.parse_args(argv)
    args.brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for b in args.brokers:
        if b not in VARIANTS:
            p.error(f"unknown broker {b!r}")
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}")
    args.servers = [x.strip() for x in args.servers.split(",") if x.strip()]
    for x in args.servers:
        if x not in SERVERS:
            p.error(f"unknown server {x!r}: expected embedded or tcp")
    if args.processes:
        try:
            args.processes = tuple(int(x) for x in args.processes.split(",") if x.strip())
        except ValueError:
            p.error("--processes takes comma-separated whole numbers, e.g. 1,2,4")
    return args


def server_url(server: str) -> str:
    """The URL of a server set-up (see the module docstring)."""
    if server == "embedded":
        from dramatiq_pg_broker.db.embedded import embedded_url

        return embedded_url()
    return os.environ.get("BENCH_TCP_URL") or os.environ.get("DRAMATIQ_PG_URL") or DEFAULT_TCP_URL


def pg_key(name: str, server: str) -> str:
    """Results key of a PostgreSQL figure on one server set-up: ``postgres@tcp``."""
    return f"{name}@{server}"


def summarize(samples: list[dict], rounds: list[int] | None = None) -> dict:
    """Median, min and max of every metric over the repetitions (a metric missing from
    some repetitions, such as a relation of the WAL breakdown, over those that have it),
    with its samples and the round each was measured in (for ratios within a round)."""
    keys = list(dict.fromkeys(key for s in samples for key in s))
    rounds = rounds or list(range(1, len(samples) + 1))
    out = {}
    for key in keys:
        kept = [(r, s[key]) for r, s in zip(rounds, samples)
                if isinstance(s.get(key), (int, float))]  # fmt: skip
        values = [v for _, v in kept]
        if values:
            out[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "samples": values,
                "rounds": [r for r, _ in kept],
            }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.repeat:
        cfg["repeat"] = args.repeat
    if args.processes:
        cfg["processes"] = args.processes
    if args.retention_finished:
        cfg["retention_finished"] = args.retention_finished
    if args.churn_seconds:
        cfg["churn_seconds"] = args.churn_seconds
    if args.churn_rate:
        cfg["churn_rate"] = args.churn_rate
    if args.workflows:
        cfg["workflows"] = args.workflows
    if args.hot_table_options:
        cfg["hot_table_options"] = args.hot_table_options
    for name in (
        "xmin_seconds",
        "xmin_rate",
        "xmin_recover_seconds",
        "soak_seconds",
        "soak_rate",
    ):
        if getattr(args, name):
            cfg[name] = getattr(args, name)
    if args.soak_hold:
        try:
            start, end = (int(x) for x in args.soak_hold.split(":"))
        except ValueError:
            print("--soak-hold takes START:END in minutes, e.g. 10:20")
            return 2
        cfg["soak_hold"] = (start, end)
    if args.backlog_finished:
        cfg["backlog_finished"] = args.backlog_finished
    if args.backlog_queued:
        cfg["backlog_queued"] = args.backlog_queued
    started = time.monotonic()
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)

    # The release first: a failed build leaves nothing behind on the servers.
    against = None
    if args.against:
        try:
            ref = release.build(args.against, log=lambda text: print(text, flush=True))
        except BenchError as e:
            print(e)
            return 1
        VARIANTS[release.NAME] = ref.variant(REF_SCHEMA)
        for workload in release.WORKLOADS:
            APPLIES[workload] = (*APPLIES[workload], release.NAME)
        if release.NAME not in args.brokers:
            at = args.brokers.index("postgres") + 1 if "postgres" in args.brokers else 0
            args.brokers.insert(at, release.NAME)
        against = {
            "ref": args.against,
            "commit": ref.commit,
            "version": ref.version,
            "not_run": [w for w in args.workloads if w not in release.WORKLOADS],
        }
        print(f"Against {args.against}: release {ref.version} ({ref.commit[:12]}), "
              f"{ref.python}")  # fmt: skip

    harnesses: dict[str, Harness] = {}
    servers: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    walinspect: dict[str, bool] = {}  # server -> whether the run created the extension
    for server in args.servers:
        try:
            url = server_url(server)
            settings = pgdata.server_settings(url, SERVER_SETTINGS)
        except Exception as e:
            skipped[f"server:{server}"] = f"not reachable: {type(e).__name__}: {e}"
            print(f"PostgreSQL {server}: skipped: not reachable ({e})")
            continue
        harnesses[server] = Harness(url, SCHEMA, out_dir, verbose=args.verbose, server=server)
        servers[server] = {"url": mask_url(url), "settings": settings}
        print(f"PostgreSQL {server}: {mask_url(url)}, " + ", ".join(
            f"{k}={v}" for k, v in settings.items()))  # fmt: skip
        if "life" in args.workloads:
            reason, created = cost.prepare(url)
            walinspect[server] = created
            harnesses[server].walinspect = reason is None
            servers[server]["walinspect"] = reason or "available"
            if reason:
                print(f"  no WAL breakdown by relation on {server}: {reason}")
    if not harnesses:
        print("No PostgreSQL server answered.")
        return 1
    first = next(iter(harnesses.values()))

    available = {}
    for name in args.brokers:
        kind = VARIANTS[name].kind
        available[name] = kind == "postgres" or reachable(kind)
    for name in args.brokers:
        if not available[name]:
            skipped[name] = "not reachable"
            print(f"{VARIANTS[name].label}: skipped: not reachable")

    samples: dict[str, dict[str, list[dict]]] = {w: {} for w in WORKLOADS}
    errors: dict[str, dict[str, str]] = {w: {} for w in WORKLOADS}
    # The round of each sample (a failed measurement leaves a gap), for per-round ratios.
    rounds: dict[str, dict[str, list[int]]] = {w: {} for w in WORKLOADS}
    notes: dict[str, dict[str, list[str]]] = {w: {} for w in WORKLOADS}
    current_round = [0]

    def measure(workload: str, name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            result = fn()
        except (BenchError, Exception) as e:  # keep going: one failure is one cell
            errors[workload][name] = f"{type(e).__name__}: {e}"
            print(f"  {workload:9} {name:24} FAILED: {e}", flush=True)
            if args.verbose:
                traceback.print_exc()
            return
        for note in result.pop("notes", None) or ():
            if note not in notes[workload].setdefault(name, []):
                notes[workload][name].append(note)
        samples[workload].setdefault(name, []).append(result)
        rounds[workload].setdefault(name, []).append(current_round[0])
        # The WAL breakdown (rel:..., rec:...) goes to the report, not to this line.
        shown = ", ".join(f"{k}={v:,.2f}" for k, v in result.items()
                          if isinstance(v, float) and ":" not in k)  # fmt: skip
        print(f"  {workload:9} {name:24} {shown}  ({time.monotonic() - t0:.0f}s)", flush=True)

    shared = False
    try:
        # The xmin and soak workloads use schemas of their own: a run of them alone leaves
        # the shared one alone (another run on the same server may be using it).
        shared = any(w not in NAMED_ONLY for w in args.workloads)
        for h in harnesses.values():
            if shared:
                pgdata.reset_schema(h.url, SCHEMA)
        if against:
            for server, h in harnesses.items():
                try:
                    ref.migrate(h.url, REF_SCHEMA)
                except BenchError as e:
                    skipped[f"{release.NAME}@{server}"] = str(e)
                    print(f"{VARIANTS[release.NAME].label} on {server}: {e}")
        if "backlog" in args.workloads and "postgres" in args.brokers:
            for server, h in harnesses.items():
                print(
                    f"Loading the backlog table ({server}): {cfg['backlog_finished']:,} "
                    "finished rows (with their events)...",
                    flush=True,
                )
                pgdata.reset_schema(h.url, BACKLOG_SCHEMA)
                seconds = pgdata.load(h.url, BACKLOG_SCHEMA, cfg["backlog_finished"],
                                      status="succeeded")  # fmt: skip
                print(f"  loaded in {seconds:.0f}s", flush=True)

        for rep in range(cfg["repeat"]):
            print(f"Round {rep + 1} of {cfg['repeat']}", flush=True)
            current_round[0] = rep + 1
            cfg["round"] = rep + 1
            # Brokers and servers take turns; the order rotates every round.
            order = [n for n in args.brokers if available[n]]
            shift = rep % len(order) if order else 0
            order = order[shift:] + order[:shift]
            if against and "postgres" in order and release.NAME in order:
                # This checkout and the release alternate: this checkout first in odd rounds.
                i, j = order.index("postgres"), order.index(release.NAME)
                if (i < j) != (rep % 2 == 0):
                    order[i], order[j] = order[j], order[i]
            server_order = list(harnesses)
            if rep % 2:
                server_order.reverse()
            for workload in args.workloads:
                names = [n for n in order if n in APPLIES[workload]]
                run_workload(workload, names, server_order, harnesses, first, cfg, measure,
                             args.brokers)  # fmt: skip
    finally:
        for server, h in harnesses.items():
            try:
                if shared:
                    pgdata.drop_schema(h.url, BACKLOG_SCHEMA)
                    pgdata.drop_schema(h.url, SCHEMA)
                if against:
                    pgdata.drop_schema(h.url, REF_SCHEMA)
                cost.cleanup(h.url, walinspect.get(server, False))
            except Exception as e:  # the results are worth more: say so, write them
                print(f"Cleaning up {server} failed (its bench schemas may be left): {e}")

    command = "python -m benchmarks.run" + (
        " " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        if (argv if argv is not None else sys.argv[1:])
        else ""
    )
    data = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": {
            "cores": os.cpu_count(),
            "platform": platform.platform(terse=True),
            "python": platform.python_version(),
        },
        "servers": servers,
        "config": cfg,
        "quick": args.quick,
        "brokers": {n: VARIANTS[n].label for n in args.brokers},
        "skipped": skipped,
        "errors": {w: e for w, e in errors.items() if e},
        "results": {
            w: {n: summarize(s, rounds[w][n]) for n, s in per.items()}
            for w, per in samples.items()
            if per
        },
        "notes": {w: per for w, per in notes.items() if per},
        "against": against,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    data["targets"] = report.targets(data)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = out_dir / f"bench-{stamp}.json"
    json_path.write_text(json.dumps(data, indent=2))
    (out_dir / "latest.json").write_text(json.dumps(data, indent=2))
    png_path = out_dir / f"bench-{stamp}.png"
    try:
        report.chart(data, png_path)
    except Exception as e:  # the numbers matter more than the picture
        print(f"Chart not drawn: {type(e).__name__}: {e}")
    table = report.markdown(data)
    (out_dir / "latest.md").write_text(table)
    print()
    print(report.terminal(data))
    print(f"JSON: {json_path}\nChart: {png_path}")
    full = (
        not args.quick
        and set(args.workloads) == set(WORKLOADS) - set(NAMED_ONLY)
        and cfg["retention_finished"] == FULL["retention_finished"]
        and cfg["churn_seconds"] == FULL["churn_seconds"]
        and cfg["churn_rate"] == FULL["churn_rate"]
        and "hot_table_options" not in cfg
        and cfg["backlog_finished"] == FULL["backlog_finished"]
        and cfg["backlog_queued"] == FULL["backlog_queued"]
    )
    if args.results_md == "yes" or (args.results_md == "auto" and full):
        (HERE / "RESULTS.md").write_text(table)
        print(f"Table: {HERE / 'RESULTS.md'}")
    print(f"Finished in {data['elapsed_s'] / 60:.1f} min.")
    return 0


def run_workload(workload, names, server_order, harnesses, first, cfg, measure, brokers):
    """One workload of one round: this broker on every server, the others once."""

    def each(name: str, fn) -> None:
        """``fn(harness)`` on every server for this broker's variants, once for the others."""
        if VARIANTS[name].kind == "postgres":
            for server in server_order:
                measure(workload, pg_key(name, server), lambda h=harnesses[server]: fn(h))
        else:
            measure(workload, name, lambda: fn(first))

    if workload == "enqueue":
        if "postgres" in brokers:
            for server in server_order:
                h = harnesses[server]
                measure("enqueue", pg_key("raw-insert", server),
                        lambda h=h: h.raw_insert(cfg["raw"]))  # fmt: skip
                measure("enqueue", pg_key("raw-insert-autocommit", server),
                        lambda h=h: h.raw_insert(cfg["raw"], autocommit=True))  # fmt: skip
        for n in names:
            each(n, lambda h, v=VARIANTS[n]: h.enqueue(v, cfg["enqueue"]))
    elif workload == "enqueue8":
        for n in names:
            each(n, lambda h, v=VARIANTS[n]: h.enqueue_threads(v, cfg["enqueue8"], threads=8))
    elif workload == "bulk":
        for n in names:
            for server in server_order:
                h = harnesses[server]
                measure("bulk", pg_key("raw-copy", server), lambda h=h: h.raw_copy(cfg["bulk"]))
                measure("bulk", pg_key(n, server),
                        lambda h=h, v=VARIANTS[n]: h.bulk(v, cfg["bulk"]))  # fmt: skip
    elif workload == "drain":
        for n in names:
            each(n, lambda h, v=VARIANTS[n]: h.drain(v, cfg["drain"]))
    elif workload == "life":
        if "postgres" in brokers:
            # The framework-free floor of a job's life (benchmarks/floor.py), on each server.
            for server in server_order:
                measure("life", pg_key("floor", server),
                        lambda h=harnesses[server]: h.life_floor(cfg["life"]))  # fmt: skip
        for n in names:
            each(n, lambda h, v=VARIANTS[n]: h.life(v, cfg["life"]))
    elif workload == "latency":
        if "postgres" in brokers:
            # PostgreSQL's own floor (benchmarks/floor.py), beside the broker on each server.
            for server in server_order:
                h = harnesses[server]
                floor = lambda h=h: h.latency_floor(cfg["latency"], cfg["latency_gap"])  # noqa: E731
                measure("latency", pg_key("floor", server), floor)
        for n in names:
            each(n, lambda h, v=VARIANTS[n]: h.latency(v, cfg["latency"], cfg["latency_gap"]))
    elif workload == "backlog":
        for n in names:
            each(n, lambda h, v=VARIANTS[n]: backlog_round(h, v, cfg))
    elif workload == "memory":
        for n in names:
            each(n, lambda h, v=VARIANTS[n]: h.memory(v, cfg["delayed"], cfg["settle"]))
    elif workload in ("retention", "churn"):
        step = retention.retention_round if workload == "retention" else retention.churn_round
        for n in names:
            each(n, lambda h, v=VARIANTS[n], step=step: step(h, v, cfg))
    elif workload == "xmin":
        for n in names:
            for server in server_order:
                xmin.xmin_round(harnesses[server], VARIANTS[n], cfg,
                                lambda w, name, fn: measure(w, name, fn),
                                lambda name, server=server: pg_key(name, server))  # fmt: skip
    elif workload == "soak":
        for n in names:
            each(n, lambda h, v=VARIANTS[n]: xmin.soak_round(h, v, cfg))
    elif workload in ("scaling", "pgbouncer"):
        pool = cfg["pool_size"] if workload == "pgbouncer" else None
        for n in names:
            for server in server_order:
                for p in cfg["processes"]:
                    measure(
                        workload,
                        pg_key(f"{p}p", server),
                        lambda h=harnesses[server], v=VARIANTS[n], p=p: group_drain(
                            h, v, cfg["scaling"], p, threads=2, pool_size=pool
                        ),
                    )
    elif workload == "workflow":
        # Workflows of a step, a group and a step beside as many plain jobs, in turns (the
        # order swaps every round), on each server: ratios within a round. With
        # --against, the release's workflows too (``workflow-ref``), in the same turns.
        for server in server_order:
            h = harnesses[server]
            kinds = [("plain", "postgres", True), ("workflow", "postgres", False)]
            if release.NAME in names:
                kinds.append(("workflow-ref", release.NAME, False))
            _WORKFLOW_TURNS[0] += 1
            shift = _WORKFLOW_TURNS[0] % len(kinds)
            kinds = kinds[shift:] + kinds[:shift]
            if _WORKFLOW_TURNS[0] % 2 == 0:
                kinds.reverse()
            for label, name, plain in kinds:
                measure(
                    "workflow",
                    pg_key(label, server),
                    lambda h=h, name=name, plain=plain: h.workflow_life(
                        VARIANTS[name], cfg["workflows"], cfg["workflow_width"], plain
                    ),
                )
    elif workload == "notify":
        for n in names:
            each(n, lambda h, v=VARIANTS[n]: notify.sends(h, v, cfg["notify"]))
    elif workload == "idle":
        for n in names:
            each(
                n,
                lambda h, v=VARIANTS[n]: idle_cost(
                    h, v, cfg["idle_queues"], cfg["idle_seconds"], IDLE_DATABASE
                ),
            )


#: How many times the workflow workload ran on a server: plain jobs go first every other
#: time.
_WORKFLOW_TURNS = [0]


def backlog_round(harness: Harness, variant, cfg: dict) -> dict:
    """Drain with the big table: finished history plus a queue of waiting rows, of which
    the worker's clock covers the first ``drain`` outcomes."""
    url = harness.url
    pgdata.delete_unfinished(url, BACKLOG_SCHEMA)
    pgdata.load(url, BACKLOG_SCHEMA, cfg["backlog_queued"], events=variant.events)
    try:
        return harness.drain(
            variant, cfg["drain"], schema=BACKLOG_SCHEMA, prepared=True, tag="backlog"
        )
    finally:
        pgdata.delete_unfinished(url, BACKLOG_SCHEMA)


if __name__ == "__main__":
    sys.exit(main())
