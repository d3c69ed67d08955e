"""The benchmark command: ``python -m benchmarks.run`` (``make bench``).

Runs each workload on each broker, taking turns within one run and repeating the whole
round, then prints a table (median and spread), and writes a JSON file and a PNG chart
under ``benchmarks/results/``. A full run also rewrites ``benchmarks/RESULTS.md``.

PostgreSQL: ``DRAMATIQ_PG_URL``, else the embedded local server. The benchmark uses its own
schemas (``bench`` and ``bench_backlog``), dropped and migrated afresh at the start and
dropped at the end. Redis (127.0.0.1:6379) and RabbitMQ (127.0.0.1:5672) take part when
they answer; their benchmark queues are deleted before and after every step.
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

from . import pgdata, report, retention
from .harness import VARIANTS, BenchError, Harness, reachable

WORKLOADS = ("enqueue", "bulk", "drain", "latency", "backlog", "memory", "retention", "churn")

FULL = {
    "repeat": 3,
    "enqueue": 10_000,
    "raw": 10_000,
    "bulk": 100_000,
    "drain": 20_000,
    "latency": 300,
    "latency_gap": 0.01,
    "backlog_finished": 1_000_000,
    "backlog_queued": 100_000,
    "delayed": 100_000,
    "settle": 10.0,
    "retention_finished": 1_000_000,
    "churn_seconds": 600,
    "churn_rate": 500,
}
QUICK = {
    "repeat": 1,
    "enqueue": 2_000,
    "raw": 2_000,
    "bulk": 20_000,
    "drain": 5_000,
    "latency": 100,
    "latency_gap": 0.01,
    "backlog_finished": 100_000,
    "backlog_queued": 20_000,
    "delayed": 20_000,
    "settle": 10.0,
    "retention_finished": 100_000,
    "churn_seconds": 60,
    "churn_rate": 300,
}

#: Which variants each workload runs on.
APPLIES = {
    "enqueue": ("postgres", "postgres-noevents", "redis", "rabbitmq"),
    "bulk": ("postgres",),
    "drain": ("postgres", "postgres-noevents", "redis", "rabbitmq"),
    "latency": ("postgres", "postgres-noevents", "redis", "rabbitmq"),
    "backlog": ("postgres",),
    "memory": ("postgres", "redis", "rabbitmq"),
    "retention": ("postgres",),
    "churn": ("postgres",),
}

SCHEMA = "bench"
BACKLOG_SCHEMA = "bench_backlog"
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
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of: {', '.join(WORKLOADS)}",
    )
    p.add_argument(
        "--retention-finished",
        type=int,
        help="finished jobs the retention workload deletes (default 1,000,000)",
    )
    p.add_argument("--churn-seconds", type=int, help="length of the churn workload (default 600)")
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
    return args


def database_url() -> str:
    url = os.environ.get("DRAMATIQ_PG_URL")
    if url:
        return url
    from dramatiq_pg_broker.config import Settings
    from dramatiq_pg_broker.db import resolve_url

    return resolve_url(Settings.load())


def summarize(samples: list[dict]) -> dict:
    """Median, min and max of every metric over the repetitions."""
    keys = samples[0].keys() if samples else ()
    out = {}
    for key in keys:
        values = [s[key] for s in samples if isinstance(s.get(key), (int, float))]
        if values:
            out[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "samples": values,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.repeat:
        cfg["repeat"] = args.repeat
    if args.retention_finished:
        cfg["retention_finished"] = args.retention_finished
    if args.churn_seconds:
        cfg["churn_seconds"] = args.churn_seconds
    started = time.monotonic()
    url = database_url()
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    harness = Harness(url, SCHEMA, out_dir, verbose=args.verbose)

    available = {}
    for name in args.brokers:
        kind = VARIANTS[name].kind
        available[name] = kind == "postgres" or reachable(kind)
    skipped = [n for n in args.brokers if not available[n]]
    for name in skipped:
        print(f"{VARIANTS[name].label}: skipped: not reachable")

    samples: dict[str, dict[str, list[dict]]] = {w: {} for w in WORKLOADS}
    errors: dict[str, dict[str, str]] = {w: {} for w in WORKLOADS}

    def measure(workload: str, name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            result = fn()
        except (BenchError, Exception) as e:  # keep going: one failure is one cell
            errors[workload][name] = f"{type(e).__name__}: {e}"
            print(f"  {workload:8} {name:18} FAILED: {e}", flush=True)
            if args.verbose:
                traceback.print_exc()
            return
        samples[workload].setdefault(name, []).append(result)
        shown = ", ".join(f"{k}={v:,.1f}" for k, v in result.items() if isinstance(v, float))
        print(f"  {workload:8} {name:18} {shown}  ({time.monotonic() - t0:.0f}s)", flush=True)

    pgdata.reset_schema(url, SCHEMA)
    try:
        if "backlog" in args.workloads and "postgres" in args.brokers:
            print(
                f"Loading the backlog table: {cfg['backlog_finished']:,} finished rows "
                "(with their events)...",
                flush=True,
            )
            pgdata.reset_schema(url, BACKLOG_SCHEMA)
            seconds = pgdata.load(url, BACKLOG_SCHEMA, cfg["backlog_finished"], status="succeeded")
            print(f"  loaded in {seconds:.0f}s", flush=True)

        for rep in range(cfg["repeat"]):
            print(f"Round {rep + 1} of {cfg['repeat']}", flush=True)
            # Brokers take turns; the order rotates every round.
            order = [n for n in args.brokers if available[n]]
            shift = rep % len(order) if order else 0
            order = order[shift:] + order[:shift]
            for workload in args.workloads:
                names = [n for n in order if n in APPLIES[workload]]
                if workload == "enqueue":
                    if "postgres" in args.brokers:
                        measure("enqueue", "raw-insert", lambda: harness.raw_insert(cfg["raw"]))
                        measure(
                            "enqueue",
                            "raw-insert-autocommit",
                            lambda: harness.raw_insert(cfg["raw"], autocommit=True),
                        )
                    for n in names:
                        v = VARIANTS[n]
                        measure("enqueue", n, lambda v=v: harness.enqueue(v, cfg["enqueue"]))
                elif workload == "bulk":
                    if names:
                        measure("bulk", "raw-copy", lambda: harness.raw_copy(cfg["bulk"]))
                    for n in names:
                        v = VARIANTS[n]
                        measure("bulk", n, lambda v=v: harness.bulk(v, cfg["bulk"]))
                elif workload == "drain":
                    for n in names:
                        v = VARIANTS[n]
                        measure("drain", n, lambda v=v: harness.drain(v, cfg["drain"]))
                elif workload == "latency":
                    for n in names:
                        v = VARIANTS[n]
                        measure(
                            "latency",
                            n,
                            lambda v=v: harness.latency(v, cfg["latency"], cfg["latency_gap"]),
                        )
                elif workload == "backlog":
                    for n in names:
                        v = VARIANTS[n]
                        measure("backlog", n, lambda v=v: backlog_round(harness, v, cfg))
                elif workload in ("retention", "churn"):
                    step = (
                        retention.retention_round
                        if workload == "retention"
                        else (retention.churn_round)
                    )
                    for n in names:
                        v = VARIANTS[n]
                        measure(workload, n, lambda v=v, step=step: step(harness, v, cfg))
                elif workload == "memory":
                    for n in names:
                        v = VARIANTS[n]
                        measure(
                            "memory",
                            n,
                            lambda v=v: harness.memory(v, cfg["delayed"], cfg["settle"]),
                        )
    finally:
        pgdata.drop_schema(url, BACKLOG_SCHEMA)
        pgdata.drop_schema(url, SCHEMA)

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
            "postgresql": pgdata.server_version(url),
        },
        "config": cfg,
        "quick": args.quick,
        "brokers": {n: VARIANTS[n].label for n in args.brokers},
        "skipped": {n: "not reachable" for n in skipped},
        "errors": {w: e for w, e in errors.items() if e},
        "results": {
            w: {n: summarize(s) for n, s in per.items()} for w, per in samples.items() if per
        },
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    data["targets"] = report.targets(data)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = out_dir / f"bench-{stamp}.json"
    json_path.write_text(json.dumps(data, indent=2))
    (out_dir / "latest.json").write_text(json.dumps(data, indent=2))
    png_path = out_dir / f"bench-{stamp}.png"
    report.chart(data, png_path)
    table = report.markdown(data)
    (out_dir / "latest.md").write_text(table)
    print()
    print(report.terminal(data))
    print(f"JSON: {json_path}\nChart: {png_path}")
    full = (
        not args.quick
        and set(args.workloads) == set(WORKLOADS)
        and cfg["retention_finished"] == FULL["retention_finished"]
        and cfg["churn_seconds"] == FULL["churn_seconds"]
    )
    if args.results_md == "yes" or (args.results_md == "auto" and full):
        (HERE / "RESULTS.md").write_text(table)
        print(f"Table: {HERE / 'RESULTS.md'}")
    print(f"Finished in {data['elapsed_s'] / 60:.1f} min.")
    return 0


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
