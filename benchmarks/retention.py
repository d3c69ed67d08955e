"""The retention workloads: what deleting old jobs costs the workers, and whether the tables
stay bounded under churn.

- ``retention``: a table holding ``retention_finished`` finished jobs older than their
  retention age (with their events). One worker drains ``drain`` queued jobs twice: once
  with nothing else running (``baseline_rate``), once while :func:`prune` deletes the
  backlog with the workers' own settings (``rate``: batches of 1,000, the duty-cycle rest)
  from a thread of this process, the same function a worker's maintenance tick runs.
- ``churn``: for ``churn_seconds``, jobs are fed at ``churn_rate`` a second to one worker
  whose scheduler runs retention every 5 s, keeping succeeded jobs 30 s. The job tables'
  size (heap, indexes, TOAST) is sampled throughout; ``q1_mb``, ``mid_mb``, ``q3_mb`` and
  ``end_mb`` are the sizes at a quarter, half, three quarters of the time and at the end:
  bounded means the second half does not grow with the jobs it processed. Autovacuum
  reclaims the deleted rows' space (its naptime is a minute by default), so a run shorter
  than a few minutes ends before the sizes settle. On a server running with autovacuum
  off, the workload vacuums both tables every 30 s itself (``autovacuum`` is 0 in the
  result): without any vacuum, no deleted row's space is ever reused.

  Since migration 0012 finished jobs move to ``jobs_history``, partitioned by day, and
  retention drops whole days: within one day nothing is dropped, so history and events
  grow with the jobs processed, as they must, and go a day at a time. What must stay flat
  is the hot ``jobs`` table the claim reads: ``hot_*_mb`` are its sizes at the same
  moments, ``hot_dead_rows_end`` its dead rows at the end (``pg_stat_user_tables``).
  For a soak (``--churn-seconds 1800``), the first third is warm-up: ``hot_third_mb``
  and ``hot_growth_after_third`` (the hot table at the end over its size at a third),
  ``hot_max_t2_mb`` and ``hot_max_t3_mb`` (its largest sample in the second and in the
  last third: two single samples say where autovacuum happened to be), and
  per third ``finished_per_s_tN`` and ``claim_wait_p99_ms_tN`` (the 99th percentile of
  the wait from insert to claim of the jobs that finished in that third, read from
  history) say whether the drain and the claim stayed flat. ``--hot-table-options``
  sets storage parameters on the hot table after the migrations (autovacuum settings
  against the migrations' own); ``hot_vacuums`` counts the vacuums of it in the run and
  ``hot_dead_rows_max`` its largest sample of dead rows.
"""

from __future__ import annotations

import datetime as dt
import threading
import time

import psycopg

from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.retention import RetentionPolicy, prune

from . import pgdata
from .harness import Harness

RETENTION_SCHEMA = "bench_retention"
CHURN_SCHEMA = "bench_churn"

#: Workers of the retention workload run no scheduler: only the measured pruner deletes.
NO_SCHEDULER = {"DRAMATIQ_PG_SCHEDULER": "false"}

#: Churn workers prune every 5 s and keep succeeded jobs 30 s.
CHURN_RETENTION = {
    "DRAMATIQ_PG_RETENTION_INTERVAL": "5",
    "DRAMATIQ_PG_RETAIN_SUCCEEDED_DAYS": str(30 / 86400),
}


#: Without autovacuum on the server, the churn vacuums the job tables this often (seconds),
#: as autovacuum would with its default one-minute naptime and the tables' 1 % thresholds.
VACUUM_EVERY = 30.0


def _mb(sizes: dict[str, int]) -> float:
    return sum(sizes.values()) / 2**20


def retention_round(harness: Harness, variant, cfg: dict) -> dict:
    """Drain with and without retention deleting a finished backlog (see the module)."""
    url = harness.url
    pgdata.reset_schema(url, RETENTION_SCHEMA)
    try:
        # The days' partitions exist, as the workers' retention runs create them ahead
        # (migration 0012): the backlog goes by dropping its day, not row by row.
        with psycopg.connect(url, autocommit=True) as conn:
            pgdata.history_partitions(conn, RETENTION_SCHEMA, days_back=31)
        # Finished 30 days ago: past the 7-day default for succeeded jobs.
        pgdata.load(
            url, RETENTION_SCHEMA, cfg["retention_finished"], status="succeeded",
            finished_ago_s=30 * 86400,
        )  # fmt: skip
        pgdata.load(url, RETENTION_SCHEMA, cfg["drain"], events=variant.events)
        baseline = harness.drain(
            variant, cfg["drain"], schema=RETENTION_SCHEMA, prepared=True,
            tag="retention-baseline", extra_env=NO_SCHEDULER,
        )  # fmt: skip

        pgdata.load(url, RETENTION_SCHEMA, cfg["drain"], events=variant.events)
        settings = Settings.load(url=url, schema=RETENTION_SCHEMA)
        pool = ProcessPool(settings)
        stop = threading.Event()
        reports = []

        def pruning() -> None:
            reports.append(
                prune(
                    pool,
                    RETENTION_SCHEMA,
                    RetentionPolicy(),
                    batch=settings.retention_batch,
                    stop=stop,
                )  # fmt: skip
            )

        pruner = threading.Thread(target=pruning, name="bench-pruner")
        started = time.monotonic()
        pruner.start()
        try:
            during = harness.drain(
                variant, cfg["drain"], schema=RETENTION_SCHEMA, prepared=True,
                tag="retention-pruning", extra_env=NO_SCHEDULER,
            )  # fmt: skip
        finally:
            still_pruning = pruner.is_alive()
            stop.set()
            pruner.join()
            pool.close()
        elapsed = time.monotonic() - started
        deleted = reports[0].total_jobs if reports else 0
        return {
            "rate": during["rate"],
            "baseline_rate": baseline["rate"],
            "deleted_jobs": float(deleted),
            "delete_rate": deleted / elapsed,
            # 1.0: the pruner was still deleting when the drain ended (the whole drain ran
            # against an active retention run), 0.0: it had finished the backlog before.
            "pruning_throughout": 1.0 if still_pruning else 0.0,
        }
    finally:
        pgdata.drop_schema(url, RETENTION_SCHEMA)


