"""How fast the admin API's reads answer on a big table.

    python -m benchmarks.admin_reads [--jobs 1000000] [--runs 15] [--reuse] [--keep]

Loads a schema with ``--jobs`` finished jobs (97 % succeeded, 2 % failed, 1 % cancelled,
spread over 30 days, 5 queues and 20 actors) and their events (created, claimed and the
outcome: about three per job), a small backlog (queued and running jobs), and jobs owned
by a member; then calls every documented read of the API (each list, filter, detail,
timeline, event feed and stats request) ``--runs`` times through the WSGI app in this
process, after one warm-up call, and prints each one's median and worst time. Results go
to ``benchmarks/results/admin_reads.json``.

The target: every request answers in 100 ms or less (median) at 1,000,000 jobs and
3,000,000 events, and none runs past the statement timeout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path
from urllib.parse import quote

import psycopg
from falcon import testing
from psycopg import sql

from admin_api.accounts import AccountStore
from admin_api.app import create_app
from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool, resolve_url

from . import pgdata

SCHEMA = "bench_admin_reads"
RESULTS = Path(__file__).with_name("results") / "admin_reads.json"
TARGET_MS = 100.0

# Finished jobs, straight into history (migration 0012).
_JOBS = """
INSERT INTO {schema}.jobs_history AS j (
    id, queue_name, actor_name, message, status, priority, available_at, attempts,
    max_attempts, last_error, created_at, updated_at, started_at, finished_at)
SELECT n.id, n.queue, n.actor,
       jsonb_build_object(
           'queue_name', n.queue, 'actor_name', n.actor,
           'args', jsonb_build_array(n.g), 'kwargs', '{{}}'::jsonb, 'options', '{{}}'::jsonb,
           'message_id', n.id::text, 'message_timestamp', 0),
       n.status, 0, n.created_at, 1, 1,
       CASE WHEN n.status = 'failed' THEN 'RuntimeError: boom' END,
       n.created_at, n.created_at, n.created_at, n.created_at + interval '1 second'
FROM (
    SELECT gen_random_uuid() AS id, g, 'q' || (g %% 5) AS queue,
           'app.task_' || lpad((g %% 20)::text, 2, '0') AS actor,
           CASE WHEN g %% 100 < 2 THEN 'failed' WHEN g %% 100 = 2 THEN 'cancelled'
                ELSE 'succeeded' END AS status,
           now() - interval '30 days' + g * (interval '30 days' / %(count)s) AS created_at
    FROM generate_series(%(first)s::int, %(last)s::int) AS g
) AS n
RETURNING j.id, j.status, j.created_at
"""

_EVENTS = """
INSERT INTO {schema}.job_events (job_id, type, attempt, actor, created_at)
SELECT new.id, t.type, t.attempt, t.actor, new.created_at
FROM new
CROSS JOIN LATERAL (VALUES ('created', 0, NULL), ('claimed', 1, 'bench:0:0:0'),
                           (new.status, 1, 'bench:0:0:0')) AS t (type, attempt, actor)
