"""The authorization matrix: every operation of the OpenAPI document, called with every kind
of credential, is allowed exactly for the roles the table below names, refused with 401
for every credential that is not valid, and with 403 for a valid one of the wrong role."""

from __future__ import annotations

import datetime as dt
import secrets

from psycopg import sql

from admin_api import openapi
from admin_api.accounts import hash_secret

from .admin_support import CSRF, PASSWORD, AdminEnv, Walk

ANY = frozenset({"viewer", "operator", "admin", "member"})
OBSERVERS = frozenset({"viewer", "operator", "admin"})
CREATORS = frozenset({"operator", "admin", "member"})
OPERATORS = frozenset({"operator", "admin"})
ADMINS = frozenset({"admin"})
PUBLIC = None

#: Who may call each operation; PUBLIC needs no credentials. A new operation in the
#: document without a line here fails the test.
EXPECTED = {
    ("get", "/api/health"): PUBLIC,
    ("get", "/api/health/findings"): OBSERVERS,
    ("get", "/api/docs"): PUBLIC,
    ("post", "/api/auth/login"): PUBLIC,
    ("post", "/api/auth/logout"): PUBLIC,
    ("get", "/api/openapi.json"): ANY,
    ("get", "/api/config"): OBSERVERS,
    ("get", "/api/auth/me"): ANY,
    ("get", "/api/jobs"): ANY,
    ("post", "/api/jobs"): CREATORS,
    ("get", "/api/jobs/{job_id}"): ANY,
    ("get", "/api/jobs/{job_id}/events"): ANY,
    ("get", "/api/job-events"): ANY,
    ("get", "/api/jobs/stats"): OBSERVERS,
    ("get", "/api/schedules"): OBSERVERS,
    ("get", "/api/queues"): OBSERVERS,
    ("get", "/api/throughput"): OBSERVERS,
    ("post", "/api/jobs/{job_id}/retry"): OPERATORS,
    ("post", "/api/jobs/{job_id}/cancel"): OPERATORS,
    ("post", "/api/jobs/{job_id}/abort"): OPERATORS,
    ("post", "/api/jobs/{job_id}/requeue"): OPERATORS,
    ("get", "/api/queues/{queue_name}"): OBSERVERS,
    ("post", "/api/queues/{queue_name}/requeue-expired"): OPERATORS,
    ("post", "/api/queues/{queue_name}/pause"): OPERATORS,
    ("post", "/api/queues/{queue_name}/resume"): OPERATORS,
    ("put", "/api/queues/{queue_name}/limit"): OPERATORS,
    ("get", "/api/workflows"): ANY,
    ("get", "/api/workflows/{workflow_id}"): ANY,
    ("post", "/api/workflows/{workflow_id}/abort"): OPERATORS,
    ("post", "/api/workflows/{workflow_id}/retry"): OPERATORS,
    ("get", "/api/workers"): OBSERVERS,
    ("get", "/api/actors"): ANY,
    ("get", "/api/users"): ADMINS,
    ("post", "/api/users"): ADMINS,
    ("get", "/api/users/{user_id}"): ADMINS,
    ("patch", "/api/users/{user_id}"): ADMINS,
    ("get", "/api/users/{user_id}/tokens"): ADMINS,
    ("post", "/api/users/{user_id}/tokens"): ADMINS,
    ("delete", "/api/tokens/{token_id}"): ADMINS,
}


class Credentials:
    """Every kind of credential, each made fresh when used (a logout ends a session)."""

    def __init__(self, env: AdminEnv) -> None:
        self.env = env
        store = env.accounts
        revoked = store.create_token(env.users["admin"].id, "revoked")
        store.revoke_token(revoked.token.id)
        self.revoked_token = revoked.secret
        gone = store.create_user(f"gone-{secrets.token_hex(4)}@example.com", PASSWORD, "admin")
        self.gone_token = store.create_token(gone.id, "gone").secret
        self.gone_session = store.create_session(gone.id, 1)
        store.update_user(gone.id, active=False)
        self.expired_session = secrets.token_urlsafe(32)
        with env.pool.connection() as conn:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.sessions (id_hash, user_id, expires_at) VALUES (%s, %s, %s)"
                ).format(sql.Identifier(env.settings.schema)),
                (
                    hash_secret(self.expired_session),
                    env.users["admin"].id,
                    dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1),
                ),
            )

    def kinds(self) -> list[tuple[str, str | None]]:
        """(label, the role it carries, or None for an invalid credential)."""
        kinds: list[tuple[str, str | None]] = [
            ("nothing", None),
            ("a malformed Authorization header", None),
            ("an unknown token", None),
            ("a revoked token", None),
            ("a deactivated admin's token", None),
            ("a deactivated admin's session", None),
            ("an expired admin session", None),
            ("a forged session cookie", None),
        ]
        for role in sorted(ANY):
            kinds += [(f"{role} token", role), (f"{role} session", role)]
        return kinds

    def headers(self, label: str) -> dict[str, str]:
        env = self.env
        cookie = None
        headers = dict(CSRF)
        if label == "a malformed Authorization header":
            headers["Authorization"] = "Basic YWRtaW46YWRtaW4="
        elif label == "an unknown token":
            headers["Authorization"] = "Bearer dpb_" + secrets.token_urlsafe(32)
        elif label == "a revoked token":
            headers["Authorization"] = f"Bearer {self.revoked_token}"
        elif label == "a deactivated admin's token":
            headers["Authorization"] = f"Bearer {self.gone_token}"
        elif label == "a deactivated admin's session":
            cookie = self.gone_session
        elif label == "an expired admin session":
            cookie = self.expired_session
        elif label == "a forged session cookie":
            cookie = secrets.token_urlsafe(32)
        elif label.endswith(" token"):
            headers["Authorization"] = f"Bearer {env.tokens[label.split()[0]]}"
        elif label.endswith(" session"):
            role = label.split()[0]
            cookie = env.accounts.create_session(env.users[role].id, 1)
        if cookie is not None:
            headers["Cookie"] = f"dpb_session={cookie}"
        return headers


def test_every_operation_times_every_kind_of_credential(env):
    document = openapi.build()
    operations = {(method, path) for path, ops in document["paths"].items() for method in ops}
    assert operations == set(EXPECTED), (
        f"operations without an expected row: {operations - set(EXPECTED)}; "
        f"rows without an operation: {set(EXPECTED) - operations}"
    )
    credentials = Credentials(env)
    walk = Walk(env)
    mismatches = []
    calls = 0
    for (method, template), allowed in sorted(EXPECTED.items()):
        op = document["paths"][template][method]
        for label, role in credentials.kinds():
            kwargs = {}
            body = Walk.BODIES.get((method, template))
            if body is not None:
                kwargs["json"] = body()
            result = env.client.simulate_request(
                method.upper(),
                walk.path(method, template),
                headers=credentials.headers(label),
                **kwargs,
            )
            calls += 1
            status = result.status_code
            if allowed is PUBLIC:
                ok = status not in (401, 403)
            elif role is None:
                ok = status == 401
            elif role in allowed:
                ok = status not in (401, 403) and status < 500
            else:
                ok = status == 403
            if not ok:
                mismatches.append(f"{method.upper()} {template} with {label}: {status}")
            assert str(status) in op["responses"] or status == 404, (
                f"{method.upper()} {template} with {label}: {status} is not documented"
            )
    assert not mismatches, "\n".join(mismatches)
    assert calls == len(EXPECTED) * len(credentials.kinds())
