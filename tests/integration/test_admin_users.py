"""User and token management: the admin API's endpoints, the account store and the CLI."""

from __future__ import annotations

import io
import threading
import uuid

import psycopg
import pytest
from psycopg import sql

from admin_api.accounts import EmailTaken, InvalidAccountData, LastAdmin
from dramatiq_pg_broker import cli
from dramatiq_pg_broker.migrate import migrate

from .admin_support import CSRF, PASSWORD, AdminEnv


def email() -> str:
    return f"u{uuid.uuid4().hex[:10]}@example.com"


def test_admins_create_list_and_update_users(env):
    address = email()
    created = env.post(
        "/api/users", json={"email": address.upper(), "password": PASSWORD, "role": "viewer"}
    )
    assert created.status_code == 201, created.text
    user = created.json
    assert user["email"] == address and user["role"] == "viewer" and user["active"] is True
    assert set(user) == {"id", "email", "role", "active", "created_at"}
    listed = env.get("/api/users").json
    assert address in [u["email"] for u in listed["results"]]
    assert listed["count"] == len(listed["results"])
    assert env.get(f"/api/users/{user['id']}").json == user

    promoted = env.request("PATCH", f"/api/users/{user['id']}", json={"role": "operator"})
    assert promoted.status_code == 200 and promoted.json["role"] == "operator"
    session = env.login(address)
    changed = env.request("PATCH", f"/api/users/{user['id']}", json={"password": "a new password"})
    assert changed.status_code == 200
    # A password change ends the user's sessions; the new password works.
    assert env.client.simulate_get("/api/jobs", cookies={"dpb_session": session}).status_code == 401
    env.login(address, "a new password")
    off = env.request("PATCH", f"/api/users/{user['id']}", json={"active": False})
    assert off.json["active"] is False


def test_duplicate_emails_are_409_whatever_their_case(env):
    address = email()
    body = {"email": address, "password": PASSWORD, "role": "viewer"}
    assert env.post("/api/users", json=body).status_code == 201
    again = env.post("/api/users", json={**body, "email": address.title()})
    assert again.status_code == 409
    assert "already exists" in again.json["message"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"email": "not-an-email", "password": PASSWORD, "role": "viewer"}, "email must be"),
        ({"email": "a@b.c", "password": "short", "role": "viewer"}, "at least 8 characters"),
        ({"email": "a@b.c", "password": "é" * 40, "role": "viewer"}, "at most 72 bytes"),
        ({"email": "a@b.c", "password": PASSWORD, "role": "root"}, "role must be one of"),
        ({"email": "a@b.c", "password": PASSWORD}, "lacks the required field(s) role"),
        ({"email": "a@b.c", "password": PASSWORD, "role": "viewer", "x": 1}, "unknown field"),
        (
            {"email": "a@b.c", "password": PASSWORD, "role": "viewer", "active": "yes"},
            "true or false",
        ),
    ],
)
def test_bad_user_input_is_400(env, body, words):
    result = env.post("/api/users", json=body)
    assert result.status_code == 400, result.text
    assert words in result.json["message"]


def test_user_update_errors(env):
    assert env.request("PATCH", "/api/users/99999999", json={"active": True}).status_code == 404
    assert env.get("/api/users/99999999").status_code == 404
    assert env.get("/api/users/abc").status_code == 400
    assert env.get("/api/users/-1").status_code == 400
    empty = env.request("PATCH", f"/api/users/{env.users['viewer'].id}", json={})
    assert empty.status_code == 400 and "at least one" in empty.json["message"]


def test_the_last_active_admin_cannot_be_demoted_or_deactivated(pg_url, schema):
    env = AdminEnv(pg_url, schema)
    try:
        admins = [u for u in env.accounts.list_users() if u.role == "admin" and u.active]
        keep, *others = admins
        for other in others:
            env.accounts.update_user(other.id, role="viewer")
        token = env.accounts.create_token(keep.id, "last").secret
        bearer = {"Authorization": f"Bearer {token}"}
        result = env.client.simulate_patch(
            f"/api/users/{keep.id}", json={"active": False}, headers=bearer
        )
        assert result.status_code == 409
        assert "last active admin" in result.json["message"]
        with pytest.raises(LastAdmin):
            env.accounts.update_user(keep.id, role="operator")
        for other in others:
            env.accounts.update_user(other.id, role="admin")
    finally:
        env.close()


