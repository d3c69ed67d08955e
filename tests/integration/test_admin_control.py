"""The admin API's operator control: abort, pause and resume, the worker and actor lists,
jobs only for declared actors on their own queue, metric labels only from declared queues,
and job lists that carry bounded previews instead of whole messages."""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from admin_api.queries import PREVIEW_CHARS

from .admin_support import CSRF, AdminEnv


@pytest.fixture(scope="module")
def env(pg_url, schema):
    """The API as deployed: jobs only for actors a worker declared."""
    env = AdminEnv(pg_url, schema, admin_adhoc_actors=False)
    env.declare({"reports.build": "reports", "mail.send": "mail"})
    yield env
    env.close()


@pytest.fixture(scope="module")
def adhoc(pg_url, schema):
    env = AdminEnv(pg_url, schema, admin_adhoc_actors=True)
    yield env
    env.close()


def post(env: AdminEnv, path: str, role: str = "operator", **kwargs):
    return env.post(path, role, headers=CSRF, **kwargs)


def labels(env: AdminEnv) -> dict[str, set[str]]:
    """The queue label values of every family of /metrics."""
    text = env.get("/metrics", "viewer").text
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "queue" in sample.labels:
                found.setdefault(family.name, set()).add(sample.labels["queue"])
    return found


# -- abort ----------------------------------------------------------------------------------


def test_abort_cancels_a_queued_job_at_once(env):
    job_id = env.enqueue(queue="reports")
    result = post(env, f"/api/jobs/{job_id}/abort")
    assert result.status_code == 200, result.text
    assert result.json["status"] == "cancelled"
    assert result.json["abort_requested_by"] == "operator@example.com"
    events = env.get(f"/api/jobs/{job_id}/events").json["results"]
    assert [(e["type"], e["actor"]) for e in events][-1] == ("aborted", "operator@example.com")


def test_abort_of_a_running_job_is_requested_and_a_finished_one_is_a_409(env):
    job_id = env.running()
    result = post(env, f"/api/jobs/{job_id}/abort", "admin")
    assert result.status_code == 200, result.text
    assert result.json["status"] == "running"
    assert result.json["abort_requested_by"] == "admin@example.com"
    assert result.json["abort_requested_at"] is not None
    failed = env.failed()
    refused = post(env, f"/api/jobs/{failed}/abort")
    assert refused.status_code == 409
    assert "only queued or running jobs can be aborted" in refused.json["message"]
    assert post(env, f"/api/jobs/{uuid.uuid4()}/abort").status_code == 404
    assert post(env, f"/api/jobs/{job_id}/abort", "viewer").status_code == 403


# -- pause and resume -----------------------------------------------------------------------


def test_an_operator_pauses_and_resumes_a_declared_queue(env):
    queue = f"pq_{uuid.uuid4().hex[:6]}"
    env.declare(queues=[queue])
    paused = post(env, f"/api/queues/{queue}/pause")
    assert paused.status_code == 200, paused.text
    assert paused.json["paused"] and paused.json["paused_by"] == "operator@example.com"
    listed = {q["queue_name"]: q for q in env.get("/api/queues", "viewer").json["results"]}
    assert listed[queue]["paused"] and listed[queue]["declared"]
    assert listed[queue]["paused_by"] == "operator@example.com"
    gauge = next(
        family
        for family in text_string_to_metric_families(env.get("/metrics", "viewer").text)
        if family.name == "dramatiq_pg_queue_paused"
    )
    values = {s.labels["queue"]: s.value for s in gauge.samples}
    assert values[queue] == 1 and values["reports"] == 0

    resumed = post(env, f"/api/queues/{queue}/resume", "admin")
    assert resumed.status_code == 200
    assert not resumed.json["paused"] and resumed.json["resumed_by"] == "admin@example.com"


def test_pausing_an_unknown_or_impossible_queue_is_refused_in_a_sentence(env):
    missing = post(env, f"/api/queues/nobody_{uuid.uuid4().hex[:6]}/pause")
    assert missing.status_code == 404 and "no worker has declared queue" in missing.json["message"]
    bad = post(env, "/api/queues/9lives/pause")
    assert bad.status_code == 400 and "is not a queue name" in bad.json["message"]
    assert post(env, "/api/queues/reports/pause", "viewer").status_code == 403


# -- workers and actors ---------------------------------------------------------------------


def test_the_live_workers_and_the_declared_actors_are_listed(env, schema):
    with env.pool.connection() as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.workers (id, host, pid, queues, actors, version, expires_at,"
                " in_flight) VALUES ('h1:42:ab', 'h1', 42, '{{reports}}', '{{reports.build}}',"
                " '0.2.0', now() + interval '1 minute', 3),"
                " ('h2:43:cd', 'h2', 43, '{{}}', '{{}}', '0.2.0', now() - interval '1 second', 0)"
            ).format(sql.Identifier(schema))
        )
    workers = env.get("/api/workers", "viewer").json
    ids = [w["id"] for w in workers["results"]]
    assert "h1:42:ab" in ids and "h2:43:cd" not in ids, "an expired worker is not live"
    live = next(w for w in workers["results"] if w["id"] == "h1:42:ab")
    assert (live["host"], live["pid"], live["in_flight"]) == ("h1", 42, 3)
    actors = {a["actor_name"]: a for a in env.get("/api/actors", "member").json["results"]}
    assert actors["reports.build"]["queue_name"] == "reports"
    assert actors["reports.build"]["live_workers"] == 1
    assert env.get("/api/workers", "member").status_code == 403


