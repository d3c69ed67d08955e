"""Property-based test: nothing a client sends makes the admin API answer 500.

Hypothesis generates request bodies (valid-looking job bodies with wrong types, odd
strings, deep or huge values, unknown fields), raw bytes, query strings and path ids, and
sends them with valid credentials, so that every request reaches the validation and the
database. Every answer must be JSON in the error shape when it is not a success.
"""

from __future__ import annotations

import json
import string
from urllib.parse import quote

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=30),
    st.sampled_from(["", " ", "\x00", "\ud800", "demo.success", "2030-01-01T00:00:00Z", "é"]),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
job_fields = st.sampled_from(
    [
        "actor_name",
        "queue_name",
        "args",
        "kwargs",
        "priority",
        "delay",
        "available_at",
        "max_retries",
        "idempotency_key",
        "options",
        "",
    ]
)
job_bodies = st.one_of(
    st.dictionaries(job_fields, json_values, max_size=6),
    st.fixed_dictionaries(
        {"actor_name": st.text(max_size=20)},
        optional={
            "queue_name": st.text(max_size=20),
            "args": json_values,
            "kwargs": json_values,
            "priority": json_values,
            "delay": st.one_of(st.integers(), json_values),
            "available_at": st.one_of(st.text(max_size=30), json_values),
            "max_retries": st.one_of(st.integers(), json_values),
            "idempotency_key": st.one_of(st.text(max_size=10), json_values),
        },
    ),
    json_values,
)
raw_bodies = st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode))
param_values = st.one_of(
    st.text(max_size=30),
    st.integers(min_value=-(2**80), max_value=2**80).map(str),
    st.sampled_from(["", "%00", "%ff", "%", "queued", "2024-01-01", "bzo1"]),
)
ids = st.one_of(
    st.uuids().map(str),
    st.text(alphabet=string.printable, min_size=1, max_size=40),
    st.sampled_from(["0", "-1", "99999999999999999999", "%00", "..", "stats"]),
)


def check(result) -> None:
    assert result.status_code < 500, (result.status_code, result.text)
    if result.status_code >= 400:
        body = result.json
        assert set(body) == {"error", "message"} and body["message"], body


def send(env, method, path, role, payload, **headers):
    """Send JSON as a client library would: escaped, so lone surrogates travel as \\udxxx."""
    headers = {"Content-Type": "application/json", **headers}
    return env.request(method, path, role, body=json.dumps(payload).encode(), headers=headers)


@FUZZ
@given(body=job_bodies, role=st.sampled_from(["operator", "member"]))
def test_job_bodies_never_cause_a_500(env, body, role):
    check(
        env.post(
            "/api/jobs",
            role,
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
    )


@FUZZ
@given(raw=raw_bodies, path=st.sampled_from(["/api/jobs", "/api/users", "/api/auth/login"]))
def test_raw_bodies_never_cause_a_500(env, raw, path):
    headers = {"Content-Type": "application/json", "X-Requested-With": "fuzz"}
    check(env.post(path, "admin", body=raw, headers=headers))


@FUZZ
@given(
    path=st.sampled_from(["/api/jobs", "/api/job-events", "/api/jobs/stats", "/api/users"]),
    params=st.dictionaries(
        st.sampled_from(
            ["limit", "offset", "status", "queue", "actor", "created_after", "created_before",
             "cursor", "type", "job_id", "x"]
        ),
        param_values,
        max_size=4,
    ),
    role=st.sampled_from(["viewer", "member", "admin"]),
)  # fmt: skip
def test_query_strings_never_cause_a_500(env, path, params, role):
    query = "&".join(f"{quote(k)}={quote(v, safe='%')}" for k, v in params.items())
    check(env.get(path, role, query_string=query))


@FUZZ
@given(
    job_id=ids,
    suffix=st.sampled_from(["", "/events", "/retry", "/cancel"]),
    user_part=st.sampled_from(["/api/users/{}", "/api/users/{}/tokens", "/api/tokens/{}"]),
)
def test_path_ids_never_cause_a_500(env, job_id, suffix, user_part):
    segment = quote(job_id, safe="")
    method = "POST" if suffix in ("/retry", "/cancel") else "GET"
    check(env.request(method, f"/api/jobs/{segment}{suffix}", "operator"))
    check(env.get(user_part.format(segment), "admin"))


@FUZZ
@given(body=json_values, field=st.sampled_from(["email", "password", "role", "active", "name"]))
def test_account_bodies_never_cause_a_500(env, body, field):
    payload = {"email": "fuzz@example.com", "password": "fuzz password", "role": "viewer"}
    payload[field] = body
    check(send(env, "POST", "/api/users", "admin", payload))
    login = {"email": payload["email"], "password": payload["password"]}
    check(send(env, "POST", "/api/auth/login", None, login, **{"X-Requested-With": "fuzz"}))
    member = env.users["member"].id
    check(send(env, "PATCH", f"/api/users/{member}", "admin", {field: body}))
    check(send(env, "POST", f"/api/users/{member}/tokens", "admin", {field: body}))