def test_two_admins_demoted_at_once_leave_one_admin(pg_url, empty_schema):
    migrate(pg_url, empty_schema)
    env = AdminEnv(pg_url, empty_schema)
    try:
        first = env.users["admin"]
        second = env.accounts.create_user(email(), PASSWORD, "admin")
        outcome: list[object] = []

        def demote_second():
            try:
                outcome.append(env.accounts.update_user(second.id, role="viewer"))
            except LastAdmin as e:
                outcome.append(e)

        with psycopg.connect(pg_url) as other:
            # Another request demotes the first admin and has not committed yet.
            other.execute(
                sql.SQL("UPDATE {}.users SET role = 'viewer' WHERE id = %s").format(
                    sql.Identifier(empty_schema)
                ),
                (first.id,),
            )
            thread = threading.Thread(target=demote_second)
            thread.start()
            thread.join(1.0)
            assert thread.is_alive(), f"the second demotion did not wait: {outcome}"
            other.commit()
        thread.join(10)
        assert not thread.is_alive(), "the second demotion is still waiting after 10 s"
        assert len(outcome) == 1 and isinstance(outcome[0], LastAdmin), outcome
        assert env.accounts.get_user(second.id).role == "admin"
    finally:
        env.close()


def test_tokens_through_the_api(env):
    user = env.users["operator"].id
    created = env.post(f"/api/users/{user}/tokens", json={"name": "  deploy bot "})
    assert created.status_code == 201
    token = created.json
    assert token["name"] == "deploy bot" and token["token"].startswith("dpb_")
    bearer = {"Authorization": f"Bearer {token['token']}"}
    me = env.client.simulate_get("/api/auth/me", headers=bearer).json
    assert me["user"]["email"] == "operator@example.com" and me["via"] == "token"
    listed = env.get(f"/api/users/{user}/tokens").json["results"]
    assert token["id"] in [t["id"] for t in listed]
    assert all("token" not in t for t in listed)
    assert env.request("DELETE", f"/api/tokens/{token['id']}").status_code == 204
    assert env.client.simulate_get("/api/auth/me", headers=bearer).status_code == 401
    assert env.request("DELETE", "/api/tokens/99999999").status_code == 404
    assert env.post("/api/users/99999999/tokens", json={"name": "x"}).status_code == 404
    assert env.post(f"/api/users/{user}/tokens", json={"name": " "}).status_code == 400


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_password_change_revokes_the_users_tokens(env):
    user = env.accounts.create_user(email(), PASSWORD, "operator")
    secret = env.accounts.create_token(user.id, "script").secret
    assert env.client.simulate_get("/api/auth/me", headers=_bearer(secret)).status_code == 200
    changed = env.request("PATCH", f"/api/users/{user.id}", json={"password": "a new password"})
    assert changed.status_code == 200
    assert env.client.simulate_get("/api/auth/me", headers=_bearer(secret)).status_code == 401
    assert [t.revoked for t in env.accounts.list_tokens(user.id)] == [True]


def test_reactivating_a_user_brings_no_token_back(env):
    user = env.accounts.create_user(email(), PASSWORD, "viewer")
    secret = env.accounts.create_token(user.id, "script").secret
    assert env.request("PATCH", f"/api/users/{user.id}", json={"active": False}).status_code == 200
    assert env.request("PATCH", f"/api/users/{user.id}", json={"active": True}).status_code == 200
    assert env.client.simulate_get("/api/auth/me", headers=_bearer(secret)).status_code == 401
    # A role change alone keeps the tokens.
    fresh = env.accounts.create_token(user.id, "after").secret
    assert (
        env.request("PATCH", f"/api/users/{user.id}", json={"role": "operator"}).status_code == 200
    )
    assert env.client.simulate_get("/api/auth/me", headers=_bearer(fresh)).status_code == 200


def test_account_store_rules(env):
    with pytest.raises(InvalidAccountData):
        env.accounts.create_user("x@y.z", PASSWORD, "superuser")
    address = email()
    env.accounts.create_user(address, PASSWORD, "member")
    with pytest.raises(EmailTaken):
        env.accounts.create_user(address.upper(), PASSWORD, "member")
    assert env.accounts.authenticate(address.upper(), PASSWORD).email == address
    assert env.accounts.authenticate(address, "wrong password") is None
    assert env.accounts.authenticate("nobody@x.y", PASSWORD) is None
    assert env.accounts.authenticate(address, "\x00" * 100) is None