def churn_round(harness: Harness, variant, cfg: dict) -> dict:
    """Feed jobs at a fixed rate for ``churn_seconds`` with retention on; sample sizes."""
    url = harness.url
    seconds = cfg["churn_seconds"]
    rate = cfg["churn_rate"]
    pgdata.reset_schema(url, CHURN_SCHEMA)
    if cfg.get("hot_table_options"):
        pgdata.set_table_options(url, CHURN_SCHEMA, "jobs", cfg["hot_table_options"])
    samples: list[tuple[float, float, float]] = []
    dead_samples: list[int] = []

    def sample(at: float) -> None:
        sizes = pgdata.table_sizes(url, CHURN_SCHEMA)
        samples.append((at, _mb(sizes), sizes["jobs"] / 2**20))
        dead_samples.append(pgdata.dead_rows(url, CHURN_SCHEMA, "jobs"))

    fed = 0
    try:
        with harness.worker(variant, "churn", schema=CHURN_SCHEMA, extra_env=CHURN_RETENTION) as (
            proc,
            state,
        ):
            harness.wait_ready(proc, state)
            vacuums_before = pgdata.vacuum_count(url, CHURN_SCHEMA, "jobs")
            started = time.monotonic()
            server_start = pgdata.server_now(url)
            next_sample = started
            autovacuum = pgdata.autovacuum_on(url)
            next_vacuum = started + VACUUM_EVERY
            while (now := time.monotonic()) - started < seconds:
                if not autovacuum and now >= next_vacuum:
                    # The server runs without autovacuum: do its job, at its pace.
                    pgdata.vacuum(url, CHURN_SCHEMA)
                    next_vacuum = now + VACUUM_EVERY
                due = int((now - started) * rate) - fed
                if due > 0:
                    pgdata.load(
                        url, CHURN_SCHEMA, due, events=variant.events, vacuum=False, notify=True
                    )
                    fed += due
                if now >= next_sample:
                    sample(now - started)
                    next_sample += max(1.0, seconds / 60)
                time.sleep(0.1)
            sample(time.monotonic() - started)
            unfinished = pgdata.count_unfinished(url, CHURN_SCHEMA)
            dead_rows = pgdata.dead_rows(url, CHURN_SCHEMA, "jobs")
            vacuums = pgdata.vacuum_count(url, CHURN_SCHEMA, "jobs") - vacuums_before
            thirds = [
                pgdata.finished_between(
                    url,
                    CHURN_SCHEMA,
                    server_start + dt.timedelta(seconds=seconds * n / 3),
                    server_start + dt.timedelta(seconds=seconds * (n + 1) / 3),
                )
                for n in range(3)
            ]

        def size_at(fraction: float, column: int = 1) -> float:
            return min(samples, key=lambda s: abs(s[0] - seconds * fraction))[column]

        def window_max(start: float, end: float) -> float:
            """The hot table's largest sample from ``start`` to ``end`` (fractions)."""
            inside = [hot for at, _, hot in samples if start * seconds <= at < end * seconds]
            return max(inside, default=0.0)

        mid = size_at(0.5)
        return {
            "jobs_fed": float(fed),
            "autovacuum": 1.0 if autovacuum else 0.0,
            "backlog_at_end": float(unfinished),
            "q1_mb": size_at(0.25),
            "mid_mb": mid,
            "q3_mb": size_at(0.75),
            "end_mb": samples[-1][1],
            "max_mb": max(size for _, size, _ in samples),
            "mb_per_10k_jobs_second_half": (samples[-1][1] - mid) / max(fed / 2, 1) * 10_000,
            "hot_q1_mb": size_at(0.25, 2),
            "hot_mid_mb": size_at(0.5, 2),
            "hot_end_mb": samples[-1][2],
            "hot_max_mb": max(hot for _, _, hot in samples),
            "hot_dead_rows_end": float(dead_rows),
            "hot_dead_rows_max": float(max(dead_samples, default=0)),
            "hot_vacuums": float(vacuums),
            # The soak's flatness, after a third of the time as warm-up: the hot table's
            # size at a third and at the end, and per third the jobs finished a second and
            # the 99th percentile of their wait from insert to claim (the server's clock).
            "hot_third_mb": size_at(1 / 3, 2),
            "hot_growth_after_third": samples[-1][2] / max(size_at(1 / 3, 2), 1e-9),
            # The same flatness read from the largest sample of each third instead of two
            # single samples, which autovacuum decides: a sample just after a vacuum is
            # small, one just before it large, whatever the trend.
            "hot_max_t2_mb": window_max(1 / 3, 2 / 3),
            "hot_max_t3_mb": window_max(2 / 3, 1.01),
            **{
                f"{what}_t{n + 1}": value
                for n, (count, p99) in enumerate(thirds)
                for what, value in (
                    ("finished_per_s", count / (seconds / 3)),
                    ("claim_wait_p99_ms", p99),
                )
            },
        }
    finally:
        pgdata.drop_schema(url, CHURN_SCHEMA)