WHERE NOT (new.status = 'cancelled' AND t.type = 'claimed')
"""


def _q(text: str) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(SCHEMA))


def build(url: str, count: int) -> None:
    """A fresh schema with ``count`` finished jobs and their events, in batches."""
    pgdata.reset_schema(url, SCHEMA)
    started = time.perf_counter()
    batch = 250_000
    with psycopg.connect(url, autocommit=True) as conn:
        # The daily partitions of the 30 days the history spans, as the workers' retention
        # runs would have created them (migration 0012): no row lands in a DEFAULT one.
        pgdata.history_partitions(conn, SCHEMA, days_back=31)
        for first in range(1, count + 1, batch):
            last = min(count, first + batch - 1)
            conn.execute(
                _q("WITH new AS (" + _JOBS + ")" + _EVENTS),
                {"first": first, "last": last, "count": count},
            )
            print(f"  {last:,} jobs loaded ({time.perf_counter() - started:.0f} s)", flush=True)
    # The live part: a backlog in every queue, some of it running.
    for n in range(5):
        pgdata.load(url, SCHEMA, 200, queue=f"q{n}", vacuum=False)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            _q(
                """UPDATE {schema}.jobs SET status = 'running', attempts = 1,
                          locked_by = 'bench:0:0:0', locked_until = now() + interval '1 hour',
                          started_at = now()
                   WHERE id IN (SELECT id FROM {schema}.jobs WHERE status = 'queued' LIMIT 100)"""
            )
        )
        conn.execute(_q("VACUUM ANALYZE {schema}.jobs"))
        conn.execute(_q("VACUUM ANALYZE {schema}.jobs_history"))
        conn.execute(_q("VACUUM ANALYZE {schema}.job_events"))
        jobs, events = conn.execute(
            _q(
                "SELECT (SELECT count(*) FROM {schema}.all_jobs), "
                "(SELECT count(*) FROM {schema}.job_events)"
            )
        ).fetchone()
    print(f"loaded {jobs:,} jobs and {events:,} events in {time.perf_counter() - started:.0f} s")


def accounts(url: str) -> tuple[str, str, str]:
    """A viewer's token, a member's token, and one job the member owns (1,000 in all)."""
    settings = Settings(url=url, schema=SCHEMA)
    pool = ProcessPool(settings)
    try:
        store = AccountStore(pool, SCHEMA, bcrypt_rounds=4)
        viewer = store.find_user("viewer@bench.example") or store.create_user(
            "viewer@bench.example", "bench password", "viewer"
        )
        member = store.find_user("member@bench.example") or store.create_user(
            "member@bench.example", "bench password", "member"
        )
        viewer_token = store.create_token(viewer.id, "bench").secret
        member_token = store.create_token(member.id, "bench").secret
    finally:
        pool.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            _q(
                """INSERT INTO {schema}.job_owners (job_id, user_id, created_at)
                   SELECT id, %(user)s, created_at FROM {schema}.jobs_history
                   WHERE random() < 0.01
                   LIMIT 1000
                   ON CONFLICT DO NOTHING"""
            ),
            {"user": member.id},
        )
        # What autovacuum does soon after such an insert (more than a tenth of the table):
        # without it the planner believes the member owns a handful of jobs.
        conn.execute(_q("ANALYZE {schema}.job_owners"))
        owned = conn.execute(
            _q("SELECT job_id FROM {schema}.job_owners WHERE user_id = %(user)s LIMIT 1"),
            {"user": member.id},
        ).fetchone()[0]
    return viewer_token, member_token, str(owned)


def requests(url: str, owned_job: str) -> list[tuple[str, str]]:
    """Every documented read, as (label, path): each filter alone and some together."""
    with psycopg.connect(url, autocommit=True) as conn:
        failed_job, some_event = conn.execute(
            _q(
                "SELECT (SELECT id FROM {schema}.jobs_history WHERE status = 'failed' LIMIT 1), "
                "(SELECT max(id) FROM {schema}.job_events)"
            )
        ).fetchone()
    now = dt.datetime.now(dt.timezone.utc)
    day_ago = quote((now - dt.timedelta(days=1)).isoformat())
    month_ago = quote((now - dt.timedelta(days=29)).isoformat())
    long_actor = "x" * 255
    return [
        ("jobs: first page", "/api/jobs"),
        ("jobs: limit=100", "/api/jobs?limit=100"),
        ("jobs: offset=10000", "/api/jobs?offset=10000"),
        ("jobs: status=succeeded", "/api/jobs?status=succeeded"),
        ("jobs: status=failed", "/api/jobs?status=failed"),
        ("jobs: status=cancelled", "/api/jobs?status=cancelled"),
        ("jobs: status=queued", "/api/jobs?status=queued"),
        ("jobs: status=running", "/api/jobs?status=running"),
        ("jobs: queue=q3", "/api/jobs?queue=q3"),
        ("jobs: queue=nowhere", "/api/jobs?queue=nowhere"),
        ("jobs: actor=task_07", "/api/jobs?actor=task_07"),
        ("jobs: actor=TASK (20 actors)", "/api/jobs?actor=TASK"),
        ("jobs: actor=255 characters", f"/api/jobs?actor={long_actor}"),
        ("jobs: created_after=1 day ago", f"/api/jobs?created_after={day_ago}"),
        ("jobs: created_before=29 days ago", f"/api/jobs?created_before={month_ago}"),
        ("jobs: status=failed&queue=q2", "/api/jobs?status=failed&queue=q2"),
        ("jobs: status=failed&actor=task_1", "/api/jobs?status=failed&actor=task_1"),
        ("jobs: queue=q1&created_before=29 days", f"/api/jobs?queue=q1&created_before={month_ago}"),
        ("jobs: as a member", "member:/api/jobs"),
        ("job: detail", f"/api/jobs/{failed_job}"),
        ("job: events", f"/api/jobs/{failed_job}/events"),
        ("job: detail as its member", f"member:/api/jobs/{owned_job}"),
        ("events: first page", "/api/job-events"),
        ("events: type=succeeded", "/api/job-events?type=succeeded"),
        ("events: type=failed", "/api/job-events?type=failed"),
        ("events: type=cancelled", "/api/job-events?type=cancelled"),
        ("events: type=manual_retry (none)", "/api/job-events?type=manual_retry"),
        ("events: job_id=", f"/api/job-events?job_id={failed_job}"),
        ("events: as a member", "member:/api/job-events"),
        ("events: an old cursor", f"/api/job-events?cursor=CURSOR:{some_event // 2}"),
        ("stats", "/api/jobs/stats"),
        ("queues", "/api/queues"),
        ("throughput", "/api/throughput"),
        ("config", "/api/config"),
        ("health", "/api/health"),
    ]


def measure(url: str, runs: int) -> list[dict]:
    viewer_token, member_token, owned_job = accounts(url)
    app = create_app(Settings(url=url, schema=SCHEMA))
    client = testing.TestClient(app)
    from admin_api.pagination import encode_cursor
    from admin_api.queries import Cursor

    results = []
    for label, path in requests(url, owned_job):
        token = viewer_token
        if path.startswith("member:"):
            token, path = member_token, path.removeprefix("member:")
        if "CURSOR:" in path:
            event_id = int(path.rsplit("CURSOR:", 1)[1])
            path = path.split("CURSOR:")[0] + encode_cursor(Cursor(True, event_id))
        headers = {"Authorization": f"Bearer {token}"}
        client.simulate_get(path, headers=headers)  # warm-up
        timings = []
        for _ in range(runs):
            started = time.perf_counter()
            result = client.simulate_get(path, headers=headers)
            timings.append((time.perf_counter() - started) * 1000)
        if result.status_code != 200:
            print(f"!! {label}: {result.status_code} {result.text[:200]}")
        median = statistics.median(timings)
        row = {
            "request": label,
            "path": path if len(path) < 120 else path[:117] + "...",
            "status": result.status_code,
            "median_ms": round(median, 1),
            "max_ms": round(max(timings), 1),
            "met": median <= TARGET_MS and result.status_code == 200,
        }
        results.append(row)
        mark = "" if row["met"] else "   <-- over target"
        print(f"{label:<40} {row['status']} {median:8.1f} ms  (max {max(timings):7.1f}){mark}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("DRAMATIQ_PG_URL"))
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--reuse", action="store_true", help="keep an already loaded schema")
    parser.add_argument("--keep", action="store_true", help="do not drop the schema after")
    args = parser.parse_args()
    url = args.url or resolve_url(Settings())
    if not args.reuse:
        build(url, args.jobs)
    try:
        results = measure(url, args.runs)
    finally:
        if not args.keep:
            pgdata.drop_schema(url, SCHEMA)
    met = sum(r["met"] for r in results)
    print(f"\n{met} of {len(results)} requests at or under {TARGET_MS:.0f} ms (median)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "jobs": args.jobs,
                "runs": args.runs,
                "target_ms": TARGET_MS,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
