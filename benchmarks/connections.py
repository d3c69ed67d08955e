"""What a worker's pool size costs its drain, and how many connections it holds.

    python -m benchmarks.connections [--server embedded|tcp] [--jobs 20000] [--rounds 3]
        [--threads 8,32] [--pools 2,4,10]

For each round, each thread count and each pool size (``DRAMATIQ_PG_POOL_MAX_SIZE``), in
turns: ``--jobs`` queued no-op jobs, drained by one worker process (``dramatiq
benchmarks.actors``) of that many threads, while this process samples
``pg_stat_activity`` every 10 ms and counts the worker's connections (named
``dramatiq-pg-broker/<pid>``). Prints, per configuration, the drain rate of every round
and its median, and the most connections the worker held at once. A worker's budget is
its pool plus one LISTEN connection whatever its threads (see the tuning guide); this says
what a smaller pool costs a drain of no-op jobs, whose statements (claims, group-committed
starts and outcomes) a few connections carry.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import psycopg

from . import pgdata
from .harness import VARIANTS, Harness
from .run import server_url

SCHEMA = "bench_connections"


class Sampler(threading.Thread):
    """The most connections any one other process of the package held at once."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.peak = 0

    def run(self) -> None:
        mine = f"dramatiq-pg-broker/{os.getpid()}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop.is_set():
                row = conn.execute(
                    "SELECT max(n) FROM (SELECT count(*) AS n FROM pg_stat_activity "
                    "WHERE application_name LIKE 'dramatiq-pg-broker/%%' "
                    "AND application_name <> %s GROUP BY application_name) AS per_process",
                    (mine,),
                ).fetchone()
                self.peak = max(self.peak, row[0] or 0)
                time.sleep(0.01)


def drain(harness: Harness, jobs: int, threads: int, pool: int) -> tuple[float, int]:
    """One drain of ``jobs`` no-op jobs; its rate and the worker's peak connections."""
    variant = VARIANTS["postgres"]
    pgdata.empty(harness.url, SCHEMA)
    pgdata.load(harness.url, SCHEMA, jobs, events=variant.events)
    sampler = Sampler(harness.url)
    sampler.start()
    try:
        with harness.worker(
            variant,
            f"connections-{threads}-{pool}",
            schema=SCHEMA,
            expect=jobs,
            threads=threads,
            extra_env={"DRAMATIQ_PG_POOL_MAX_SIZE": str(pool)},
        ) as (proc, state):
            harness.wait_ready(proc, state)
            result = harness.wait_file(
                proc, os.path.join(state, "drain.json"), timeout=jobs / 100 + 60
            )
    finally:
        sampler.stop.set()
        sampler.join(5)
    return jobs / (result["done"] - result["first_start"]), sampler.peak


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.connections", description=__doc__)
    p.add_argument("--server", choices=("embedded", "tcp"), default="embedded")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", default="8,32")
    p.add_argument("--pools", default="2,4,10")
    args = p.parse_args(argv)
    url = server_url(args.server)
    harness = Harness(url, SCHEMA, Path(__file__).resolve().parent / "results", server=args.server)
    configs = [(int(t), int(s)) for t in args.threads.split(",") for s in args.pools.split(",")]
    rates: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    peaks: dict[tuple[int, int], int] = dict.fromkeys(configs, 0)
    pgdata.reset_schema(url, SCHEMA)
    try:
        for n in range(args.rounds):
            for threads, pool in configs:
                rate, peak = drain(harness, args.jobs, threads, pool)
                rates[(threads, pool)].append(rate)
                peaks[(threads, pool)] = max(peaks[(threads, pool)], peak)
                print(
                    f"round {n + 1}: {threads} threads, pool {pool}: {rate:,.0f} msg/s, "
                    f"at most {peak} connections",
                    flush=True,
                )
    finally:
        pgdata.drop_schema(url, SCHEMA)
    print("\nthreads  pool  drain msg/s (median; rounds)            most connections")
    for threads, pool in configs:
        samples = rates[(threads, pool)]
        shown = ", ".join(f"{r:,.0f}" for r in samples)
        print(
            f"{threads:>7}  {pool:>4}  {statistics.median(samples):>8,.0f} ({shown})"
            f"{'':<4}{peaks[(threads, pool)]:>4}"
        )


if __name__ == "__main__":
    main()
