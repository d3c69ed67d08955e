"""Authentication, roles and cross-site protection of the admin API."""

from __future__ import annotations

import hashlib

import psycopg
import pytest
from psycopg import sql

from admin_api import accounts as accounts_module
from admin_api.accounts import InvalidAccountData

from .admin_support import CSRF, PASSWORD, AdminEnv, Endpoint

ALL = frozenset({"viewer", "operator", "admin", "member"})
OBSERVERS = frozenset({"viewer", "operator", "admin"})
CREATORS = frozenset({"operator", "admin", "member"})
OPERATORS = frozenset({"operator", "admin"})
ADMINS = frozenset({"admin"})


@pytest.fixture(scope="module")
def admin_settings():
    return dict(cors_origins=("https://ops.example.com",))


def endpoints(env: AdminEnv) -> list[Endpoint]:
    job = env.failed()
    user = env.users["viewer"].id
    return [
        Endpoint("GET", "/api/config", OBSERVERS),
        Endpoint("GET", "/api/jobs", ALL),
        Endpoint("POST", "/api/jobs", CREATORS, {"actor_name": "tests.noop"}),
        Endpoint("GET", "/api/jobs/stats", OBSERVERS),
        Endpoint("GET", f"/api/jobs/{job}", ALL),
        Endpoint("GET", f"/api/jobs/{job}/events", ALL),
        Endpoint("POST", f"/api/jobs/{job}/retry", OPERATORS),
        Endpoint("POST", f"/api/jobs/{job}/cancel", OPERATORS),
        Endpoint("GET", "/api/job-events", ALL),
        Endpoint("GET", "/api/auth/me", ALL),
        Endpoint("GET", "/api/users", ADMINS),
        Endpoint(
            "POST",
            "/api/users",
            ADMINS,
            {"email": "new-{role}@example.com", "password": PASSWORD, "role": "viewer"},
        ),
        Endpoint("GET", f"/api/users/{user}", ADMINS),
        Endpoint("PATCH", f"/api/users/{user}", ADMINS, {"active": True}),
        Endpoint("GET", f"/api/users/{user}/tokens", ADMINS),
        Endpoint("POST", f"/api/users/{user}/tokens", ADMINS, {"name": "script"}),
        Endpoint("DELETE", "/api/tokens/999999", ADMINS),
        Endpoint("GET", "/api/openapi.json", ALL),
    ]


def _body(endpoint: Endpoint, role: str):
    if endpoint.body is None:
        return None
    return {k: v.format(role=role) if isinstance(v, str) else v for k, v in endpoint.body.items()}


def test_every_protected_endpoint_needs_credentials_and_the_right_role(env):
    for endpoint in endpoints(env):
        anonymous = env.request(endpoint.method, endpoint.path, None, json=_body(endpoint, "x"))
        assert anonymous.status_code == 401, (endpoint, anonymous.text)
        assert anonymous.json["error"] == "unauthorized"
        assert anonymous.headers["www-authenticate"].startswith("Bearer")
        for role in sorted(ALL):
            result = env.request(endpoint.method, endpoint.path, role, json=_body(endpoint, role))
            if role in endpoint.roles:
                assert result.status_code not in (401, 403), (endpoint, role, result.text)
            else:
                assert result.status_code == 403, (endpoint, role, result.text)
                assert result.json["error"] == "forbidden"
                assert role in result.json["message"]


def test_public_endpoints_need_no_credentials(env):
    assert env.get("/api/health", None).status_code == 200
    docs = env.get("/api/docs", None)
    assert docs.status_code == 200
    assert docs.headers["content-type"].startswith("text/html")


def test_bad_credentials_are_401(env):
    for header in ("Basic abc", "Bearer", "Bearer not-a-token", "token"):
        result = env.client.simulate_get("/api/jobs", headers={"Authorization": header})
        assert result.status_code == 401, header
        assert result.json["message"]
    result = env.client.simulate_get("/api/jobs", cookies={"dpb_session": "forged"})
    assert result.status_code == 401
    assert "log in again" in result.json["message"]


def test_login_sets_a_protected_session_cookie_that_authenticates(env):
    result = env.client.simulate_post(
        "/api/auth/login",
        json={"email": "Viewer@Example.com ", "password": PASSWORD},
        headers=CSRF,
    )
    assert result.status_code == 200, result.text
    assert result.json["user"]["email"] == "viewer@example.com"
    assert "password" not in str(result.json)
    cookie = result.cookies["dpb_session"]
    assert cookie.http_only and cookie.same_site == "Lax" and cookie.path == "/api"
    assert not cookie.secure
    assert cookie.max_age == 12 * 3600
    me = env.client.simulate_get("/api/auth/me", cookies={"dpb_session": cookie.value})
    assert me.status_code == 200
    assert me.json == {"user": result.json["user"], "via": "session"}


def test_cookie_is_secure_when_configured(pg_url, schema):
    env = AdminEnv(pg_url, schema, cookie_secure=True, session_hours=1)
    try:
        result = env.client.simulate_post(
            "/api/auth/login",
            json={"email": "admin@example.com", "password": PASSWORD},
            headers=CSRF,
        )
        assert result.cookies["dpb_session"].secure
        assert result.cookies["dpb_session"].max_age == 3600
    finally:
        env.close()


