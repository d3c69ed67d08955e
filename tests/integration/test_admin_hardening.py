"""What an attacker's probe of the admin API found, each fixed: links never built from the
Host header, HEAD, media types in any case, response headers, hidden characters in
e-mails, and a statement timeout that answers 503."""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest
from psycopg import sql

from .admin_support import CSRF, PASSWORD, AdminEnv


@pytest.fixture(scope="module")
def admin_settings():
    return dict(cors_origins=("https://ops.example.com",))


def test_links_are_relative_whatever_the_host_header(env):
    for _ in range(3):
        env.enqueue()
    page = env.get("/api/jobs?limit=1", headers={"Host": "evil.example"}).json
    assert page["next"].startswith("/api/jobs?"), page["next"]
    assert "evil" not in page["next"]
    feed = env.get("/api/job-events?limit=1", headers={"Host": "evil.example"}).json
    assert feed["next"].startswith("/api/job-events?"), feed["next"]
    created = env.post("/api/jobs", "operator", json={"actor_name": "tests.x"})
    assert created.headers["location"] == f"/api/jobs/{created.json['id']}"


def test_the_dashboard_redirect_is_relative_whatever_the_host_header(env):
    result = env.get("/", None, headers={"Host": "evil.example"})
    assert result.status_code == 302
    assert result.headers["location"] == "/dashboard"


def test_links_use_the_configured_public_url(pg_url, schema):
    env = AdminEnv(pg_url, schema, public_url="https://ops.example.com/queue/")
    try:
        env.enqueue()
        env.enqueue()
        page = env.get("/api/jobs?limit=1", headers={"Host": "evil.example"}).json
        assert page["next"].startswith("https://ops.example.com/queue/api/jobs?"), page["next"]
        created = env.post("/api/jobs", "operator", json={"actor_name": "tests.x"})
        assert created.headers["location"].startswith("https://ops.example.com/queue/api/jobs/")
        # The public URL is the API's own origin for the CSRF check.
        cookies = {"dpb_session": env.login("operator@example.com")}
        for origin, status in (
            ("https://ops.example.com", 201),
            ("http://falconframework.org", 403),
        ):
            result = env.client.simulate_post(
                "/api/jobs",
                json={"actor_name": "tests.x"},
                cookies=cookies,
                headers={**CSRF, "Origin": origin},
            )
            assert result.status_code == status, (origin, result.text)
    finally:
        env.close()


@pytest.mark.parametrize(
    "path", ["/api/jobs", "/api/jobs/stats", "/api/job-events", "/api/config", "/api/health"]
)
def test_head_answers_like_get_without_a_body(env, path):
    get = env.get(path, "viewer")
    head = env.request("HEAD", path, "viewer")
    assert head.status_code == get.status_code == 200
    assert head.text == ""
    assert head.headers["content-type"] == get.headers["content-type"]


def test_head_needs_the_same_credentials_as_get(env):
    assert env.request("HEAD", "/api/jobs", None).status_code == 401
    assert env.request("HEAD", "/api/jobs/stats", "member").status_code == 403
    assert env.request("HEAD", "/api/users", "viewer").status_code == 403


@pytest.mark.parametrize(
    "content_type", ["APPLICATION/JSON", "Application/Json; charset=UTF-8", "application/json"]
)
def test_media_types_are_case_insensitive(env, content_type):
    result = env.request(
        "POST",
        "/api/jobs",
        "operator",
        body=b'{"actor_name": "tests.x"}',
        headers={"Content-Type": content_type},
    )
    assert result.status_code == 201, result.text


def test_other_media_types_are_415(env):
    result = env.request(
        "POST",
        "/api/jobs",
        "operator",
        body=b"actor_name=x",
        headers={"Content-Type": "text/plain"},
    )
    assert result.status_code == 415


def test_every_response_is_not_stored_and_not_sniffed(env):
    login = env.client.simulate_post(
        "/api/auth/login",
        json={"email": "viewer@example.com", "password": PASSWORD},
        headers=CSRF,
    )
    token = env.post(f"/api/users/{env.users['viewer'].id}/tokens", json={"name": "x"})
    for result in (
        login,
        token,
        env.get("/api/jobs", "viewer"),
        env.get("/api/nowhere", "viewer"),
        env.get("/api/health", None),
    ):
        assert result.headers["cache-control"] == "no-store", result.headers
        assert result.headers["x-content-type-options"] == "nosniff"
        assert "Origin" in result.headers["vary"]


def test_no_vary_origin_without_cors(pg_url, schema):
    env = AdminEnv(pg_url, schema)
    try:
        assert "vary" not in env.get("/api/jobs", "viewer").headers
    finally:
        env.close()


@pytest.mark.parametrize(
    "character", ["\u202e", "\u202d", "\u2066", "\u2069", "\u200b", "\u200d", "\ufeff", "\x07"]
)
def test_emails_with_hidden_characters_are_refused(env, character):
    address = f"ad{character}min{uuid.uuid4().hex[:6]}@example.com"
    result = env.post("/api/users", json={"email": address, "password": PASSWORD, "role": "viewer"})
    assert result.status_code == 400, result.text
    assert "invisible or control characters" in result.json["message"]


def test_a_query_past_the_statement_timeout_is_a_503(pg_url, schema):
    env = AdminEnv(pg_url, schema, statement_timeout=0.3)
    locked = threading.Event()
    release = threading.Event()

    def hold_lock():
        with psycopg.connect(pg_url) as conn:
            conn.execute(
                sql.SQL("LOCK TABLE {}.jobs IN ACCESS EXCLUSIVE MODE").format(
                    sql.Identifier(schema)
                )
            )
            locked.set()
            release.wait(30)

    holder = threading.Thread(target=hold_lock)
    holder.start()
    try:
        assert locked.wait(30)
        result = env.get("/api/jobs", "viewer")
        assert result.status_code == 503, result.text
        assert "statement timeout" in result.json["message"]
        assert result.headers["retry-after"]
    finally:
        release.set()
        holder.join(30)
        env.close()
