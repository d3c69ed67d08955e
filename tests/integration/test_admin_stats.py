"""Stats, settings and health."""

from __future__ import annotations

import datetime as dt

import psycopg
import pytest
from psycopg import sql

from admin_api import create_app
from admin_api.app import ApiPool
from admin_api.queries import EXACT_STATS_MAX_BYTES
from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.jobs import JobStore

from .admin_support import AdminEnv


def test_stats_count_every_state(env, pg_url, schema):
    empty = env.get("/api/jobs/stats").json
    assert empty == {
        "total": 0,
        "estimated": False,
        "by_status": {"queued": 0, "running": 0, "succeeded": 0, "failed": 0, "cancelled": 0},
        "by_state": {
            "ready": 0,
            "delayed": 0,
            "paused": 0,
            "running": 0,
            "lease_expired": 0,
            "succeeded": 0,
            "failed": 0,
            "cancelled": 0,
        },
        "by_queue": {},
        "expired_leases": 0,
        "retries_pending": 0,
        "oldest_queued": None,
    }
    first = env.enqueue(actor="tests.first", queue="alpha")
    env.enqueue(queue="alpha")
    env.running(queue="beta")
    expired = env.enqueue(queue="gamma")
    env.claim(expired, lease_seconds=0.001)
    env.failed()
    env.failed()
    env.succeeded()
    cancelled = env.enqueue()
    env.store.cancel(cancelled)
    retried = env.enqueue(queue="delta")
    attempt = env.claim(retried)
    env.store.reschedule(attempt, "delta", 60_000, "try again")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "UPDATE {}.jobs SET created_at = now() - interval '1 hour' WHERE id = %s"
            ).format(sql.Identifier(schema)),
            (first,),
        )
    stats = env.get("/api/jobs/stats", "viewer").json
    assert stats["by_status"] == {
        "queued": 3,
        "running": 2,
        "succeeded": 1,
        "failed": 2,
        "cancelled": 1,
    }
    assert stats["by_state"] == {
        "ready": 2, "delayed": 1, "paused": 0, "running": 1, "lease_expired": 1,
        "succeeded": 1, "failed": 2, "cancelled": 1,
    }  # fmt: skip
    assert stats["total"] == 9 and stats["estimated"] is False
    assert stats["by_queue"] == {
        "alpha": {"queued": 2, "running": 0},
        "beta": {"queued": 0, "running": 1},
        "delta": {"queued": 1, "running": 0},
        "gamma": {"queued": 0, "running": 1},
    }
    assert stats["expired_leases"] == 1
    assert stats["retries_pending"] == 1
    oldest = stats["oldest_queued"]
    assert oldest["id"] == first and oldest["actor_name"] == "tests.first"
    assert 3590 < oldest["age_seconds"] < 3700
    dt.datetime.fromisoformat(oldest["created_at"])


def test_stats_estimate_a_big_table(env, monkeypatch, pg_url, schema):
    """Above the size limit, succeeded comes from the planner's row estimate and the exact
    unfinished and dead-letter counts."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("ANALYZE {}.jobs_history").format(sql.Identifier(schema)))
    monkeypatch.setattr("admin_api.queries.EXACT_STATS_MAX_BYTES", 0)
    stats = env.get("/api/jobs/stats").json
    assert stats["estimated"] is True
    assert stats["by_status"]["failed"] == 2  # still exact
    assert stats["total"] == sum(stats["by_status"].values())
    assert stats["total"] >= 8
    assert EXACT_STATS_MAX_BYTES > 0


def test_config_shows_settings_without_secrets(pg_url, schema):
    url = "postgresql://app:hunter2@db.example:5432/app?password=hunter2"
    settings = Settings(url=url, schema=schema, lease_seconds=45, cors_origins=("https://a",))
    env = AdminEnv(pg_url, schema)
    try:
        app = create_app(settings, store=env.store, accounts=env.accounts, engine=env.engine)
        from falcon import testing

        result = testing.TestClient(app).simulate_get("/api/config", headers=env.auth("viewer"))
    finally:
        env.close()
    assert result.status_code == 200
    config = result.json
    assert "hunter2" not in result.text
    assert config["url"] == "user=app password=*** dbname=app host=db.example port=5432"
    assert config["lease_seconds"] == 45
    assert config["heartbeat_seconds"] == 15
    assert config["cors_origins"] == ["https://a"]
    for key in ("poll_interval", "backoff_base_ms", "backoff_max_ms", "max_attempts", "schema"):
        assert key in config


@pytest.mark.parametrize(
    "url",
    [
        "host=db.example user=app password=hunter2 dbname=app",
        "postgresql://:hunter2@db.example/app",
        "postgresql://app:hun%40ter2@db.example/app",
        "host=db.example password='hunter2 x' sslpassword=hunter2",
    ],
)
def test_config_masks_every_connection_string_form_for_every_role(pg_url, schema, url):
    from falcon import testing

    env = AdminEnv(pg_url, schema)
    try:
        app = create_app(
            Settings(url=url, schema=schema),
            store=env.store,
            accounts=env.accounts,
            engine=env.engine,
        )
        client = testing.TestClient(app)
        for role in ("viewer", "operator", "admin"):
            result = client.simulate_get("/api/config", headers=env.auth(role))
            assert result.status_code == 200
            assert "hunter" not in result.text and "ter2" not in result.text, result.text
            assert "password=***" in result.json["url"]
    finally:
        env.close()


def test_health_ok(env):
    result = env.get("/api/health", None)
    assert result.status_code == 200
    assert result.json == {"status": "ok", "database": "ok", "schema": "ok"}


def test_health_reports_an_unreachable_database(pg_url, schema):
    settings = Settings(url="postgresql://nobody@127.0.0.1:1/none", schema=schema)
    from falcon import testing

    # The app's pool is closed at the end: left open, it would go on retrying the
    # unreachable server in the background and tell later tests' logs of an outage.
    store = JobStore(ApiPool(settings), schema)
    try:
        client = testing.TestClient(create_app(settings, store=store))
        result = client.simulate_get("/api/health")
        assert result.status_code == 503
        assert result.json["status"] == "unavailable"
        assert result.json["database"] == "unreachable"
        assert result.json["detail"]
        # Other endpoints say the same, as an error, not a 500.
        jobs = client.simulate_get("/api/jobs", headers={"Authorization": "Bearer x"})
        assert jobs.status_code == 503
        assert jobs.json["error"] == "unavailable"
    finally:
        store.pool.close()


def test_health_reports_a_schema_that_is_not_migrated(pg_url):
    from falcon import testing

    client = testing.TestClient(create_app(Settings(url=pg_url, schema="never_migrated")))
    result = client.simulate_get("/api/health")
    assert result.status_code == 503
    assert result.json["schema"] == "missing"
    assert "migrate" in result.json["detail"]
    jobs = client.simulate_get("/api/jobs", headers={"Authorization": "Bearer x"})
    assert jobs.status_code == 503
    assert "migrate" in jobs.json["message"]