@pytest.mark.parametrize(
    "body",
    [
        {"email": "admin@example.com", "password": "wrong password"},
        {"email": "nobody@example.com", "password": PASSWORD},
        {"email": "admin@example.com", "password": "x" * 100},
    ],
)
def test_wrong_login_is_401_without_saying_which_part_was_wrong(env, body):
    result = env.client.simulate_post("/api/auth/login", json=body, headers=CSRF)
    assert result.status_code == 401
    assert "email or the password is wrong" in result.json["message"]
    assert "dpb_session" not in result.cookies


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"email": "admin@example.com"}, "lacks the required field(s) password"),
        ({"email": 1, "password": PASSWORD}, "email must be a string"),
        ({"email": "a@b.c", "password": PASSWORD, "remember": True}, "unknown field"),
        ([], "must be a JSON object"),
    ],
)
def test_malformed_login_is_400(env, body, words):
    result = env.client.simulate_post("/api/auth/login", json=body, headers=CSRF)
    assert result.status_code == 400
    assert words in result.json["message"]


def test_a_too_long_password_costs_one_bcrypt_check_known_email_or_not(env, monkeypatch):
    # bcrypt refuses more than 72 bytes at once: without a full check for a known email,
    # a long password would answer instantly there and slowly for an unknown one, telling
    # which emails exist.
    checked = []
    real = accounts_module.bcrypt.checkpw

    def checkpw(password, hashed):
        checked.append(len(password))
        return real(password, hashed)

    monkeypatch.setattr(accounts_module.bcrypt, "checkpw", checkpw)
    for email in ("admin@example.com", "nobody@example.com"):
        checked.clear()
        assert env.accounts.authenticate(email, "x" * 100) is None
        assert checked == [72], email


def test_passwords_are_never_cut_at_72_bytes(env):
    # bcrypt reads only 72 bytes: a longer password that starts with the real one is refused
    # instead of being accepted by its first 72 bytes.
    password = "é" * 36  # 72 bytes in UTF-8
    env.accounts.create_user("long-password@example.com", password, "viewer")
    assert env.accounts.authenticate("long-password@example.com", password) is not None
    assert env.accounts.authenticate("long-password@example.com", password + "x") is None
    with pytest.raises(InvalidAccountData, match="at most 72 bytes"):
        env.accounts.create_user("longer@example.com", password + "x", "viewer")


@pytest.mark.parametrize("address", ["İnci@Example.com", "ÅSA@EXAMPLE.COM", "Ωmega@example.com"])
def test_unicode_emails_log_in_whatever_their_case(env, address):
    # Stored lower-cased by Python; PostgreSQL's lower() follows the database's collation
    # (ASCII only under C), so the lookup must not rely on it alone.
    user = env.accounts.create_user(address, PASSWORD, "viewer")
    for spelling in (address, address.lower(), address.upper()):
        result = env.client.simulate_post(
            "/api/auth/login", json={"email": spelling, "password": PASSWORD}, headers=CSRF
        )
        assert result.status_code == 200, (spelling, result.text)
        assert result.json["user"]["id"] == user.id
    assert env.accounts.find_user(address) == user


def test_login_ends_the_session_the_browser_already_had(env):
    before = env.login("viewer@example.com")
    result = env.client.simulate_post(
        "/api/auth/login",
        json={"email": "operator@example.com", "password": PASSWORD},
        cookies={"dpb_session": before},
        headers=CSRF,
    )
    assert result.status_code == 200
    after = result.cookies["dpb_session"].value
    assert after != before
    assert (
        env.client.simulate_get("/api/auth/me", cookies={"dpb_session": before}).status_code == 401
    )
    me = env.client.simulate_get("/api/auth/me", cookies={"dpb_session": after})
    assert me.json["user"]["email"] == "operator@example.com"


def test_deactivated_users_cannot_log_in_and_lose_sessions_and_tokens(env):
    user = env.accounts.create_user("leaving@example.com", PASSWORD, "operator")
    token = env.accounts.create_token(user.id, "script").secret
    session = env.login("leaving@example.com")
    assert env.client.simulate_get("/api/jobs", cookies={"dpb_session": session}).status_code == 200
    env.accounts.update_user(user.id, active=False)
    assert env.client.simulate_get("/api/jobs", cookies={"dpb_session": session}).status_code == 401
    bearer = {"Authorization": f"Bearer {token}"}
    assert env.client.simulate_get("/api/jobs", headers=bearer).status_code == 401
    result = env.client.simulate_post(
        "/api/auth/login", json={"email": "leaving@example.com", "password": PASSWORD}, headers=CSRF
    )
    assert result.status_code == 401


