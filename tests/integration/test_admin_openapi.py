"""The OpenAPI document describes the routes, methods, bodies and responses the API has."""

from __future__ import annotations

import uuid
from urllib.parse import parse_qs, urlsplit

import falcon.inspect
import jsonschema
import pytest

from admin_api import openapi
from admin_api.accounts import ROLES
from admin_api.app import API, build
from admin_api.resources.jobs import JobRequest

from .admin_support import Walk


def test_every_route_and_method_of_the_api_is_documented_and_nothing_else(env):
    """Every route under /api the app serves is in the document with the same methods
    (HEAD aside: it is GET without the body), in the order of the router's table."""
    served = {
        route.path: {m.method.lower() for m in route.methods if not m.internal} - {"head"}
        for route in falcon.inspect.inspect_routes(env.app)
        if route.path.startswith("/api")
    }
    documented = {path: set(ops) for path, ops in openapi.build()["paths"].items()}
    assert documented == served
    assert [resource.route for resource in API] == list(documented)


def test_every_responder_the_app_serves_declares_its_operation(env):
    """Pages and /metrics included: their roles, like the API's, come from the
    declaration, and a responder without one could not be added (see build)."""
    for route in falcon.inspect.inspect_routes(env.app):
        resource = env.app._router.find(route.path.replace("{", "").replace("}", ""))[0]
        for method in route.methods:
            if not method.internal:
                assert hasattr(getattr(resource, method.function_name), "operation"), (
                    route.path,
                    method.method,
                )

    class Undeclared:
        route = "/api/undeclared"

        def on_get(self, req, resp):
            pass

    with pytest.raises(TypeError, match="declares no operation"):
        build(Undeclared, None)


def test_the_document_is_served_and_the_job_body_is_the_validated_one(env):
    result = env.get("/api/openapi.json", "viewer")
    assert result.status_code == 200
    document = result.json
    assert document["openapi"].startswith("3.1")
    body = document["paths"]["/api/jobs"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == openapi.body_schema(JobRequest)
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
    assert set(stats["oldest_queued"]) == set(schemas["OldestQueued"]["properties"])
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


# -- every documented operation, called for real -------------------------------------------


def _strict(schema):
    """The schema with ``additionalProperties: false`` on every object that lists its
    properties, so that a field the document does not list fails the validation."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_strict(value) for value in schema]
    return schema


def _check_response(document, op, label, result):
    responses = op["responses"]
    status = str(result.status_code)
    assert status in responses, f"{label}: {status} is not documented: {result.text[:300]}"
    content = responses[status].get("content", {}).get("application/json")
    if content is None:
        return
    # The response schema's references point into the document's components.
    schema = {"allOf": [content["schema"]], "components": document["components"]}
    errors = sorted(
        jsonschema.Draft202012Validator(_strict(schema)).iter_errors(result.json), key=str
    )
    assert not errors, f"{label}: {status} body does not match the document: {errors[0]}"


def _sample_query_value(schema):
    if "enum" in schema:
        return schema["enum"][0]
    if schema.get("type") == "integer":
        return str(schema.get("default", schema.get("minimum", 0)))
    if schema.get("format") == "date-time":
        return "2030-01-01T00:00:00Z"
    if schema.get("format") == "uuid":
        return str(uuid.uuid4())
    return "x"


def test_every_operation_answers_as_documented_for_every_role(env):
    document = openapi.build()
    walk = Walk(env)
    for template, ops in document["paths"].items():
        for method, op in ops.items():
            if "requestBody" in op:
                schema = op["requestBody"]["content"]["application/json"]["schema"]
                sample = Walk.BODIES[(method, template)]()
                jsonschema.Draft202012Validator(schema).validate(sample)
            for role in (None, *ROLES):
                label = f"{method.upper()} {template} as {role}"
                _check_response(document, op, label, walk.call(method, template, op, role))


def test_every_documented_query_parameter_is_accepted(env):
    document = openapi.build()
    walk = Walk(env)
    for template, ops in document["paths"].items():
        for method, op in ops.items():
            for param in op.get("parameters", ()):
                if param["in"] != "query":
                    continue
                if param["name"] == "cursor":  # opaque: take one from a next link
                    env.create_job()
                    env.create_job()
                    following = env.get(template, params={"limit": 1}).json["next"]
                    value = parse_qs(urlsplit(following).query)["cursor"][0]
                else:
                    value = _sample_query_value(param["schema"])
                label = f"{method.upper()} {template}?{param['name']}={value}"
                result = walk.call(method, template, op, "admin", params={param["name"]: value})
                assert result.status_code < 300, f"{label}: {result.status_code} {result.text}"
                _check_response(document, op, label, result)
