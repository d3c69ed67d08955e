"""The OpenAPI document describes the routes, methods, bodies and responses the API has."""

from __future__ import annotations

import json
import re
import uuid
from types import SimpleNamespace
from urllib.parse import parse_qs, urljoin, urlsplit

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
                responder = getattr(resource, f"on_{method.method.lower()}")
                assert hasattr(responder, "operation"), (route.path, method.method)

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
# (env.client checks each answer against the document: see admin_support.CheckedClient)


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
    calls, before = 0, env.client.checked
    for template, ops in document["paths"].items():
        for method, op in ops.items():
            if "requestBody" in op:
                schema = op["requestBody"]["content"]["application/json"]["schema"]
                sample = Walk.BODIES[(method, template)]()
                jsonschema.Draft202012Validator(schema).validate(sample)
            for role in (None, *ROLES):
                walk.call(method, template, op, role)  # the client checks the answer
                calls += 1
    assert env.client.checked - before >= calls


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


def test_a_query_parameter_given_empty_is_left_out_as_the_document_says(env):
    """``?queue=`` is ``?queue`` left out (a form's empty field, the dashboard's filters):
    the document says so of every query parameter (allowEmptyValue), so that a client
    reading it, or a generator such as schemathesis, need not guess why an empty
    date-time or UUID is taken."""
    document = openapi.build()
    walk = Walk(env)
    for template, ops in document["paths"].items():
        for method, op in ops.items():
            for param in op.get("parameters", ()):
                if param["in"] != "query":
                    continue
                label = f"{method.upper()} {template}?{param['name']}="
                assert param.get("allowEmptyValue") is True, label
                result = walk.call(method, template, op, "admin", query_string=f"{param['name']}=")
                assert result.status_code < 300, f"{label}: {result.status_code} {result.text}"


def test_an_empty_object_is_refused_exactly_where_the_document_refuses_it(env):
    """Every body the API takes: ``{}`` is a 400 when the document's schema refuses it
    (a required field, or at least one field), and passes the body's check when the
    schema accepts it, so that a client (or a generator such as schemathesis) reading the
    document sends what the API takes."""
    document = openapi.build()
    walk = Walk(env)
    for template, ops in document["paths"].items():
        for method, op in ops.items():
            if "requestBody" not in op:
                continue
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            valid = jsonschema.Draft202012Validator(schema).is_valid({})
            result = walk.call(method, template, op, "admin", json={})
            label = f"{method.upper()} {template} {{}}: {result.status_code} {result.text}"
            assert (result.status_code == 400) is not valid, label


def test_a_blank_string_is_refused_exactly_where_the_document_refuses_it(env):
    """Every string field of every body, sent as eight spaces in an otherwise valid body:
    the API refuses it (naming the field) exactly when the document's schema does, so
    that a client reading the document does not send a blank name, email or password."""
    document = openapi.build()
    walk = Walk(env)
    for template, ops in document["paths"].items():
        for method, op in ops.items():
            if "requestBody" not in op:
                continue
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            for name, field in schema["properties"].items():
                # A format (a date-time) says what it takes; a blank is none.
                if "string" not in field.get("type", ()) or "format" in field:
                    continue
                body = {**Walk.BODIES[(method, template)](), name: " " * 8}
                valid = jsonschema.Draft202012Validator(schema).is_valid(body)
                result = walk.call(method, template, op, "admin", json=body)
                label = f"{method.upper()} {template} {name}: {result.status_code} {result.text}"
                refused = result.status_code == 400 and result.json["message"].startswith(name)
                assert refused is not valid, label


def test_every_answer_of_the_api_tests_is_checked_against_the_served_document(env):
    """The tests' client (admin_support.CheckedClient) holds the document the app serves
    and refuses an answer it does not describe: an undocumented status, a body with a
    field it does not list, a null it does not allow."""
    assert env.client.document == env.get("/api/openapi.json", "viewer").json
    assert env.client.document == openapi.build()
    before = env.client.checked
    env.get("/api/jobs/stats", "viewer")
    assert env.client.checked == before + 1

    def answer(status, body):
        return SimpleNamespace(
            status_code=status, content=json.dumps(body).encode(), json=body, text=str(body)
        )

    limit = {"queue_name": "q", "limit": None, "source": None, "set_by": None, "set_at": None}
    env.client.check("PUT", "/api/queues/q/limit", answer(200, limit))
    for status, body in (
        (418, {"error": "teapot", "message": "No."}),
        (200, {**limit, "source": "someone"}),
        (200, {**limit, "extra": 1}),
    ):
        with pytest.raises(AssertionError):
            env.client.check("PUT", "/api/queues/q/limit", answer(status, body))


def test_every_operation_refuses_a_query_parameter_it_does_not_take(env):
    """As the guide says: a misspelt filter is a 400, not a silently ignored one; the
    docs page alone (a page: a link may add anything to its address) takes any."""
    document = openapi.build()
    walk = Walk(env)
    for template, ops in document["paths"].items():
        for method, op in ops.items():
            label = f"{method.upper()} {template}?surely_not=1"
            result = walk.call(method, template, op, "admin", params={"surely_not": "1"})
            if (method, template) == ("get", "/api/docs"):
                assert result.status_code == 200, label
                continue
            assert result.status_code == 400, f"{label}: {result.status_code} {result.text}"
            assert "unknown query parameter(s) 'surely_not'" in result.json["message"], label
    metrics = env.get("/metrics", "viewer", params={"surely_not": "1"})
    assert metrics.status_code == 400, metrics.text
    assert env.get("/metrics", "viewer").status_code == 200


def test_every_operation_that_changes_something_refuses_a_body_field_it_does_not_take(env):
    """As the guide says: an unknown body field is a 400, not silently ignored, by every
    endpoint; those that take no body (log out, revoke a token) take none or ``{}``, as the
    actions do, and say so in the document."""
    document = openapi.build()
    walk = Walk(env)
    for template, ops in document["paths"].items():
        for method, op in ops.items():
            if method == "get":
                continue
            label = f"{method.upper()} {template} {{'surely_not': 1}}"
            result = walk.call(method, template, op, "admin", json={"surely_not": 1})
            assert result.status_code == 400, f"{label}: {result.status_code} {result.text}"
            assert "unknown field(s) 'surely_not'" in result.json["message"], label
            assert "requestBody" in op, label


def test_the_docs_page_at_a_trailing_slash_sends_to_its_address_where_its_requests_reach(env):
    """The page's requests are relative to its address: at /api/docs/ each would 404, so
    that address sends the browser to /api/docs, from where each reaches the API."""
    moved = env.get("/api/docs/", None)
    assert moved.status_code == 301
    assert moved.headers["location"] == "/api/docs"
    page = env.get(moved.headers["location"], None)
    assert page.status_code == 200
    requests = re.findall(r'fetch\("([^"]+)"', page.text)
    assert sorted(requests) == ["auth/login", "auth/me", "openapi.json"]
    documented = openapi.build()["paths"]
    for relative in requests:
        path = urljoin("http://api.example/api/docs", relative).removeprefix("http://api.example")
        assert path in documented, (relative, path)
        assert env.get(path, "viewer").status_code != 404, path