class TestCli:
    """``dramatiq-pg-broker user ...`` and ``token ...``, as the demo runner calls them."""

    def run(self, pg_url, schema, *args, stdin=None, monkeypatch=None):
        if stdin is not None:
            monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        return cli.main(["--url", pg_url, "--schema", schema, *args])

    def test_user_create_list_and_token_create(self, env, pg_url, schema, capsys, monkeypatch):
        address = email()
        code = self.run(
            pg_url, schema, "user", "create", "--email", address, "--role", "admin",
            "--password", PASSWORD,
        )  # fmt: skip
        assert code == 0
        assert f"created user {address}" in capsys.readouterr().out
        again = self.run(
            pg_url, schema, "user", "create", "--email", address, "--role", "viewer",
            "--password", "other password", "--exists-ok",
        )  # fmt: skip
        assert again == 0 and "already exists" in capsys.readouterr().out
        assert env.accounts.find_user(address).role == "admin"  # unchanged
        duplicate = self.run(
            pg_url, schema, "user", "create", "--email", address, "--role", "admin",
            "--password", PASSWORD,
        )  # fmt: skip
        assert duplicate == 2 and "already exists" in capsys.readouterr().err

        assert self.run(pg_url, schema, "user", "list") == 0
        assert address in capsys.readouterr().out

        assert self.run(pg_url, schema, "token", "create", "--email", address, "--name", "ci") == 0
        captured = capsys.readouterr()
        secret = captured.out.strip()
        assert secret.startswith("dpb_") and "shown only this once" in captured.err
        me = env.client.simulate_get("/api/auth/me", headers={"Authorization": f"Bearer {secret}"})
        assert me.json["user"]["email"] == address

    def test_password_from_stdin(self, env, pg_url, schema, capsys, monkeypatch):
        address = email()
        code = self.run(
            pg_url, schema, "user", "create", "--email", address, "--role", "viewer",
            "--password-stdin", stdin="from stdin pw\n", monkeypatch=monkeypatch,
        )  # fmt: skip
        assert code == 0
        result = env.client.simulate_post(
            "/api/auth/login", json={"email": address, "password": "from stdin pw"}, headers=CSRF
        )
        assert result.status_code == 200

    def test_errors_are_sentences(self, pg_url, schema, capsys):
        bad = self.run(
            pg_url, schema, "user", "create", "--email", email(), "--role", "viewer",
            "--password", "short",
        )  # fmt: skip
        assert bad == 2 and "at least 8 characters" in capsys.readouterr().err
        missing = self.run(pg_url, schema, "token", "create", "--email", email(), "--name", "x")
        assert missing == 2 and "no user with email" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            self.run(pg_url, schema, "user", "create", "--email", "a@b.c", "--role", "root")

    def test_deactivate_set_password_and_tokens(self, env, pg_url, schema, capsys, monkeypatch):
        address = email()
        user = env.accounts.create_user(address, PASSWORD, "operator")
        first = env.accounts.create_token(user.id, "first")
        second = env.accounts.create_token(user.id, "second")

        assert self.run(pg_url, schema, "token", "list", "--email", address) == 0
        out = capsys.readouterr().out
        assert "first" in out and "second" in out and "dpb_" not in out
        assert self.run(pg_url, schema, "token", "revoke", "--id", str(first.token.id)) == 0
        assert "revoked token" in capsys.readouterr().out
        assert env.accounts.token_user(first.secret) is None
        assert env.accounts.token_user(second.secret).email == address
        assert self.run(pg_url, schema, "token", "revoke", "--id", "99999999") == 2
        assert "no API token" in capsys.readouterr().err

        session = env.login(address)
        code = self.run(
            pg_url, schema, "user", "set-password", "--email", address, "--password-stdin",
            stdin="reset password\n", monkeypatch=monkeypatch,
        )  # fmt: skip
        assert code == 0 and "tokens are revoked" in capsys.readouterr().out
        assert env.accounts.token_user(second.secret) is None
        assert env.accounts.session_user(session) is None
        assert env.accounts.authenticate(address, "reset password").email == address

        third = env.accounts.create_token(user.id, "third")
        assert self.run(pg_url, schema, "user", "deactivate", "--email", address) == 0
        assert "deactivated" in capsys.readouterr().out
        assert env.accounts.authenticate(address, "reset password") is None
        assert self.run(pg_url, schema, "user", "activate", "--email", address) == 0
        capsys.readouterr()
        assert env.accounts.token_user(third.secret) is None
        assert env.accounts.authenticate(address, "reset password").email == address
        assert self.run(pg_url, schema, "user", "deactivate", "--email", email()) == 2
        assert "no user with email" in capsys.readouterr().err

    def test_unmigrated_schema_says_to_migrate(self, pg_url, capsys):
        code = cli.main(["--url", pg_url, "--schema", "not_migrated_here", "user", "list"])
        assert code == 2 and "migrate" in capsys.readouterr().err
