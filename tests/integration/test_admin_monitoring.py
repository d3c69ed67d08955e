"""The dashboard's overview endpoints and /metrics, against a real schema: every number is
checked against the table, and the sample alert rules against a real scrape."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import psycopg
import yaml
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from admin_api.metrics import Metrics
from admin_api.monitoring import Monitor
from admin_api.resources import dashboard as dashboard_resource
from dramatiq_pg_broker import Attempt
from dramatiq_pg_broker.control import queues

from .admin_support import CSRF

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "docs" / "guides" / "prometheus-alerts.yml"


#: A queue's counts, in the vocabulary of the CLI, the API, the dashboard and the metrics.
FIELDS = ("ready", "delayed", "paused", "running", "lease_expired", "failed")


def table_counts(pg_url: str, schema: str) -> dict[str, dict[str, int]]:
    """Per queue, straight from the tables (every declared queue, with zeros when it has no
    unfinished or failed job): what the gauges must say. Written here on its own, from the
    definitions of the states, as a second opinion on the code's."""
    query = sql.SQL(
        """SELECT j.queue_name,
                  count(*) FILTER (WHERE status = 'queued' AND available_at <= now()
                                   AND NOT coalesce(q.paused, false)),
                  count(*) FILTER (WHERE status = 'queued' AND available_at > now()),
                  count(*) FILTER (WHERE status = 'queued' AND available_at <= now()
                                   AND coalesce(q.paused, false)),
                  count(*) FILTER (WHERE status = 'running' AND locked_until >= now()),
                  count(*) FILTER (WHERE status = 'running' AND locked_until < now()),
                  count(*) FILTER (WHERE status = 'failed')
           FROM {schema}.all_jobs AS j LEFT JOIN {schema}.queues AS q USING (queue_name)
           WHERE status IN ('queued', 'running', 'failed') GROUP BY j.queue_name"""
    ).format(schema=sql.Identifier(schema))
    declared = sql.SQL("SELECT queue_name FROM {}.queues").format(sql.Identifier(schema))
    with psycopg.connect(pg_url) as conn:
        counts = {name: dict.fromkeys(FIELDS, 0) for (name,) in conn.execute(declared)}
        counts.update((row[0], dict(zip(FIELDS, row[1:]))) for row in conn.execute(query))
        return counts


def scrape(metrics: Metrics) -> dict[str, dict[tuple, float]]:
    """name -> {labels: value} of one scrape (counters under their ``_total`` sample)."""
    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def test_queues_count_each_state_of_a_queue(env, pg_url, schema):
    queue = "mon_states"
    for _ in range(2):
        env.enqueue(queue=queue)
    env.enqueue(queue=queue, delay_ms=3_600_000)
    # A queue's claim takes its first runnable job: claim before adding the others.
    running = env.enqueue(queue=queue + "_r")
    env.claim(running)
    for _ in range(2):
        env.failed(queue=queue + "_f")
    env.succeeded(queue=queue + "_s")

    result = env.get("/api/queues", "viewer")
    assert result.status_code == 200, result.text
    by_name = {row["queue_name"]: row for row in result.json["results"]}
    assert by_name[queue]["jobs"] == {
        "ready": 2, "delayed": 1, "paused": 0, "running": 0, "lease_expired": 0, "failed": 0,
    }  # fmt: skip
    # The counts of earlier releases stay, with their meaning.
    assert {k: by_name[queue][k] for k in ("queued", "delayed", "running", "failed")} == {
        "queued": 2, "delayed": 1, "running": 0, "failed": 0,
    }  # fmt: skip
    assert 0 <= by_name[queue]["oldest_waiting_seconds"] < 60
    assert by_name[queue + "_r"]["jobs"]["running"] == 1
    assert by_name[queue + "_f"]["jobs"]["failed"] == 2
    # A declared queue with only finished jobs is listed, with nothing waiting.
    assert by_name[queue + "_s"]["jobs"] == dict.fromkeys(FIELDS, 0)
    assert by_name[queue]["declared"] is True and by_name[queue]["paused"] is False
    # Every queue, every field, agrees with the table.
    expected = table_counts(pg_url, schema)
    assert {name: row["jobs"] for name, row in by_name.items()} == expected


