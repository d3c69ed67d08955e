"""The held-snapshot workloads: what a session that keeps the xmin horizon back does to the
workers, and whether the hot table stays flat over a long run.

- ``xmin``: for ``xmin_seconds``, jobs are fed at ``xmin_rate`` a second to one worker
  (1 process x 8 threads) in two runs, taken in turns: a control, and a held run in which
  another session of the same database keeps a REPEATABLE READ snapshot open the whole
  time (it read nothing of the broker's: the horizon is what it holds, not a lock). Each
  minute reports the backlog (runnable jobs not claimed yet), the start latency p50/p99
  (insert to claim, the server's clock, of the jobs claimed in that minute), the claim
  probe's time (the claim's selection of the queue's next 8 jobs, in claim order, timed by
  the server: ``EXPLAIN ANALYZE`` every 2 s, the minute's median), the hot table's size
  (heap, indexes, TOAST; every partition, were the table partitioned; the largest of the samples
  taken with each probe) and its dead rows (the
  statistics collector's, summed over its partitions). Then the held run releases its snapshot
  and samples the hot table every 5 s for ``xmin_recover_seconds``: ``recover_s`` is the
  time until it is back in the control's size class (at most twice the control's size at
  the end of its run, in the same round), ``-1`` when it was not.
- ``soak``: ``soak_seconds`` of ``soak_rate`` jobs a second with the workers' retention
  running every 5 s (succeeded jobs kept 30 s) and their partition maintenance; the same
  per-minute figures, and, with ``soak_hold`` (minutes ``start:end``), a snapshot held
  between them. At the end: the hot table's largest size from minute 10 to the end over
  its largest size in minute 10 (``hot_growth_10_end``, flat: at most 1.1), the history
  partitions made ahead (``partitions_ahead``: days after today that exist) and the rows
  left in DEFAULT partitions.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import time

import psycopg
from psycopg import sql

from . import pgdata
from .actors import QUEUE
from .harness import Harness
from .retention import VACUUM_EVERY

#: Their schemas (``BENCH_XMIN_SCHEMA`` and ``BENCH_SOAK_SCHEMA`` name others, so that two
#: checkouts can measure on one server at once).
XMIN_SCHEMA = os.environ.get("BENCH_XMIN_SCHEMA", "bench_xmin")
SOAK_SCHEMA = os.environ.get("BENCH_SOAK_SCHEMA", "bench_soak")

#: Soak workers prune every 5 s and keep succeeded jobs 30 s (as the churn workload).
SOAK_RETENTION = {
    "DRAMATIQ_PG_RETENTION_INTERVAL": "5",
    "DRAMATIQ_PG_RETAIN_SUCCEEDED_DAYS": str(30 / 86400),
}

#: The claim's selection (claim_jobs' ``picked``), without its row locks: what a claim
#: reads in the claim index before it finds runnable rows.
PROBE = """
EXPLAIN (ANALYZE, FORMAT JSON)
SELECT id FROM {schema}.jobs
WHERE queue_name = %s AND status = 'queued' AND available_at <= now()
ORDER BY priority, available_at, created_at, id
LIMIT 8
"""

#: The hot table: the table itself, or every leaf partition were it partitioned.
HOT_SIZE = """
SELECT coalesce(sum(pg_total_relation_size(t.relid)), 0)::bigint,
       coalesce(sum(s.n_dead_tup), 0)::bigint
FROM (SELECT relid FROM pg_partition_tree(%(t)s::regclass)
      UNION SELECT %(t)s::regclass) AS t
