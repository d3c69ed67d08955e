"""How long a job waits after its worker died: the lease, then the reaper.

    python -m benchmarks.recovery [--server embedded|tcp] [--leases 2,5] [--reapers 1,10]
        [--rounds 3]

For each round and each pair of ``lease_seconds`` and ``reaper_interval``, in turns: one
worker process (``dramatiq benchmarks.actors``, 8 threads) runs with those settings; this
process claims one queued job as a worker that then dies (it never renews the lease it
took, of ``lease_seconds``), and times, by the database's clock, from that claim to the
job's success in the running worker, whose reaper gave it back. Prints every sample and
the median per pair.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.jobs import JobStore

from . import pgdata
from .actors import QUEUE
from .harness import VARIANTS, Harness
from .run import server_url

SCHEMA = "bench_recovery"


def sample(harness: Harness, store: JobStore, lease: float) -> float:
    """One job claimed by a worker that dies; seconds until the running worker finished it."""
    url = harness.url
    pgdata.load(url, SCHEMA, 1, events=True)
    with psycopg.connect(url, autocommit=True) as conn:
        claimed_at = conn.execute("SELECT now()").fetchone()[0]
    (job,) = store.claim(QUEUE, 1, f"gone:{uuid.uuid4().hex[:8]}:MainThread:x", lease)
    deadline = time.monotonic() + lease + 120
    query = sql.SQL("SELECT finished_at FROM {}.jobs_history WHERE id = %s").format(
        sql.Identifier(SCHEMA)
    )
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(query, (job.id,)).fetchone()
            if row is not None:
                return (row[0] - claimed_at).total_seconds()
            time.sleep(0.05)
    raise RuntimeError(f"job {job.id} was not recovered within {lease + 120:.0f} s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recovery", description=__doc__)
    p.add_argument("--server", choices=("embedded", "tcp"), default="embedded")
    p.add_argument("--leases", default="2,5")
    p.add_argument("--reapers", default="1,10")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    url = server_url(args.server)
    harness = Harness(url, SCHEMA, Path(__file__).resolve().parent / "results", server=args.server)
    pairs = [
        (float(lease), float(reaper))
        for lease in args.leases.split(",")
        for reaper in args.reapers.split(",")
    ]
    samples: dict[tuple[float, float], list[float]] = {pair: [] for pair in pairs}
    pgdata.reset_schema(url, SCHEMA)
    store = JobStore(ProcessPool(Settings(url=url, schema=SCHEMA)), SCHEMA)
    try:
        for n in range(args.rounds):
            for lease, reaper in pairs:
                env = {
                    "DRAMATIQ_PG_LEASE_SECONDS": str(lease),
                    "DRAMATIQ_PG_REAPER_INTERVAL": str(reaper),
                }
                with harness.worker(
                    VARIANTS["postgres"], f"recovery-{lease:g}-{reaper:g}", schema=SCHEMA,
                    extra_env=env,
                ) as (proc, state):  # fmt: skip
                    harness.wait_ready(proc, state)
                    seconds = sample(harness, store, lease)
                samples[(lease, reaper)].append(seconds)
                print(
                    f"round {n + 1}: lease {lease:g} s, reaper every {reaper:g} s: job done "
                    f"{seconds:.2f} s after the dead worker's claim",
                    flush=True,
                )
    finally:
        store.pool.close()
        pgdata.drop_schema(url, SCHEMA)
    print("\nlease s  reaper s  claim to done, s (median; rounds)")
    for lease, reaper in pairs:
        values = samples[(lease, reaper)]
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"{lease:>7g}  {reaper:>8g}  {statistics.median(values):.2f} ({shown})")


if __name__ == "__main__":
    main()