def test_the_cli_the_api_and_the_metrics_show_one_count_per_queue(env, pg_url, schema, capsys):
    from dramatiq_pg_broker import cli

    queue = "mon_one_count"
    # A queue's claim takes its first runnable job: claim before adding the others.
    env.failed(queue=queue)
    env.running(queue=queue)
    expired = env.enqueue(queue=queue)
    env.claim(expired, lease_seconds=0.001)
    env.enqueue(queue=queue)
    env.enqueue(queue=queue, delay_ms=3_600_000)
    held = "mon_one_count_paused"
    env.enqueue(queue=held)
    with env.store.pool.connection() as conn:
        queues.pause(conn, schema, held, by="tests", force=True)
    expected = {name: table_counts(pg_url, schema)[name] for name in (queue, held)}
    assert expected == {
        queue: {"ready": 1, "delayed": 1, "paused": 0, "running": 1, "lease_expired": 1,
                "failed": 1},
        held: {"ready": 0, "delayed": 0, "paused": 1, "running": 0, "lease_expired": 0,
               "failed": 0},
    }  # fmt: skip

    counts = env.store.queue_counts()
    assert {name: counts[name].as_dict() for name in expected} == expected, "the job store's"
    monitor = Monitor(env.engine, schema).queues()
    assert {name: monitor[name].jobs.as_dict() for name in expected} == expected, "the API's"
    assert cli.main(["--url", pg_url, "--schema", schema, "stats", "--json"]) == 0
    rows = {row["queue_name"]: row for row in json.loads(capsys.readouterr().out)}
    assert {name: rows[name]["jobs"] for name in expected} == expected, "the CLI's stats"
    metrics = scrape(Metrics(Monitor(env.engine, schema)))
    assert {
        name: {f: metrics[f"dramatiq_pg_jobs_{f}"][(("queue", name),)] for f in FIELDS}
        for name in expected
    } == expected, "the metrics'"
    by_queue = env.get("/api/jobs/stats", "viewer").json["by_queue"][queue]
    assert by_queue == {"queued": 2, "running": 2}, "the stats' per-queue counts"
    # Each state's list holds as many of the queue's jobs as its count says.
    for state in FIELDS:
        page = env.get("/api/jobs", "viewer", params={"status": state, "queue": queue}).json
        assert page["count"] == expected[queue][state], state
        assert {job["state"] for job in page["results"]} <= {state}


def test_oldest_waiting_age_counts_from_when_the_job_became_runnable(env):
    queue = "mon_age"
    env.enqueue(queue=queue)
    monitor = Monitor(env.engine, env.settings.schema)
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=10)
    counts = monitor.queues(now=later)[queue].jobs
    assert 590 < counts.oldest_waiting_seconds < 700
    # A job delayed beyond "now" is not waiting yet.
    env.enqueue(queue="mon_age_delayed", delay_ms=3_600_000)
    delayed = monitor.queues(now=later)["mon_age_delayed"].jobs
    assert (delayed.ready, delayed.delayed, delayed.oldest_waiting_seconds) == (0, 1, None)


def test_only_observers_read_the_overview_endpoints(env):
    for path in ("/api/queues", "/api/throughput", "/metrics"):
        assert env.get(path, "member").status_code == 403, path
        assert env.get(path, None).status_code == 401, path
        for role in ("viewer", "operator", "admin"):
            assert env.get(path, role).status_code == 200, (path, role)


def test_throughput_counts_this_minutes_outcomes(env, monkeypatch):
    monkeypatch.setattr(dashboard_resource, "THROUGHPUT_CACHE_SECONDS", 0.0)
    before = env.get("/api/throughput", "viewer", params={"minutes": 5}).json
    env.succeeded(queue="mon_tp")
    env.succeeded(queue="mon_tp")
    env.failed(queue="mon_tp")
    after = env.get("/api/throughput", "viewer", params={"minutes": 5}).json
    assert len(after["buckets"]) == 5 and after["truncated"] is False
    assert (
        sum(b["succeeded"] for b in after["buckets"])
        - sum(b["succeeded"] for b in before["buckets"])
        == 2
    )
    assert (
        sum(b["failed"] for b in after["buckets"]) - sum(b["failed"] for b in before["buckets"])
        == 1
    )
    assert len(env.get("/api/throughput").json["buckets"]) == 60
    # Within the cache time every dashboard gets the answer already counted.
    monkeypatch.setattr(dashboard_resource, "THROUGHPUT_CACHE_SECONDS", 3600.0)
    cached = env.get("/api/throughput", "viewer", params={"minutes": 5}).json
    env.succeeded(queue="mon_tp")
    assert env.get("/api/throughput", "operator", params={"minutes": 5}).json == cached
    for bad in ("0", "1441", "x"):
        result = env.get("/api/throughput", params={"minutes": bad})
        assert result.status_code == 400 and "minutes" in result.json["message"], bad