LEFT JOIN pg_stat_user_tables AS s ON s.relid = t.relid
"""

#: The start latency (insert to claim; the load makes jobs runnable a second before their
#: insert, see pgdata.load) of the jobs claimed in [start, end), and their count.
LATENCY = """
SELECT count(*),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY w),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY w)
FROM (
    SELECT (extract(epoch FROM started_at - available_at) - 1) * 1000 AS w
    FROM {schema}.all_jobs
    WHERE started_at >= %s AND started_at < %s
) AS claimed
"""

BACKLOG = """
SELECT count(*) FROM {schema}.jobs
WHERE queue_name = %s AND status = 'queued' AND available_at <= now()
"""


def _q(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(schema))


class Holder:
    """Another session of the same database holding a REPEATABLE READ snapshot open."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, application_name="bench-xmin-holder")
        self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        # The first statement takes the snapshot; it reads nothing of the broker's.
        self.conn.execute("SELECT count(*) FROM pg_class").fetchone()

    def release(self) -> None:
        try:
            self.conn.execute("ROLLBACK")
        finally:
            self.conn.close()


class Sampler:
    """The per-minute figures of one run (see the module)."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema
        self.conn = psycopg.connect(url, autocommit=True, application_name="bench-xmin-sampler")
        self.probes: list[tuple[float, float]] = []  # (elapsed s, ms)
        self.sizes: list[tuple[float, float]] = []  # (elapsed s, MiB), with each probe
        self.minutes: list[dict] = []

    def close(self) -> None:
        self.conn.close()

    def vacuum(self) -> None:
        """What autovacuum would do on a server that runs it: vacuum the hot table (each
        leaf partition, were it partitioned) past its threshold of dead rows (the table's
        own autovacuum_vacuum_threshold, 1,000). A VACUUM of a partition the workers just
        truncated would record it as empty, which no autovacuum does (it visits only
        tables with dead rows)."""
        for (name,) in self.conn.execute(
            "SELECT t.relid::regclass::text FROM (SELECT relid FROM pg_partition_tree("
            "%(t)s::regclass) WHERE isleaf UNION SELECT %(t)s::regclass) AS t"
            " JOIN pg_stat_user_tables AS s ON s.relid = t.relid WHERE s.n_dead_tup >= 1000",
            {"t": f"{self.schema}.jobs"},
        ).fetchall():
            # The name comes from regclass's own output: quoted as needed.
            self.conn.execute(f"VACUUM {name}")

    def now(self) -> dt.datetime:
        return self.conn.execute("SELECT clock_timestamp()").fetchone()[0]

    def hot(self) -> tuple[float, int]:
        size, dead = self.conn.execute(HOT_SIZE, {"t": f"{self.schema}.jobs"}).fetchone()
        return size / 2**20, int(dead)

    def probe(self, at: float) -> None:
        (plan,) = self.conn.execute(_q(PROBE, self.schema), (QUEUE,)).fetchone()
        if isinstance(plan, str):
            plan = json.loads(plan)
        self.probes.append((at, float(plan[0]["Execution Time"])))
        self.sizes.append((at, self.hot()[0]))

    def minute(self, n: int, start: dt.datetime, end: dt.datetime, at: float) -> dict:
        count, p50, p99 = self.conn.execute(_q(LATENCY, self.schema), (start, end)).fetchone()
        (backlog,) = self.conn.execute(_q(BACKLOG, self.schema), (QUEUE,)).fetchone()
        size, dead = self.hot()
        probes = [ms for t, ms in self.probes if at - 60 <= t < at]
        sizes = [mb for t, mb in self.sizes if at - 60 <= t < at]
        row = {
            "minute": n,
            "claimed": int(count),
            "backlog": int(backlog),
            "p50_ms": float(p50 or 0.0),
            "p99_ms": float(p99 or 0.0),
            "claim_ms": statistics.median(probes) if probes else 0.0,
            # The largest of the minute's samples (every 2 s): a sample at the minute's
            # end alone falls at the same point of any periodic maintenance cycle every minute.
            "hot_mb": max([size, *sizes]),
            "hot_mb_at_end": size,
            "dead": dead,
        }
        self.minutes.append(row)
        return row


def _feed_loop(
    harness: Harness,
    url: str,
    schema: str,
    rate: int,
    seconds: float,
    sampler: Sampler,
    events: bool,
    *,
    on_minute=None,
    label: str = "",
) -> None:
    """Feed ``rate`` jobs a second for ``seconds``, probing every 2 s and closing a minute
    every 60 s."""
    started = time.monotonic()
    minute_start = sampler.now()
    # A server without autovacuum (a CI server may run so): the workload vacuums the hot
    # table itself at the pace of the churn workload's (every 30 s).
    autovacuum = pgdata.autovacuum_on(url)
    next_vacuum = started + VACUUM_EVERY
    next_probe = started + 2.0
    next_minute = started + 60.0
    fed = 0
    n = 0
    # A second past the end, so that the last minute closes too.
    while (now := time.monotonic()) - started < seconds + 1.0:
        if not autovacuum and now >= next_vacuum:
            sampler.vacuum()
            next_vacuum = now + VACUUM_EVERY
        due = int((now - started) * rate) - fed
        if due > 0:
            pgdata.load(url, schema, due, events=events, vacuum=False, notify=True)
            fed += due
        if now >= next_probe:
            sampler.probe(now - started)
            next_probe += 2.0
        if now >= next_minute:
            n += 1
            end = sampler.now()
            row = sampler.minute(n, minute_start, end, now - started)
            minute_start = end
            next_minute += 60.0
            harness.log(f"{label} minute {n}: {row}")
            print(
                f"    {label:8} min {n:2}: backlog {row['backlog']:6,}  p50 {row['p50_ms']:7.1f}"
                f" ms  p99 {row['p99_ms']:7.1f} ms  claim {row['claim_ms']:6.2f} ms  hot "
                f"{row['hot_mb']:6.1f} MiB  dead {row['dead']:8,}",
                flush=True,
            )
            if on_minute is not None:
                on_minute(n)
        time.sleep(0.05)


def _flatten(minutes: list[dict]) -> dict:
    out = {}
    for row in minutes:
        for key in ("backlog", "p50_ms", "p99_ms", "claim_ms", "hot_mb", "dead"):
            out[f"{key}_m{row['minute']}"] = float(row[key])
    return out


def xmin_run(harness: Harness, variant, cfg: dict, *, held: bool, reference_mb=None) -> dict:
    """One run of the xmin workload: a control (``held`` False) or a held snapshot."""
    url = harness.url
    schema = XMIN_SCHEMA
    pgdata.reset_schema(url, schema)
    label = "held" if held else "control"
    holder = None
    sampler = Sampler(url, schema)
    try:
        with harness.worker(variant, f"xmin-{label}", schema=schema) as (proc, state):
            harness.wait_ready(proc, state)
            if held:
                holder = Holder(url)
            _feed_loop(
                harness, url, schema, cfg["xmin_rate"], cfg["xmin_seconds"], sampler,
                variant.events, label=label,
            )  # fmt: skip
            result = _flatten(sampler.minutes)
            last = sampler.minutes[-1] if sampler.minutes else {}
            result.update(
                {
                    "backlog_end": float(last.get("backlog", 0)),
                    "p50_ms_end": float(last.get("p50_ms", 0)),
                    "p99_ms_end": float(last.get("p99_ms", 0)),
                    "claim_ms_end": float(last.get("claim_ms", 0)),
                    "hot_mb_end": float(last.get("hot_mb", 0)),
                    "dead_end": float(last.get("dead", 0)),
                }
            )
            if held:
                holder.release()
                holder = None
                # The recovery: the feed goes on, the snapshot is gone.
                target = 2 * (reference_mb or sampler.minutes[0]["hot_mb"])
                released = time.monotonic()
                recover_s = -1.0
                samples = []
                fed_from = time.monotonic()
                fed = 0
                next_sample = released
                autovacuum = pgdata.autovacuum_on(url)
                next_vacuum = released
                while (now := time.monotonic()) - released < cfg["xmin_recover_seconds"]:
                    if not autovacuum and now >= next_vacuum:
                        sampler.vacuum()
                        next_vacuum = now + VACUUM_EVERY
                    due = int((now - fed_from) * cfg["xmin_rate"]) - fed
                    if due > 0:
                        pgdata.load(url, schema, due, events=variant.events, vacuum=False,
                                    notify=True)  # fmt: skip
                        fed += due
                    if now >= next_sample:
                        size, _ = sampler.hot()
                        samples.append((now - released, size))
                        if recover_s < 0 and size <= target:
                            recover_s = now - released
                        next_sample += 5.0
                    time.sleep(0.05)
                result["recover_s"] = recover_s
                result["recover_target_mb"] = target
                for mark in (30, 60, 120):
                    near = [s for t, s in samples if t <= mark]
                    if near:
                        result[f"hot_mb_after_{mark}s"] = near[-1]
                print(
                    f"    released: hot table back to <= {target:.1f} MiB after "
                    f"{recover_s:.0f} s" if recover_s >= 0 else
                    f"    released: hot table not back to <= {target:.1f} MiB within "
                    f"{cfg['xmin_recover_seconds']} s (last {samples[-1][1]:.1f} MiB)",
                    flush=True,
                )  # fmt: skip
        return result
    finally:
        if holder is not None:
            holder.release()
        sampler.close()
        pgdata.drop_schema(url, schema)


def xmin_round(harness: Harness, variant, cfg: dict, measure, key) -> None:
    """A round: the control and the held run, in turns (the control first in odd rounds;
    the recovery's size class is the control's of the same round)."""
    reference: dict[str, float] = {}

    def control() -> dict:
        result = xmin_run(harness, variant, cfg, held=False)
        reference["mb"] = result["hot_mb_end"]
        return result

    def held() -> dict:
        return xmin_run(harness, variant, cfg, held=True, reference_mb=reference.get("mb"))

    runs = [("xmin-control", control), ("xmin-held", held)]
    if cfg.get("round", 1) % 2 == 0:
        runs.reverse()
    for name, fn in runs:
        measure("xmin", key(name), fn)


def soak_round(harness: Harness, variant, cfg: dict) -> dict:
    """The soak (see the module)."""
    url = harness.url
    schema = SOAK_SCHEMA
    pgdata.reset_schema(url, schema)
    hold = cfg.get("soak_hold")
    holder: list[Holder] = []
    sampler = Sampler(url, schema)

    def on_minute(n: int) -> None:
        if hold and n == hold[0] and not holder:
            holder.append(Holder(url))
            print(f"    snapshot held from minute {n}", flush=True)
        if hold and n == hold[1] and holder:
            holder.pop().release()
            print(f"    snapshot released at minute {n}", flush=True)

    try:
        with harness.worker(variant, "soak", schema=schema, extra_env=SOAK_RETENTION) as (
            proc,
            state,
        ):
            harness.wait_ready(proc, state)
            if hold and hold[0] == 0:
                on_minute(0)
            _feed_loop(
                harness, url, schema, cfg["soak_rate"], cfg["soak_seconds"], sampler,
                variant.events, on_minute=on_minute, label="soak",
            )  # fmt: skip
            with psycopg.connect(url, autocommit=True) as conn:
                (ahead,) = conn.execute(
                    "SELECT count(*) FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = "
                    "i.inhrelid WHERE i.inhparent = %s::regclass AND c.relname > "
                    "'jobs_history_succeeded_' || to_char(now() AT TIME ZONE 'UTC', "
                    "'YYYYMMDD')",
                    (f"{schema}.jobs_history_succeeded",),
                ).fetchone()
                (default_rows,) = conn.execute(
                    _q(
                        "SELECT (SELECT count(*) FROM {schema}.jobs_history_succeeded_default)"
                        " + (SELECT count(*) FROM {schema}.job_events_default)",
                        schema,
                    )
                ).fetchone()
        result = _flatten(sampler.minutes)
        mins = sampler.minutes
        at10 = [m["hot_mb"] for m in mins if m["minute"] == 10]
        later = [m["hot_mb"] for m in mins if m["minute"] >= 10]
        if at10 and later:
            result["hot_growth_10_end"] = max(later) / max(at10[0], 1e-9)
        result["partitions_ahead"] = float(ahead)
        result["default_rows"] = float(default_rows)
        return result
    finally:
        for h in holder:
            h.release()
        sampler.close()
        pgdata.drop_schema(url, schema)
