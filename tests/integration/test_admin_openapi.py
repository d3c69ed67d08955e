"""The OpenAPI document describes the routes, methods, bodies and responses the API has."""

from __future__ import annotations

import re

import pytest

from admin_api import openapi
from admin_api.app import routes
from admin_api.resources.jobs import JOB_FIELDS
from admin_api.validation import object_schema

from .admin_support import AdminEnv


@pytest.fixture(scope="module")
def env(pg_url, schema):
    env = AdminEnv(pg_url, schema)
    yield env
    env.close()


def _template(path: str) -> str:
    return path


def test_every_route_and_method_is_documented_and_nothing_else(env):
    document = openapi.build()
    served = {}
    for path, resource in routes(env.settings, env.store, env.accounts, env.app and None or None):
        methods = {name[3:] for name in dir(resource) if re.fullmatch(r"on_[a-z]+", name)}
        served[path] = methods
    documented = {path: set(ops) for path, ops in document["paths"].items()}
    assert documented == served


def test_permissions_are_declared_for_every_responder(env):
    for _path, resource in routes(env.settings, env.store, env.accounts, None):
        methods = {name[3:].upper() for name in dir(resource) if re.fullmatch(r"on_[a-z]+", name)}
        if getattr(resource, "public", False):
            continue
        assert set(resource.permissions) == methods, resource


def test_the_document_is_served_and_the_job_body_is_the_validated_one(env):
    result = env.get("/api/openapi.json", "viewer")
    assert result.status_code == 200
    document = result.json
    assert document["openapi"].startswith("3.1")
    body = document["paths"]["/api/jobs"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == object_schema(JOB_FIELDS)
    assert body["schema"]["additionalProperties"] is False
    assert body["schema"]["required"] == ["actor_name"]


def test_responses_have_the_documented_fields(env):
    schemas = openapi.build()["components"]["schemas"]
    job = env.create_job()
    assert set(job) == set(schemas["Job"]["properties"])
    events = env.get(f"/api/jobs/{job['id']}/events").json
    assert set(events) == set(schemas["JobTimeline"]["properties"])
    assert set(events["results"][0]) == set(schemas["Event"]["properties"])
    assert set(env.get("/api/jobs").json) == set(schemas["JobPage"]["properties"])
    assert set(env.get("/api/job-events").json) == set(schemas["EventPage"]["properties"])
    stats = env.get("/api/jobs/stats").json
    assert set(stats) == set(schemas["Stats"]["properties"])
    assert set(stats["oldest_queued"]) == set(
        schemas["Stats"]["properties"]["oldest_queued"]["properties"]
    )
    error = env.get("/api/jobs/nope").json
    assert set(error) == set(schemas["Error"]["properties"])
    health = env.get("/api/health", None).json
    assert set(health) <= set(schemas["Health"]["properties"])
    user = env.get(f"/api/users/{env.users['viewer'].id}").json
    assert set(user) == set(schemas["User"]["properties"])


def test_the_docs_page_loads_the_document(env):
    page = env.get("/api/docs", None)
    assert page.status_code == 200
    assert "openapi.json" in page.text and "auth/login" in page.text
    assert "X-Requested-With" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