def test_metrics_gauges_and_counters_match_the_table(env, pg_url, schema):
    metrics = Metrics(Monitor(env.engine, schema), settle=0)
    first = scrape(metrics)
    assert first["dramatiq_pg_jobs_finished_total"][(("outcome", "succeeded"),)] == 0

    queue = "mon_metrics"
    for _ in range(3):
        env.succeeded(queue=queue)
    env.failed(queue=queue)
    # A retry with backoff, a lease that expires and is requeued, an operator's retry.
    retried = env.enqueue(queue=queue + "_retry")
    assert env.store.reschedule(env.claim(retried), queue + "_retry", 60_000, "flaky")
    expiring = env.enqueue(queue=queue + "_lease")
    attempt = env.claim(expiring, lease_seconds=0.001)
    assert env.store.start([attempt], 0.001) == {expiring}
    future = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=5)
    reap = {"batch": 100, "max_interruptions": 2, "lease_seconds": 0.001, "now": future}
    reaped = env.store.reap(backoff_ms=[60_000], **reap)
    assert expiring in reaped.requeued
    # Its last allowed interruption: the lease expires again and the job fails.
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {}.jobs SET available_at = now() WHERE id = %s").format(
                sql.Identifier(schema)
            ),
            (expiring,),
        )
    claimed = env.store.claim(queue + "_lease", 1, "tests-worker", 0.001)
    assert [c.id for c in claimed] == [expiring]
    again = Attempt(expiring, "tests-worker", claimed[0].attempts)
    assert env.store.start([again], 0.001) == {expiring}
    reaped = env.store.reap(backoff_ms=[1], **reap)
    assert expiring in reaped.failed
    manual = env.failed(queue=queue + "_manual")
    assert env.post(f"/api/jobs/{manual}/retry", "operator", headers=CSRF).status_code == 200

    second = scrape(metrics)
    finished = second["dramatiq_pg_jobs_finished_total"]
    assert finished[(("outcome", "succeeded"),)] == 3
    assert finished[(("outcome", "failed"),)] == 3  # the nack, the lost lease, the manual one
    assert finished[(("outcome", "cancelled"),)] == 0
    assert second["dramatiq_pg_retries_total"][()] == 1
    assert second["dramatiq_pg_lease_expiries_total"][()] == 2
    assert second["dramatiq_pg_manual_retries_total"][()] == 1
    assert second["dramatiq_pg_claims_total"][()] == 3 + 1 + 1 + 2 + 1
    assert 0 < second["dramatiq_pg_metrics_query_seconds"][()] < 5

    expected = table_counts(pg_url, schema)
    for field in FIELDS:
        gauge = second[f"dramatiq_pg_jobs_{field}"]
        assert {labels[0][1]: value for labels, value in gauge.items()} == {
            name: counts[field] for name, counts in expected.items()
        }, field
    # The gauge of earlier releases: runnable now, ready or paused.
    queued = second["dramatiq_pg_jobs_queued"]
    assert {labels[0][1]: value for labels, value in queued.items()} == {
        name: counts["ready"] + counts["paused"] for name, counts in expected.items()
    }
    assert set(second["dramatiq_pg_oldest_waiting_seconds"]) == {
        (("queue", name),) for name in expected
    }
    # Nothing new: the counters stay where they are.
    assert scrape(metrics)["dramatiq_pg_jobs_finished_total"] == finished


def test_counters_wait_for_events_that_may_still_commit(env, schema):
    monitor = Monitor(env.engine, schema)
    cursor = monitor.last_event_id()
    env.succeeded(queue="mon_settle")
    waiting = monitor.new_events(cursor, settle=3600)
    assert waiting.counts == {} and waiting.cursor == cursor
    counted = monitor.new_events(cursor, settle=0)
    assert counted.counts == {"created": 1, "claimed": 1, "succeeded": 1}
    assert counted.cursor > cursor


def test_metrics_over_http(env):
    result = env.get("/metrics", "viewer")
    assert result.status_code == 200
    assert result.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {family.name for family in text_string_to_metric_families(result.text)}
    assert {"dramatiq_pg_jobs_queued", "dramatiq_pg_jobs_finished"} <= names


def test_the_metrics_only_app_needs_no_credentials(env):
    from falcon import testing

    from admin_api.resources.metrics import create_metrics_app

    client = testing.TestClient(create_metrics_app(env.settings, engine=env.engine))
    result = client.simulate_get("/metrics")
    assert result.status_code == 200 and "dramatiq_pg_jobs_queued" in result.text
    assert client.simulate_get("/api/jobs").status_code == 404