# -- jobs only for declared actors, on their queue -------------------------------------------


def test_a_job_for_an_undeclared_actor_is_refused_naming_it(env):
    result = post(env, "/api/jobs", json={"actor_name": "invoice\u202egnp.exe"})
    assert result.status_code == 400
    # Named with its control character escaped: it cannot pass for another name.
    assert "'invoice\\u202egnp.exe'" in result.json["message"]
    assert "\u202e" not in result.json["message"]
    assert "no worker has declared an actor named" in result.json["message"]


def test_a_job_goes_to_its_actors_queue_and_no_other(env):
    created = post(env, "/api/jobs", json={"actor_name": "reports.build", "args": [1]})
    assert created.status_code == 201, created.text
    assert created.json["queue_name"] == "reports"
    same = post(env, "/api/jobs", json={"actor_name": "reports.build", "queue_name": "reports"})
    assert same.status_code == 201
    elsewhere = post(env, "/api/jobs", json={"actor_name": "reports.build", "queue_name": "mail"})
    assert elsewhere.status_code == 400
    assert "runs on queue 'reports', not 'mail'" in elsewhere.json["message"]


def test_a_member_cannot_add_a_metric_label_or_a_queue(env):
    before_labels = labels(env)
    before_queues = {q["queue_name"] for q in env.get("/api/queues", "viewer").json["results"]}
    refused = [
        {"actor_name": f"made.up{i}", "queue_name": f"invented_{'x' * 200}_{i}"} for i in range(5)
    ] + [
        {"actor_name": f"made.up{i}"} for i in range(5)
    ] + [
        {"actor_name": "mail.send", "queue_name": f"invented_{i}"} for i in range(5)
    ]  # fmt: skip
    for body in refused:
        result = post(env, "/api/jobs", "member", json=body)
        assert result.status_code == 400, (body, result.text)
    accepted = post(env, "/api/jobs", "member", json={"actor_name": "mail.send", "args": ["hi"]})
    assert accepted.status_code == 201, accepted.text

    assert labels(env) == before_labels
    after_queues = {q["queue_name"] for q in env.get("/api/queues", "viewer").json["results"]}
    assert after_queues == before_queues


def test_jobs_of_undeclared_queues_share_one_metric_label(adhoc):
    """With ad-hoc actors allowed, jobs may wait in queues no worker declared: /metrics
    counts them together, so their names never become labels."""
    for i in range(3):
        result = post(
            adhoc, "/api/jobs", json={"actor_name": "adhoc.a", "queue_name": f"adhoc_{i}"}
        )
        assert result.status_code == 201, result.text
    found = labels(adhoc)
    assert not any(name.startswith("adhoc_") for values in found.values() for name in values)
    assert "(undeclared)" in found["dramatiq_pg_jobs_queued"]
    listed = {q["queue_name"]: q for q in adhoc.get("/api/queues", "viewer").json["results"]}
    assert listed["adhoc_0"]["declared"] is False and listed["adhoc_0"]["queued"] == 1


# -- list rows: bounded previews ------------------------------------------------------------


def test_a_list_row_carries_bounded_previews_and_the_job_page_the_whole(adhoc):
    big = "x" * 800_000
    created = post(
        adhoc, "/api/jobs", json={"actor_name": "adhoc.big", "queue_name": "big", "args": [big]}
    )
    assert created.status_code == 201
    job_id = created.json["id"]
    page = adhoc.get("/api/jobs?queue=big")
    row = next(r for r in page.json["results"] if r["id"] == job_id)
    assert "message" not in row and "last_error" not in row
    assert len(row["args_preview"]) == PREVIEW_CHARS and row["args_preview"].endswith("…")
    assert row["args_preview"].startswith('["xxx')
    assert len(page.text) < 20_000, f"a one-job page is {len(page.text)} characters"
    assert adhoc.get(f"/api/jobs/{job_id}").json["message"]["args"] == [big]

    failed = adhoc.failed(queue="big_errors")
    with adhoc.pool.connection() as conn:
        conn.execute(
            sql.SQL("UPDATE {}.jobs_history SET last_error = %s WHERE id = %s").format(
                sql.Identifier(adhoc.settings.schema)
            ),
            ("E" * 5000, failed),
        )
    row = adhoc.get("/api/jobs?queue=big_errors").json["results"][0]
    assert len(row["error_preview"]) == PREVIEW_CHARS
    assert adhoc.get(f"/api/jobs/{failed}").json["last_error"] == "E" * 5000


def test_abort_of_a_running_job_whose_row_is_held_answers_409_within_about_a_second(env, pg_url):
    """A transaction holds the job's row (as a complete_in() block's does once it wrote
    the job's success): the abort waits about a second, changes nothing and names it."""
    job_id = env.running()
    holder = psycopg.connect(pg_url, application_name="app-holder")
    try:
        holder.execute(
            f'SELECT 1 FROM "{env.settings.schema}".jobs WHERE id = %s FOR UPDATE', (job_id,)
        )
        began = time.monotonic()
        refused = post(env, f"/api/jobs/{job_id}/abort")
        took = time.monotonic() - began
    finally:
        holder.close()
    assert refused.status_code == 409, refused.text
    assert 1.0 <= took < 3.0, f"answered after {took:.2f}s"
    message = refused.json["message"]
    assert "held by the transaction of backend" in message and "'app-holder'" in message
    assert "nothing was changed" in message
    assert env.store.get(job_id)["abort_requested_at"] is None
