"""The admin API's workflows: the list (and the workflow of a job), one workflow with
every step and its job, the operator's abort and retry with their 409s and 404s, and a
member who sees only the workflows they created."""

from __future__ import annotations

import uuid

from .admin_support import CSRF


def post(env, path: str, role: str = "operator"):
    return env.post(path, role, headers=CSRF)


def test_the_list_and_one_workflow_with_its_steps_and_jobs(env):
    workflow_id = env.workflow()
    listed = env.get("/api/workflows", "viewer")
    assert listed.status_code == 200, listed.text
    (row,) = [w for w in listed.json["results"] if w["id"] == workflow_id]
    assert row["status"] == "running" and row["name"] == "walk"
    assert row["steps"]["running"] == 1 and row["nodes"] == 1

    detail = env.get(f"/api/workflows/{workflow_id}", "viewer")
    assert detail.status_code == 200, detail.text
    (node,) = detail.json["nodes"]
    assert node["status"] == "running" and node["job_status"] == "queued"
    job = env.get(f"/api/jobs/{node['job_id']}", "viewer").json
    assert job["workflow_node"] == node["id"]
    # The workflow of a job (the dashboard's link from the job's page).
    found = env.get(f"/api/workflows?job={node['job_id']}", "viewer").json["results"]
    assert [w["id"] for w in found] == [workflow_id]
    assert env.get(f"/api/workflows?job={uuid.uuid4()}", "viewer").json["results"] == []
    filtered = env.get("/api/workflows?status=succeeded", "viewer").json["results"]
    assert workflow_id not in {w["id"] for w in filtered}


def test_bad_input_is_a_400_and_an_unknown_workflow_a_404(env):
    bad = env.get("/api/workflows/not-a-uuid", "viewer")
    assert bad.status_code == 400 and "workflow id must be a UUID" in bad.json["message"]
    assert env.get("/api/workflows?status=done", "viewer").status_code == 400
    assert env.get("/api/workflows?job=nope", "viewer").status_code == 400
    assert env.get("/api/workflows?limit=0", "viewer").status_code == 400
    assert env.get(f"/api/workflows/{uuid.uuid4()}", "viewer").status_code == 404
    assert post(env, f"/api/workflows/{uuid.uuid4()}/abort").status_code == 404


def test_abort_then_retry_and_their_409s(env):
    workflow_id = env.workflow()
    assert post(env, f"/api/workflows/{workflow_id}/abort", "viewer").status_code == 403
    refused = post(env, f"/api/workflows/{workflow_id}/retry")
    assert refused.status_code == 409
    assert "only failed or cancelled workflows can be retried" in refused.json["message"]
    aborted = post(env, f"/api/workflows/{workflow_id}/abort")
    assert aborted.status_code == 200, aborted.text
    assert aborted.json["status"] == "cancelled"
    assert aborted.json["cancelled_by"] == "operator@example.com"
    assert aborted.json["nodes"][0]["job_status"] == "cancelled"
    again = post(env, f"/api/workflows/{workflow_id}/abort")
    assert again.status_code == 409
    assert "only running workflows can be aborted" in again.json["message"]
    retried = post(env, f"/api/workflows/{workflow_id}/retry")
    assert retried.status_code == 200, retried.text
    assert retried.json["status"] == "running"
    node = retried.json["nodes"][0]
    assert node["status"] == "running" and node["job_status"] == "queued"
    assert node["job_id"] != aborted.json["nodes"][0]["job_id"]


def test_a_member_sees_only_the_workflows_they_created(env):
    member = env.users["member"]
    theirs = env.workflow(created_by=str(member.id))
    other = env.workflow()
    listed = {w["id"] for w in env.get("/api/workflows", "member").json["results"]}
    assert theirs in listed and other not in listed
    assert env.get(f"/api/workflows/{theirs}", "member").status_code == 200
    assert env.get(f"/api/workflows/{other}", "member").status_code == 404
    assert env.get(f"/api/workflows/{other}", "viewer").status_code == 200
