"""The admin API as an operator uses it: one queue's page (GET /api/queues/{name}), jobs
whose worker died put back in their queue (one job, or every such job of a queue) through
the reaper's own transition, and the states in the job list's filter, the old `queued`
included."""

from __future__ import annotations

import datetime as dt

import pytest

from dramatiq_pg_broker.control import limits, queues

from .admin_support import CSRF


def test_a_queue_page_says_who_limited_and_paused_it_and_why_its_jobs_wait(env):
    queue = "ops_page"
    failed = env.failed(queue=queue)
    for _ in range(2):
        env.enqueue(queue=queue)
    env.enqueue(queue=queue, delay_ms=3_600_000)
    with env.store.pool.connection() as conn:
        limits.set_limit(conn, env.settings.schema, queue, 2, by="ops@example.com")
        queues.pause(conn, env.settings.schema, queue, by="ops@example.com")
    result = env.get(f"/api/queues/{queue}", "viewer")
    assert result.status_code == 200, result.text
    page = result.json
    assert page["state"] == "paused" and page["paused_by"] == "ops@example.com"
    dt.datetime.fromisoformat(page["paused_at"])
    assert (page["limit"], page["limit_source"], page["limit_set_by"]) == (
        2,
        "operator",
        "ops@example.com",
    )
    assert page["jobs"] == {
        "ready": 0, "delayed": 1, "paused": 2, "running": 0, "lease_expired": 0, "failed": 1,
    }  # fmt: skip
    assert [r["reason"] for r in page["waiting_because"]] == ["paused", "no_worker", "delayed"]
    assert page["waiting_because"][0]["text"].startswith("paused by ops@example.com since ")
    flow = page["throughput"]
    assert (flow["failed"], flow["succeeded"], len(flow["buckets"])) == (1, 0, 60)
    assert failed


def test_a_queue_page_is_for_observers_and_an_unknown_queue_is_a_404(env):
    queue = "ops_roles"
    env.enqueue(queue=queue)
    assert env.get(f"/api/queues/{queue}", "member").status_code == 403
    assert env.get(f"/api/queues/{queue}", None).status_code == 401
    result = env.get("/api/queues/nosuch_queue", "viewer")
    assert result.status_code == 404
    assert "no worker has declared queue 'nosuch_queue'" in result.json["message"]
    assert env.get("/api/queues/bad%20name", "viewer").status_code == 400


def test_the_limit_says_when_it_holds_jobs_back(env):
    queue = "ops_at_limit"
    env.declare(queues=[queue])
    running = env.running(queue=queue)
    env.enqueue(queue=queue)
    with env.store.pool.connection() as conn:
        limits.set_limit(conn, env.settings.schema, queue, 1, by="ops@example.com")
    reasons = env.get(f"/api/queues/{queue}", "viewer").json["waiting_because"]
    assert {"reason": "limit", "text": "at its limit: 1 of 1 running"} in reasons
    assert running


def test_an_operator_requeues_a_job_whose_worker_died(env):
    job_id = env.lease_expired(queue="ops_requeue_one")
    job = env.get(f"/api/jobs/{job_id}", "viewer").json
    assert job["status"] == "running" and job["state"] == "lease_expired"
    assert env.post(f"/api/jobs/{job_id}/requeue", "viewer", headers=CSRF).status_code == 403
    result = env.post(f"/api/jobs/{job_id}/requeue", "operator", headers=CSRF)
    assert result.status_code == 200, result.text
    assert result.json["status"] == "queued" and result.json["state"] == "ready"
    assert result.json["locked_by"] is None
    event = env.store.events_of(job_id)[-1]
    assert (event["type"], event["actor"]) == ("released", "operator@example.com")
    assert event["data"] == {"worker": "tests-worker", "requeued_by": "operator@example.com"}
    # Now it waits: a second requeue is refused, saying why.
    again = env.post(f"/api/jobs/{job_id}/requeue", "operator", headers=CSRF)
    assert again.status_code == 409 and "only lease-expired jobs" in again.json["message"]


def test_a_job_whose_worker_holds_its_lease_is_never_requeued(env):
    job_id = env.running(queue="ops_requeue_live")
    result = env.post(f"/api/jobs/{job_id}/requeue", "operator", headers=CSRF)
    assert result.status_code == 409
    assert "its worker holds its lease" in result.json["message"]
    row = env.store.get(job_id)
    assert row["status"] == "running" and row["locked_by"] == "tests-worker"
    everything = env.post("/api/queues/ops_requeue_live/requeue-expired", "operator", headers=CSRF)
    assert everything.json["requeued"] == []
    assert env.store.get(job_id)["locked_by"] == "tests-worker"


def test_an_operator_requeues_every_expired_job_of_a_queue(env):
    queue = "ops_requeue_all"
    first = env.lease_expired(queue=queue)
    elsewhere = env.lease_expired(queue="ops_requeue_elsewhere")
    result = env.post(f"/api/queues/{queue}/requeue-expired", "operator", headers=CSRF)
    assert result.status_code == 200, result.text
    assert result.json == {"queue_name": queue, "requeued": [first], "failed": [], "cancelled": []}
    assert env.store.get(first)["status"] == "queued"
    assert env.store.get(elsewhere)["status"] == "running"
    missing = env.post("/api/queues/nosuch_queue/requeue-expired", "operator", headers=CSRF)
    assert missing.status_code == 404


@pytest.mark.parametrize(
    "status, expected",
    [
        ("queued", {"ready", "delayed", "paused"}),
        ("ready", {"ready"}),
        ("delayed", {"delayed"}),
        ("paused", {"paused"}),
        ("running", {"running"}),
        ("lease_expired", {"lease_expired"}),
    ],
)
def test_the_list_filters_by_state_and_keeps_the_old_queued(env, status, expected):
    suffix = status
    made = {
        "ready": env.enqueue(queue=f"ops_f_{suffix}"),
        "delayed": env.enqueue(queue=f"ops_f_{suffix}", delay_ms=3_600_000),
        "running": env.running(queue=f"ops_f_{suffix}_r"),
        "lease_expired": env.lease_expired(queue=f"ops_f_{suffix}_e"),
        "paused": env.enqueue(queue=f"ops_f_{suffix}_p"),
    }
    with env.store.pool.connection() as conn:
        queues.pause(conn, env.settings.schema, f"ops_f_{suffix}_p", by="tests")
    mine = {job_id: state for state, job_id in made.items()}
    found = env.get("/api/jobs", "viewer", params={"status": status, "limit": 100}).json
    listed = {job["id"]: job["state"] for job in found["results"] if job["id"] in mine}
    assert set(listed.values()) == expected
    assert all(mine[job_id] == state for job_id, state in listed.items())
