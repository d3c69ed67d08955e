"""``/metrics`` scraped over HTTP from the admin API under gunicorn while real workers
drain a backlog: every scrape parses, and once the work is done the gauges and counters
are exactly what the tables say."""

from __future__ import annotations

import dramatiq
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.control.queues import declare as declare_queues
from tests.integration.admin_support import AdminEnv

from .browser import Stack

pytestmark = pytest.mark.slow

QUEUE = "dash"


def parse(text: str) -> dict[str, dict[tuple, float]]:
    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def table(pg_url: str, schema: str) -> tuple[dict[str, int], dict[str, int]]:
    """The queue's jobs by state and every event by type, from the tables."""
    name = sql.Identifier(schema)
    with psycopg.connect(pg_url) as conn:
        states = dict(
            conn.execute(
                sql.SQL(
                    "SELECT CASE WHEN status = 'queued' AND available_at > now() THEN 'delayed'"
                    " ELSE status END, count(*) FROM {}.all_jobs WHERE queue_name = %s GROUP BY 1"
                ).format(name),
                (QUEUE,),
            ).fetchall()
        )
        events = dict(
            conn.execute(
                sql.SQL("SELECT type, count(*) FROM {}.job_events GROUP BY type").format(name)
            ).fetchall()
        )
    return states, events


def test_metrics_under_load_match_the_tables(pg_url, schema, tmp_path):
    accounts = AdminEnv(pg_url, schema)
    token = accounts.tokens["viewer"]
    stack = Stack(pg_url, schema, tmp_path)
    broker = PostgresBroker(url=pg_url, schema=schema)
    add = dramatiq.actor(lambda a, b: a + b, broker=broker, actor_name="dash.add", queue_name=QUEUE)
    flaky = dramatiq.actor(lambda p: p, broker=broker, actor_name="dash.flaky", queue_name=QUEUE)
    try:
        stack.start_api()

        def scrape() -> dict[str, dict[tuple, float]]:
            status, body = stack.get("/metrics", token)
            assert status == 200, body
            return parse(body.decode())

        # The queue is one a worker declared (its gauges are labelled with its name): as a
        # previous deployment's workers would have left it.
        with broker.pool.connection() as conn:
            declare_queues(conn, schema, [QUEUE])
        first = scrape()  # the counters start here: nothing has been sent yet
        assert first["dramatiq_pg_claims_total"][()] == 0
        for i in range(300):
            add.send(i, 1)
        for _ in range(30):
            flaky.send("/nonexistent/flag")  # fails: max_retries=0 in the worker's actor
        for i in range(10):
            add.send_with_options(args=(i, 2), delay=3_600_000)
        stack.start_worker()
        stack.start_worker()

        busy = []

        def drained():
            metrics = scrape()
            queued = metrics["dramatiq_pg_jobs_queued"].get((("queue", QUEUE),), 0)
            running = metrics["dramatiq_pg_jobs_running"].get((("queue", QUEUE),), 0)
            assert 0 <= queued + running <= 330
            assert metrics["dramatiq_pg_metrics_query_seconds"][()] < 5
            if queued or running:
                busy.append((queued, running))
            return not queued and not running

        stack.wait_for("the workers draining the queue, seen through /metrics", drained, 120)
        assert busy, "no scrape saw the work in progress"

        states, events = table(pg_url, schema)
        assert states == {"succeeded": 300, "failed": 30, "delayed": 10}, states

        def settled():
            metrics = scrape()
            finished = metrics["dramatiq_pg_jobs_finished_total"]
            return (
                metrics
                if (
                    finished[(("outcome", "succeeded"),)] == events["succeeded"]
                    and finished[(("outcome", "failed"),)] == events["failed"]
                    and metrics["dramatiq_pg_claims_total"][()] == events["claimed"]
                )
                else None
            )

        metrics = stack.wait_for("the counters catching up with the events table", settled, 60)
        assert metrics["dramatiq_pg_jobs_finished_total"][(("outcome", "succeeded"),)] == 300
        assert metrics["dramatiq_pg_jobs_finished_total"][(("outcome", "failed"),)] == 30
        assert metrics["dramatiq_pg_claims_total"][()] == 330
        assert metrics["dramatiq_pg_jobs_delayed"][(("queue", QUEUE),)] == 10
        assert metrics["dramatiq_pg_jobs_failed"][(("queue", QUEUE),)] == 30
        assert metrics["dramatiq_pg_jobs_queued"][(("queue", QUEUE),)] == 0
        assert metrics["dramatiq_pg_oldest_waiting_seconds"][(("queue", QUEUE),)] == 0
        assert metrics["dramatiq_pg_retries_total"][()] == events.get("retry_scheduled", 0) == 0
    finally:
        stack.stop()
        broker.close()
        accounts.close()