def test_logout_ends_the_session_on_the_server(env):
    session = env.login("operator@example.com")
    cookies = {"dpb_session": session}
    result = env.client.simulate_post("/api/auth/logout", cookies=cookies, headers=CSRF)
    assert result.status_code == 204
    assert result.cookies["dpb_session"].value == ""
    # The browser would drop the cookie; a stolen copy must not work either.
    assert env.client.simulate_get("/api/jobs", cookies=cookies).status_code == 401
    again = env.client.simulate_post("/api/auth/logout", cookies=cookies, headers=CSRF)
    assert again.status_code == 204


def test_sessions_expire(env, pg_url, schema):
    session = env.login("viewer@example.com")
    cookies = {"dpb_session": session}
    assert env.client.simulate_get("/api/jobs", cookies=cookies).status_code == 200
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "UPDATE {}.sessions SET expires_at = now() - interval '1 second' WHERE id_hash = %s"
            ).format(sql.Identifier(schema)),
            (hashlib.sha256(session.encode()).hexdigest(),),
        )
    result = env.client.simulate_get("/api/jobs", cookies=cookies)
    assert result.status_code == 401
    assert "expired" in result.json["message"]


def test_secrets_are_stored_only_as_hashes(env, pg_url, schema):
    session = env.login("admin@example.com")
    token = env.tokens["admin"]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        dump = " ".join(
            str(row)
            for table in ("users", "sessions", "api_tokens")
            for row in conn.execute(
                sql.SQL("SELECT * FROM {}.{}").format(sql.Identifier(schema), sql.Identifier(table))
            )
        )
    assert session not in dump and token not in dump and PASSWORD not in dump
    assert hashlib.sha256(session.encode()).hexdigest() in dump
    assert "$2b$" in dump  # bcrypt


def test_revoked_tokens_stop_working_and_use_is_recorded(env):
    new = env.accounts.create_token(env.users["viewer"].id, "to revoke")
    bearer = {"Authorization": f"Bearer {new.secret}"}
    assert env.client.simulate_get("/api/jobs", headers=bearer).status_code == 200
    [listed] = [t for t in env.accounts.list_tokens(env.users["viewer"].id) if t.id == new.token.id]
    assert listed.last_used_at is not None
    result = env.request("DELETE", f"/api/tokens/{new.token.id}", "admin")
    assert result.status_code == 204
    assert env.client.simulate_get("/api/jobs", headers=bearer).status_code == 401


class TestCrossSite:
    """Cookie-authenticated state changes need X-Requested-With and an allowed origin."""

    def test_cookie_post_without_the_header_is_refused(self, env):
        cookies = {"dpb_session": env.login("operator@example.com")}
        result = env.client.simulate_post(
            "/api/jobs", json={"actor_name": "tests.noop"}, cookies=cookies
        )
        assert result.status_code == 403
        assert "X-Requested-With" in result.json["message"]

    def test_cookie_post_with_the_header_is_accepted(self, env):
        cookies = {"dpb_session": env.login("operator@example.com")}
        result = env.client.simulate_post(
            "/api/jobs", json={"actor_name": "tests.noop"}, cookies=cookies, headers=CSRF
        )
        assert result.status_code == 201, result.text

    @pytest.mark.parametrize(
        ("origin", "status"),
        [
            ("https://evil.example", 403),
            ("null", 403),
            ("https://ops.example.com", 201),
            ("http://falconframework.org", 201),  # the test client's own origin
            ("http://falconframework.org:80", 201),
            ("HTTP://FalconFramework.org", 201),
            # Same host, another scheme or port: another origin.
            ("https://falconframework.org", 403),
            ("http://falconframework.org:8080", 403),
            ("http://ops.example.com", 403),
            ("https://ops.example.com:444", 403),
            ("https://ops.example.com.evil.example", 403),
            ("http://falconframework.org/path", 403),
        ],
    )
    def test_origin_must_be_the_api_or_an_allowed_origin(self, env, origin, status):
        cookies = {"dpb_session": env.login("operator@example.com")}
        result = env.client.simulate_post(
            "/api/jobs",
            json={"actor_name": "tests.noop"},
            cookies=cookies,
            headers={**CSRF, "Origin": origin},
        )
        assert result.status_code == status, result.text

    def test_login_itself_needs_the_header(self, env):
        result = env.client.simulate_post(
            "/api/auth/login", json={"email": "admin@example.com", "password": PASSWORD}
        )
        assert result.status_code == 403

    def test_bearer_requests_need_no_header(self, env):
        result = env.post(
            "/api/jobs",
            "operator",
            json={"actor_name": "tests.noop"},
            headers={"Origin": "https://evil.example"},
        )
        assert result.status_code == 201

    def test_reads_need_no_header(self, env):
        cookies = {"dpb_session": env.login("viewer@example.com")}
        assert env.client.simulate_get("/api/jobs", cookies=cookies).status_code == 200

    def test_cors_preflight_allows_only_configured_origins(self, env):
        allowed = env.client.simulate_options(
            "/api/jobs",
            headers={
                "Origin": "https://ops.example.com",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "x-requested-with, content-type",
            },
        )
        assert allowed.headers["access-control-allow-origin"] == "https://ops.example.com"
        assert allowed.headers["access-control-allow-credentials"] == "true"
        refused = env.client.simulate_options(
            "/api/jobs",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in refused.headers
