"""``GET /api/schedules``: the schedules the workers registered, read-only."""

from __future__ import annotations

import datetime as dt

import dramatiq

from dramatiq_pg_broker import PostgresBroker, periodic


def test_schedules_are_listed_read_only(env, pg_url, schema):
    broker = PostgresBroker(url=pg_url, schema=schema, retention=False)

    @periodic(every=60, missed="skip")
    @dramatiq.actor(broker=broker, queue_name="cron", actor_name="minutely")
    def minutely():
        pass

    scheduler = broker.periodic.new_scheduler()
    now = dt.datetime.now(dt.timezone.utc)
    scheduler.register(broker.schedules[0], now)
    scheduler.enqueue_tick(broker.schedules[0], now.replace(second=0, microsecond=0))
    broker.close()

    result = env.get("/api/schedules", "viewer")
    assert result.status_code == 200
    (row,) = [s for s in result.json["schedules"] if s["name"] == "minutely"]
    assert row["trigger"] == "every 1m" and row["missed"] == "skip"
    assert row["queue_name"] == "cron" and row["last_job_status"] == "queued"
    assert dt.datetime.fromisoformat(row["next_run"]) > now

    assert env.get("/api/schedules", None).status_code == 401
    assert env.get("/api/schedules", "member").status_code == 403
    assert env.post("/api/schedules", "admin").status_code == 405
    assert env.get("/api/schedules?limit=5", "viewer").status_code == 400
