"""How long a ``/metrics`` scrape takes on a big table.

    python -m benchmarks.metrics_scrape [--finished 1000000] [--scrapes 60]

Loads a schema with ``--finished`` succeeded jobs (each with its created, claimed and
succeeded events, as the broker writes them), a backlog spread over several queues
(runnable, delayed, running and failed jobs), and then scrapes the metrics repeatedly,
writing ``--events-between`` new events between two scrapes (the traffic of a busy scrape
interval). It prints the scrape time (the two statements and the text exposition) and the
database round trip the scrape reports about itself, and the plans of both statements.

The target: 50 ms or less per scrape at 1,000,000 finished jobs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psycopg
from psycopg import sql

from admin_api.app import create_engine
from admin_api.metrics import Metrics
from admin_api.monitoring import Monitor
from dramatiq_pg_broker.config import Settings

from . import pgdata

SCHEMA = "bench_metrics"
QUEUES = ("default", "emails", "reports", "billing", "media")


def _q(text: str) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(SCHEMA))


def build(url: str, finished: int, backlog: int) -> None:
    pgdata.reset_schema(url, SCHEMA)
    started = time.perf_counter()
    pgdata.load(url, SCHEMA, finished, status="succeeded", queue="default")
    for queue in QUEUES:
        pgdata.load(url, SCHEMA, backlog // len(QUEUES), queue=queue)
        pgdata.load(url, SCHEMA, backlog // 10 // len(QUEUES), queue=queue, delay_s=3600)
    with psycopg.connect(url, autocommit=True) as conn:
        # Some of the backlog running and some failed, in every queue (the shapes the
        # table's constraints require).
        conn.execute(
            _q(
                """UPDATE {schema}.jobs SET status = 'running', attempts = 1,
                          locked_by = 'bench:0:0:0', locked_until = now() + interval '1 hour',
                          started_at = now()
                   WHERE id IN (SELECT id FROM {schema}.jobs WHERE status = 'queued'
                                ORDER BY random() LIMIT %(n)s)"""
            ),
            {"n": max(1, backlog // 100)},
        )
        # Failed jobs live in history (migration 0012): moved there as an outcome moves them.
        conn.execute(
            _q(
                """WITH gone AS (
                       DELETE FROM {schema}.jobs
                       WHERE id IN (SELECT id FROM {schema}.jobs WHERE status = 'queued'
                                    AND available_at <= now() ORDER BY random() LIMIT %(n)s)
                       RETURNING *)
                   INSERT INTO {schema}.jobs_history
                   SELECT (jsonb_populate_record(
                       NULL::{schema}.jobs_history,
                       to_jsonb(gone) || jsonb_build_object(
                           'status', 'failed', 'attempts', 1, 'finished_at', now(),
                           'last_error', 'RuntimeError: bench'))).*
                   FROM gone"""
            ),
            {"n": max(1, backlog // 50)},
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


def traffic(conn: psycopg.Connection, n: int) -> None:
    """``n`` new events, settled (older than the scrape's settle time), as a busy interval
    of claims and successes would write them."""
    conn.execute(
        _q(
            """INSERT INTO {schema}.job_events (job_id, type, attempt, actor, created_at)
               SELECT id, CASE WHEN g %% 2 = 0 THEN 'claimed' ELSE 'succeeded' END, 1,
                      'bench:0:0:0', now() - interval '10 seconds'
               FROM (SELECT id FROM {schema}.jobs_history WHERE status = 'succeeded' LIMIT 1)
                    AS one,
                    generate_series(1, %(n)s) AS g"""
        ),
        {"n": n},
    )


def explain(url: str, monitor: Monitor) -> None:
    engine = monitor.engine
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(_q("SELECT max(id) - 5000 FROM {schema}.job_events")).fetchone()[0]
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(SCHEMA)))
        events = monitor.new_events_statement(cursor, 5.0).compile(
            dialect=engine.dialect, compile_kwargs={"literal_binds": True}
        )
        for name, statement, params in (
            ("queues", monitor.queues_statement, {"now": None, "failed": True}),
            ("new events", str(events), None),
        ):
            plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, params).fetchall()
            print(f"\n-- plan of the {name} statement")
            print("\n".join(row[0] for row in plan))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("DRAMATIQ_PG_URL"))
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--backlog", type=int, default=20_000, help="queued jobs, all queues")
    parser.add_argument("--scrapes", type=int, default=60)
    parser.add_argument("--events-between", type=int, default=3_000)
    parser.add_argument("--reuse", action="store_true", help="keep an already loaded schema")
    parser.add_argument("--keep", action="store_true", help="do not drop the schema after")
    args = parser.parse_args()
    url = args.url
    if not url:
        from dramatiq_pg_broker.db.embedded import embedded_url

        url = embedded_url()
    if not args.reuse:
        build(url, args.finished, args.backlog)
    settings = Settings(url=url, schema=SCHEMA)
    engine = create_engine(url, settings)
    monitor = Monitor(engine, SCHEMA)
    metrics = Metrics(monitor)
    metrics.render()  # the first scrape: connections open, the counters' starting point
    scrape_ms, query_ms = [], []
    with psycopg.connect(url, autocommit=True) as conn:
        for _ in range(args.scrapes):
            traffic(conn, args.events_between)
            started = time.perf_counter()
            text = metrics.render().decode()
            scrape_ms.append((time.perf_counter() - started) * 1000)
            line = next(
                x for x in text.splitlines() if x.startswith("dramatiq_pg_metrics_query_seconds ")
            )
            query_ms.append(float(line.split()[1]) * 1000)
    counted = next(
        x for x in text.splitlines() if x.startswith("dramatiq_pg_claims_total ")
    ).split()[1]
    assert float(counted) == args.scrapes * (args.events_between // 2), counted

    def summary(values: list[float]) -> str:
        ordered = sorted(values)
        p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]
        return (
            f"median {statistics.median(values):.1f} ms, p95 {p95:.1f} ms, max {ordered[-1]:.1f} ms"
        )

    print(f"{args.scrapes} scrapes, {args.events_between:,} new events before each")
    print(f"  whole scrape (queries + exposition): {summary(scrape_ms)}")
    print(f"  database round trip (dramatiq_pg_metrics_query_seconds): {summary(query_ms)}")
    # The dashboard's chart: the last hour's events, per minute (every 15 s per open page).
    chart_ms = []
    for _ in range(20):
        started = time.perf_counter()
        monitor.throughput(minutes=60)
        chart_ms.append((time.perf_counter() - started) * 1000)
    print(f"  the dashboard's throughput chart (/api/throughput, 60 minutes): {summary(chart_ms)}")
    explain(url, monitor)
    engine.dispose()
    if not args.keep:
        pgdata.drop_schema(url, SCHEMA)


if __name__ == "__main__":
    main()
