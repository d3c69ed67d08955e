"""Load test of partition maintenance: does it ever stall or deadlock the hot path?

``python -m benchmarks.maintenance_load --seconds 60 --default-rows 2000000 --threads 4``

For ``--seconds``, ``--threads`` threads each send, claim and complete jobs continuously
(one job at a time, each step its own statement and commit, as a worker's are), one send
in five a keyed send that reuses the key of a job finished on a day being dropped, stamped
on that day (its probe reads that day's partitions, its key is one of that day's rows). At
the same time:

- maintenance (:func:`dramatiq_pg_broker.retention.prune`, the function the workers'
  schedule runs) runs in a loop: each run's clock is one day later than the last, with the
  ages one day longer, so every run attaches a new day ahead while the cutoff stays a week
  before today; the expired day (ten days ago) is refilled with keyed jobs before each run,
  so every run drops it;
- a long reader holds ACCESS SHARE on ``jobs_history`` for 5 s out of every 6 (a
  ``pg_dump``, a slow admin query);
- ``--default-rows`` events (and a tenth as many finished jobs) sit in the DEFAULT
  partitions, on days two to four days ago, which the first runs move out.

It prints the slowest single send (plain sends and the keyed sends of the expiring day
apart), claim and outcome, when the three slowest of each ended (seconds after the load
started), their 99th percentiles, the errors (deadlocks counted apart) and what the
maintenance steps reported. Plain sends carry no timestamp and keyed sends are stamped on
the expiring day, so both read history through its parents (``DEFAULT`` partitions
included). ``--no-maintenance`` runs the same load without maintenance: the control.
``--log`` prints maintenance's log on stderr (each try given up, with the lock's holder;
each maintenance transaction's duration); ``--batch`` sets the rows a maintenance
transaction moves or deletes.
``--warmup`` seconds of the same load run first, without maintenance or the long reader:
a process's first statements pay for its connections and their catalog caches, which
belongs to no maintenance step; their figures are reported apart (``warmup``), their
errors counted with the rest.
Results are one run on whatever else the machine is doing: compare against the control
of the same moment.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import logging
import os
import random
import threading
import time
import uuid

import psycopg
from psycopg import sql

from dramatiq_pg_broker import retention
from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.history import ddl
from dramatiq_pg_broker.jobs import Attempt, JobStore, NewJob
from dramatiq_pg_broker.migrate import migrate
from dramatiq_pg_broker.retention import RetentionPolicy, prune

SCHEMA = "bench_maintenance"
#: Keyed jobs put on the expiring day before each maintenance run.
KEYS_PER_RUN = 200
#: The expiring day, and the retention age the cutoff keeps (days before today).
EXPIRED_DAYS_AGO = 10
AGE_DAYS = 7


def setup(url: str, schema: str, default_rows: int) -> dt.datetime:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    migrate(url, schema)
    q = sql.Identifier(schema)
    with psycopg.connect(url, autocommit=True) as conn:
        now = conn.execute("SELECT now()").fetchone()[0]
        # Events and finished jobs of days without partitions: the DEFAULT partitions.
        conn.execute(
            sql.SQL(
                "INSERT INTO {q}.job_events (job_id, type, attempt, created_at)"
                " SELECT gen_random_uuid(), 'created', 0,"
                "        now() - interval '2 days' - (n %% 3) * interval '1 day'"
                "        - (n %% 86000) * interval '1 second'"
                " FROM generate_series(1, %(n)s) AS n"
            ).format(q=q),
            {"n": default_rows},
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {q}.jobs_history (id, queue_name, actor_name, message, status,"
                " attempts, max_attempts, created_at, updated_at, finished_at)"
                " SELECT gen_random_uuid(), 'old', 'act', '{{}}', 'succeeded', 1, 3, t, t, t"
                " FROM generate_series(1, %(n)s) AS n,"
                " LATERAL (SELECT now() - interval '2 days' - (n %% 3) * interval '1 day'"
                "          - (n %% 86000) * interval '1 second' AS t) AS at"
            ).format(q=q),
            {"n": default_rows // 10},
        )
        conn.execute(sql.SQL("ANALYZE {q}.job_events_default").format(q=q))
    return now


def refill_expired(
    url: str, schema: str, expired: dt.datetime, run: int, pool: ProcessPool | None = None
) -> list[str]:
    """Make the expired day's partitions again and put keyed finished jobs in them;
    returns their keys. While the load runs (``pool`` given) the partitions are attached
    the way maintenance attaches a day it moved out of DEFAULT (never queueing behind a
    long holder, the DEFAULT partition's scan spared by a constraint), so that this
    harness does not itself stall the hot path; a day not attached within a few tries
    leaves the keyed jobs in DEFAULT, where the ``default`` step deletes them."""
    q = sql.Identifier(schema)
    day = expired.astimezone(dt.timezone.utc).date()
    keys = [f"expiring-{run}-{i}" for i in range(KEYS_PER_RUN)]
    if pool is not None:
        attach_past_day(pool, schema, day)
    with psycopg.connect(url, autocommit=True) as conn:
        if pool is None:
            conn.execute(
                sql.SQL("SELECT {q}.create_history_partitions(%s, %s)").format(q=q), (day, day)
            )
        with conn.transaction():
            conn.execute(
                sql.SQL(
                    "WITH j AS (INSERT INTO {q}.jobs_history (id, queue_name, actor_name,"
                    " message, status, attempts, max_attempts, idempotency_key, created_at,"
                    " updated_at, finished_at)"
                    " SELECT gen_random_uuid(), 'hot', 'act', '{{}}', 'succeeded', 1, 3, k,"
                    " %(at)s, %(at)s, %(at)s FROM unnest(%(keys)s::text[]) AS k"
                    " RETURNING actor_name, idempotency_scope, idempotency_key, id)"
                    " INSERT INTO {q}.job_keys SELECT * FROM j ON CONFLICT DO NOTHING"
                ).format(q=q),
                {"at": expired, "keys": keys},
            )
    return keys


def attach_past_day(pool: ProcessPool, schema: str, day: dt.date) -> None:
    run = retention._Run(
        pool,
        schema,
        RetentionPolicy(),
        batch=1000,
        dry_run=False,
        budget_seconds=None,
        stop=None,
        rest=False,
        partitions_ahead=0,
    )
    for parent in ddl.PARENTS:
        name = ddl._partition_name(parent, day)
        for _ in range(10):
            try:
                run.ddl(run.queries["prepare_partition"], {"parent": parent, "day": day})
            except ddl.LockBusy:
                continue
            with pool.connection() as conn:
                attached = conn.execute(
                    "SELECT relispartition FROM pg_class WHERE oid = to_regclass(%s)",
                    (f"{schema}.{name}",),
                ).fetchone()
            if (attached and attached[0]) or run.attach_moved(
                parent, day, f"{parent}_default", lambda: None
            ):
                break
            time.sleep(random.uniform(0.05, 0.2))


class Load:
    def __init__(self, url: str, schema: str, threads: int, expired: dt.datetime) -> None:
        self.pool = ProcessPool(Settings.load(url=url, schema=schema, pool_max_size=threads + 4))
        self.store = JobStore(self.pool, schema)
        self.threads = threads
        self.expired_ms = int(expired.timestamp() * 1000)
        self.keys: list[str] = []
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        #: op -> (seconds it took, seconds after the load started when it ended)
        self.slowest: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        self.started = time.monotonic()
        #: op -> summary of the warm-up's timings, set by :meth:`measure_from_now`
        self.warmup: dict[str, dict] = {}
        self.errors: collections.Counter = collections.Counter()
        self.deadlocks = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def measure_from_now(self) -> None:
        """End the warm-up: its timings are kept apart and the measured load starts."""
        with self.lock:
            self.warmup = {op: summary(times) for op, times in self.times.items()}
            self.times = collections.defaultdict(list)
            self.slowest = collections.defaultdict(list)
            self.started = time.monotonic()

    def timed(self, op: str, fn):
        started = time.monotonic()
        try:
            return fn()
        except psycopg.errors.DeadlockDetected:
            with self.lock:
                self.deadlocks += 1
                self.errors[f"{op}: deadlock"] += 1
        except Exception as e:  # noqa: BLE001 - counted and reported
            with self.lock:
                self.errors[f"{op}: {type(e).__name__}: {str(e).splitlines()[0][:80]}"] += 1
        finally:
            ended = time.monotonic()
            with self.lock:
                self.times[op].append(ended - started)
                slowest = self.slowest[op]
                slowest.append((ended - started, ended - self.started))
                slowest.sort(reverse=True)
                del slowest[3:]
        return None

    def worker(self, n: int) -> None:
        queue = f"hot{n}"
        rounds = 0
        while not self.stop.is_set():
            rounds += 1
            keys = self.keys
            if rounds % 5 == 0 and keys:
                job = NewJob(
                    str(uuid.uuid4()),
                    queue,
                    "act",
                    message={},
                    max_attempts=3,
                    idempotency_key=random.choice(keys),
                    sent_at_ms=self.expired_ms,
                )
            else:
                job = NewJob(str(uuid.uuid4()), queue, "act", message={"n": rounds}, max_attempts=3)
            op = "keyed_send" if job.idempotency_key else "send"
            sent = self.timed(op, lambda job=job: self.store.enqueue(job))
            if sent is None or not sent.created:
                continue
            claimed = self.timed("claim", lambda: self.store.claim(queue, 1, f"w{n}", 30))
            for c in claimed or ():
                self.timed(
                    "outcome",
                    lambda c=c: self.store.complete([Attempt(c.id, f"w{n}", c.attempts)]),
                )

    def close(self) -> None:
        self.pool.close()


def long_reader(url: str, schema: str, stop: threading.Event) -> None:
    table = sql.Identifier(schema, "jobs_history")
    with psycopg.connect(url) as conn:
        while not stop.is_set():
            conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table))
            stop.wait(5)
            conn.rollback()
            stop.wait(1)


def maintenance(
    load: Load, url: str, schema: str, now: dt.datetime, stop, steps, runs, batch: int
) -> None:
    pool = ProcessPool(Settings.load(url=url, schema=schema))
    expired = now - dt.timedelta(days=EXPIRED_DAYS_AGO)
    try:
        k = 0
        while not stop.is_set():
            k += 1
            load.keys = refill_expired(url, schema, expired, k, pool)
            age = dt.timedelta(days=AGE_DAYS + k)
            policy = RetentionPolicy(succeeded=age, failed=age, cancelled=age)
            started = time.monotonic()
            report = prune(
                pool,
                schema,
                policy,
                now=dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=k),
                stop=stop,
                batch=batch,
            )
            runs.append(
                {
                    "seconds": round(time.monotonic() - started, 2),
                    "created": report.created,
                    "dropped": len(report.dropped),
                    "moved": sum(report.moved.values()),
                    "steps": {
                        name: step.state + (f": {step.detail or step.error}"[:160])
                        for name, step in report.steps.items()
                        if name in ("create", "drop", "default")
                    },
                }
            )
            for name, step in report.steps.items():
                steps[(name, step.state)] += 1
                if step.state == "failed":
                    steps[(name, f"error: {step.error}")] += 1
    finally:
        pool.close()


def summary(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {
        "count": len(values),
        "max_ms": round(ordered[-1] * 1000, 1),
        "p99_ms": round(p99 * 1000, 1),
        "median_ms": round(ordered[len(ordered) // 2] * 1000, 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--default-rows", type=int, default=500_000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=5, help="seconds of load before measuring")
    parser.add_argument("--no-maintenance", action="store_true", help="the control run")
    parser.add_argument(
        "--batch", type=int, default=1000, help="rows a maintenance transaction moves or deletes"
    )
    parser.add_argument("--schema", default=SCHEMA)
    parser.add_argument("--log", action="store_true", help="maintenance's log on stderr")
    parser.add_argument(
        "--url",
        default=os.environ.get("DRAMATIQ_PG_URL") or os.environ.get("DRAMATIQ_PG_TEST_URL"),
    )
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("give --url or set DRAMATIQ_PG_URL")

    started = time.monotonic()
    now = setup(args.url, args.schema, args.default_rows)
    print(f"setup: {time.monotonic() - started:.1f}s", flush=True)
    expired = now - dt.timedelta(days=EXPIRED_DAYS_AGO)
    if args.log:
        logging.basicConfig(
            level=logging.DEBUG, format="%(relativeCreated)8.0f ms %(name)s %(message)s"
        )
        logging.getLogger("psycopg").setLevel(logging.WARNING)
    load = Load(args.url, args.schema, args.threads, expired)
    load.keys = refill_expired(args.url, args.schema, expired, 0)
    stop = threading.Event()
    steps: collections.Counter = collections.Counter()
    runs: list[dict] = []
    threads = [threading.Thread(target=load.worker, args=(n,)) for n in range(args.threads)]
    for t in threads:
        t.start()
    stop.wait(args.warmup)
    load.measure_from_now()
    others = [threading.Thread(target=long_reader, args=(args.url, args.schema, stop))]
    if not args.no_maintenance:
        others.append(
            threading.Thread(
                target=maintenance,
                args=(load, args.url, args.schema, now, stop, steps, runs, args.batch),
            )
        )
    for t in others:
        t.start()
    threads += others
    logging.getLogger(__name__).info("load started")
    stop.wait(args.seconds)
    stop.set()
    load.stop.set()
    for t in threads:
        t.join(120)
    load.close()
    result = {
        "seconds": args.seconds,
        "warmup": {"seconds": args.warmup, **load.warmup},
        "threads": args.threads,
        "default_rows": args.default_rows,
        "maintenance": not args.no_maintenance,
        "batch": args.batch,
        **{
            op: {
                **summary(load.times[op]),
                "slowest_at_s": [(round(t * 1000, 1), round(at, 1)) for t, at in load.slowest[op]],
            }
            for op in ("send", "keyed_send", "claim", "outcome")
        },
        "errors": sum(load.errors.values()),
        "deadlocks": load.deadlocks,
        "error_kinds": dict(load.errors),
        "maintenance_runs": len(runs),
        "runs": runs,
        "steps": {f"{name} {state}": n for (name, state), n in sorted(steps.items())},
    }
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