def test_the_sample_alert_rules_parse_and_use_real_metrics(env, schema):
    document = yaml.safe_load(ALERTS.read_text())
    rules = [rule for group in document["groups"] for rule in group["rules"]]
    assert {rule["alert"] for rule in rules} >= {
        "DramatiqPgBacklogOld", "DramatiqPgFailureRate", "DramatiqPgNoWorkerClaiming",
    }  # fmt: skip
    exported = {
        family.name
        for family in text_string_to_metric_families(
            Metrics(Monitor(env.engine, schema)).render().decode()
        )
    }
    exported |= {f"{name}_total" for name in exported}
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]")
        used = set(re.findall(r"\bdramatiq_pg_[a-z_]+", expr))
        assert used and used <= exported, (rule["alert"], used - exported)


def test_throughput_finds_the_window_in_a_long_history(pg_url, empty_schema):
    from admin_api.app import create_engine
    from dramatiq_pg_broker.config import Settings
    from dramatiq_pg_broker.migrate import migrate

    migrate(pg_url, empty_schema)
    engine = create_engine(pg_url, Settings(url=pg_url, schema=empty_schema))
    insert = sql.SQL(
        "INSERT INTO {schema}.job_events (job_id, type, attempt, created_at) "
        "SELECT %(job)s, %(type)s, 1, %(at)s - %(ago)s * interval '1 minute' "
        "FROM generate_series(1, %(n)s)"
    ).format(schema=sql.Identifier(empty_schema))
    with psycopg.connect(pg_url, autocommit=True) as conn:
        job = conn.execute(
            sql.SQL(
                "INSERT INTO {}.jobs (id, queue_name, actor_name, message, status, available_at) "
                "VALUES (gen_random_uuid(), 'q', 'a', '{{}}', 'queued', now()) RETURNING id"
            ).format(sql.Identifier(empty_schema))
        ).fetchone()[0]
        # One clock for the events and the reads, so a minute boundary passing during the
        # test moves no event out of its window.
        at = conn.execute("SELECT now()").fetchone()[0]
        # Oldest first, as events are written: ids grow with time.
        for ago, kind, n in ((150, "succeeded", 300), (90, "failed", 20), (30, "succeeded", 7)):
            conn.execute(insert, {"job": job, "type": kind, "ago": ago, "n": n, "at": at})
        conn.execute(insert, {"job": job, "type": "retry_scheduled", "ago": 0, "n": 2, "at": at})
    monitor = Monitor(engine, empty_schema)
    try:

        def totals(minutes):
            buckets = monitor.throughput(minutes=minutes, now=at)["buckets"]
            return tuple(sum(b[k] for b in buckets) for k in ("succeeded", "failed", "retried"))

        assert totals(60) == (7, 0, 2)
        assert totals(120) == (7, 20, 2)
        assert totals(240) == (307, 20, 2)
        assert totals(1) == (0, 0, 2)
    finally:
        engine.dispose()


def test_the_metrics_and_the_health_findings_show_a_held_snapshot(env, pg_url, schema):
    """The doctor's figures on /metrics, and its findings at /api/health/findings: a
    session holding a snapshot shows in ``dramatiq_pg_snapshot_age_seconds`` and in the
    snapshot finding, with the hot table's and the connections' gauges beside it."""
    import time

    with psycopg.connect(pg_url, autocommit=True, application_name="report") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute(sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(schema)))
        time.sleep(1.1)
        found = scrape(Metrics(Monitor(env.engine, schema)))
        assert found["dramatiq_pg_snapshot_age_seconds"][()] >= 1
        for name in (
            "dramatiq_pg_hot_table_dead_tuples",
            "dramatiq_pg_hot_table_live_tuples",
            "dramatiq_pg_hot_table_bytes",
            "dramatiq_pg_connections_used",
            "dramatiq_pg_connections_available",
            "dramatiq_pg_worker_connection_budget",
            "dramatiq_pg_idle_transaction_seconds",
        ):
            assert name in found, name
        assert found["dramatiq_pg_health_level"][(("check", "snapshot"),)] == 0  # under 60 s
        assert found["dramatiq_pg_health_level"][(("check", "schema"),)] == 0
        report = env.get("/api/health/findings", role="viewer").json
        snapshot = next(f for f in report["findings"] if f["check"] == "snapshot")
        assert f"pid {holder.info.backend_pid} (report," in snapshot["title"]
        assert {f["check"] for f in report["findings"]} >= {"partitions", "unattended_queues"}
        assert env.get("/api/health/findings", role="member").status_code == 403
        holder.execute("ROLLBACK")
    # Released: the gauge falls back (a new scrape; the findings' answer is reused 10 s).
    found = scrape(Metrics(Monitor(env.engine, schema)))
    assert found["dramatiq_pg_snapshot_age_seconds"][()] < 1
