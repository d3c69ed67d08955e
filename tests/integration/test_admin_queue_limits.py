"""The admin API's queue limits: ``PUT /api/queues/{name}/limit`` for operators and admins,
its validation in sentences, null lifting a limit, and the limit in the queue list (the
dashboard's overview reads it there)."""

from __future__ import annotations

import uuid

import pytest

from .admin_support import CSRF, AdminEnv


@pytest.fixture(scope="module")
def env(pg_url, schema):
    env = AdminEnv(pg_url, schema, admin_adhoc_actors=False)
    yield env
    env.close()


def put(env: AdminEnv, path: str, role: str = "operator", **kwargs):
    return env.request("PUT", path, role, headers=CSRF, **kwargs)


def listed(env: AdminEnv) -> dict[str, dict]:
    return {q["queue_name"]: q for q in env.get("/api/queues", "viewer").json["results"]}


def declared(env: AdminEnv) -> str:
    queue = f"lq_{uuid.uuid4().hex[:6]}"
    env.declare(queues=[queue])
    return queue


def test_an_operator_sets_a_limit_and_null_lifts_it(env):
    queue = declared(env)
    assert listed(env)[queue]["limit"] is None
    result = put(env, f"/api/queues/{queue}/limit", json={"limit": 3})
    assert result.status_code == 200, result.text
    assert result.json["limit"] == 3 and result.json["queue_name"] == queue
    assert result.json["source"] == "operator" and result.json["set_by"] == "operator@example.com"
    assert result.json["set_at"]
    assert listed(env)[queue]["limit"] == 3
    raised = put(env, f"/api/queues/{queue}/limit", "admin", json={"limit": 7})
    assert raised.status_code == 200 and raised.json["set_by"] == "admin@example.com"
    assert listed(env)[queue]["limit"] == 7
    lifted = put(env, f"/api/queues/{queue}/limit", json={"limit": None})
    assert lifted.status_code == 200, lifted.text
    assert lifted.json == {
        "queue_name": queue,
        "limit": None,
        "source": None,
        "set_by": None,
        "set_at": None,
    }
    assert listed(env)[queue]["limit"] is None
    # Lifting a queue's absent limit is no error.
    assert put(env, f"/api/queues/{queue}/limit", json={"limit": None}).status_code == 200


def test_only_operators_and_admins_set_limits(env):
    queue = declared(env)
    for role in ("viewer", "member"):
        refused = put(env, f"/api/queues/{queue}/limit", role, json={"limit": 2})
        assert refused.status_code == 403, (role, refused.text)
    assert put(env, f"/api/queues/{queue}/limit", None, json={"limit": 2}).status_code == 401
    assert listed(env)[queue]["limit"] is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "lacks the required field(s) limit"),
        ({"limit": 0}, "limit must be at least 1"),
        ({"limit": -3}, "limit must be at least 1"),
        ({"limit": 2.5}, "limit must be an integer"),
        ({"limit": "3"}, "limit must be an integer"),
        ({"limit": True}, "limit must be an integer"),
        ({"limit": 3, "queue": "x"}, "unknown field(s) 'queue'"),
        ([3], "must be a JSON object"),
        ({"limit": 10_000_000}, "limit must be at most"),
    ],
)
def test_a_malformed_body_is_a_400_with_a_sentence(env, body, message):
    queue = declared(env)
    result = put(env, f"/api/queues/{queue}/limit", json=body)
    assert result.status_code == 400, result.text
    assert message in result.json["message"], result.json
    assert listed(env)[queue]["limit"] is None


def test_no_body_an_unknown_queue_and_an_impossible_name_are_refused(env):
    queue = declared(env)
    empty = put(env, f"/api/queues/{queue}/limit")
    assert empty.status_code == 400, empty.text
    missing = put(env, f"/api/queues/nobody_{uuid.uuid4().hex[:6]}/limit", json={"limit": 2})
    assert missing.status_code == 404 and "no worker has declared queue" in missing.json["message"]
    bad = put(env, "/api/queues/9lives/limit", json={"limit": 2})
    assert bad.status_code == 400 and "is not a queue name" in bad.json["message"]


def test_the_dashboard_overview_shows_each_queues_limit(env):
    """The overview's table has a Limit column, filled from /api/queues."""
    queue = declared(env)
    put(env, f"/api/queues/{queue}/limit", json={"limit": 4})
    script = env.get("/dashboard/static/dashboard.js", None).text
    assert 'text: "Limit"' in script and '"data-field": "limit"' in script
    assert listed(env)[queue]["limit"] == 4
