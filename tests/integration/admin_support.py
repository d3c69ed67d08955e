"""Helpers for the admin API tests: an app on a test schema with one user (and token) per
role, and shortcuts to put jobs into each state through the real state machine."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import jsonschema
from falcon import testing

from admin_api import create_app
from admin_api.accounts import ROLES, AccountStore
from admin_api.app import create_engine
from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.jobs import Attempt, JobStore, NewJob

PASSWORD = "correct horse battery"
CSRF = {"X-Requested-With": "tests"}

_queues = itertools.count(1)


class AdminEnv:
    """The admin API on ``schema``, a client, and one active user per role.

    Most tests create jobs for actors no worker runs, so ad-hoc actors are allowed unless a
    test turns them off (``admin_adhoc_actors=False``, the default of a deployment; the
    tests of the actor check do, see :meth:`declare`).

    Parameters:
      url(str), schema(str): the test database and schema (already migrated).
      **settings: other :class:`Settings` fields (cookie_secure, cors_origins ...).
    """

    def __init__(self, url: str, schema: str, **settings: Any) -> None:
        settings.setdefault("admin_adhoc_actors", True)
        self.settings = Settings(url=url, schema=schema, **settings)
        self.pool = ProcessPool(self.settings)
        self.store = JobStore(self.pool, schema)
        self.accounts = AccountStore(self.pool, schema, bcrypt_rounds=4)
        self.engine = create_engine(url, self.settings)
        self.app = create_app(
            self.settings, store=self.store, accounts=self.accounts, engine=self.engine
        )
        self.users = {}
        self.tokens = {}
        tag = uuid.uuid4().hex[:6]
        for role in ROLES:
            user = self.accounts.find_user(f"{role}@example.com")
            if user is None:
                user = self.accounts.create_user(f"{role}@example.com", PASSWORD, role)
            self.users[role] = user
            self.tokens[role] = self.accounts.create_token(user.id, f"tests {tag}").secret
        self.client = CheckedClient(self.app, self.auth("viewer"))

    def close(self) -> None:
        self.engine.dispose()
        self.pool.close()

    # -- requests ------------------------------------------------------------------------

    def auth(self, role: str | None) -> dict[str, str]:
        return {} if role is None else {"Authorization": f"Bearer {self.tokens[role]}"}

    def request(self, method: str, path: str, role: str | None = "admin", **kwargs):
        headers = {**self.auth(role), **kwargs.pop("headers", {})}
        return self.client.simulate_request(method, path, headers=headers, **kwargs)

    def get(self, path: str, role: str | None = "admin", **kwargs):
        return self.request("GET", path, role, **kwargs)

    def post(self, path: str, role: str | None = "admin", **kwargs):
        return self.request("POST", path, role, **kwargs)

    def walk(self, path: str, role: str = "admin") -> tuple[list[Any], list[Any], dict]:
        """Every item id of a paged list from ``path``, following its next links; the same
        collected again from the last page back by its previous links (in the list's
        order: equal to the first when the links agree); and the first page."""
        first = self.get(path, role)
        assert first.status_code == 200, first.text
        page, forward = first.json, []
        while True:
            forward += [item["id"] for item in page["results"]]
            if page["next"] is None:
                break
            page = self.get(page["next"], role).json
        backward = [item["id"] for item in page["results"]]
        while page["previous"] is not None:
            page = self.get(page["previous"], role).json
            backward = [item["id"] for item in page["results"]] + backward
        return forward, backward, first.json

    def login(self, email: str, password: str = PASSWORD) -> str:
        """Log in and return the session cookie's value."""
        result = self.client.simulate_post(
            "/api/auth/login", json={"email": email, "password": password}, headers=CSRF
        )
        assert result.status_code == 200, result.text
        return result.cookies["dpb_session"].value

    def create_job(self, role: str = "operator", **body: Any) -> dict[str, Any]:
        body.setdefault("actor_name", "tests.noop")
        result = self.post("/api/jobs", role, json=body)
        assert result.status_code in (200, 201), result.text
        return result.json

    def declare(self, actors: dict[str, str] | None = None, queues: Any = ()) -> None:
        """Declare actors (name: queue) and queues as a booting worker does."""
        from dramatiq_pg_broker.control.queues import declare

        actors = actors or {}
        with self.pool.connection() as conn:
            declare(conn, self.settings.schema, [*actors.values(), *queues])
            if actors:
                conn.execute(
                    f'INSERT INTO "{self.settings.schema}".actors (actor_name, queue_name) '
                    "SELECT * FROM unnest(%s::text[], %s::text[]) ON CONFLICT DO NOTHING",
                    (list(actors), list(actors.values())),
                )

    # -- jobs in each state, through the state machine -------------------------------------

    def workflow(self, *, cancelled: bool = False, created_by: str | None = None) -> str:
        """A workflow of one step (its job queued), cancelled when asked; its id."""
        import dramatiq

        from dramatiq_pg_broker.sending import messages
        from dramatiq_pg_broker.workflows.building import NODE_OPTION, Node
        from dramatiq_pg_broker.workflows.store import WorkflowStore

        store = WorkflowStore(self.pool, self.settings.schema)
        node_id = str(uuid.uuid4())
        message = dramatiq.Message("walk", "tests.noop", (), {}, {NODE_OPTION: node_id})
        stored = messages.encode(message)
        job = NewJob(
            message.message_id,
            "walk",
            "tests.noop",
            message=stored.view,
            message_bytes=stored.data,
            max_attempts=1,
        )
        workflow_id = str(uuid.uuid4())
        node = Node(node_id, message, 0, 0, [], None)
        store.create(workflow_id, [(node, job)], 1, name="walk", created_by=created_by)
        if cancelled:
            store.abort(workflow_id, self.store, by="tests")
        return workflow_id

    def enqueue(self, actor: str = "tests.noop", queue: str | None = None, **fields: Any) -> str:
        """A queued job, through the state machine; its queue is declared (as a worker of
        the queue would have done)."""
        queue = queue or f"q{next(_queues)}"
        self.declare(queues=[queue])
        job_id = str(uuid.uuid4())
        message = {
            "queue_name": queue,
            "actor_name": actor,
            "args": [],
            "kwargs": {},
            "options": {},
            "message_id": job_id,
            "message_timestamp": 0,
        }
        fields.setdefault("max_attempts", self.settings.max_attempts)
        job = NewJob(
            id=job_id,
            queue_name=queue,
            actor_name=actor,
            message=message,
            **{"max_attempts": 21, **fields},
        )
        assert self.store.enqueue(job).created
        return job_id

    def claim(self, job_id: str, lease_seconds: float = 60) -> Attempt:
        queue = self.store.get(job_id)["queue_name"]
        claimed = self.store.claim(queue, 1, "tests-worker", lease_seconds)
        assert [c.id for c in claimed] == [job_id], "use one queue per job to claim it"
        return Attempt(job_id, "tests-worker", claimed[0].attempts)

    def running(self, **kwargs: Any) -> str:
        job_id = self.enqueue(**kwargs)
        self.claim(job_id)
        return job_id

    def lease_expired(self, **kwargs: Any) -> str:
        """A job whose worker stopped renewing its lease (claimed for a millisecond)."""
        job_id = self.enqueue(**kwargs)
        self.claim(job_id, lease_seconds=0.001)
        time.sleep(0.002)
        return job_id

    def failed(self, **kwargs: Any) -> str:
        job_id = self.enqueue(**kwargs)
        assert self.store.fail([self.claim(job_id)], ["boom"]) == {job_id}
        return job_id

    def succeeded(self, **kwargs: Any) -> str:
        job_id = self.enqueue(**kwargs)
        assert self.store.complete([self.claim(job_id)]) == {job_id}
        return job_id


class CheckedClient(testing.TestClient):
    """A test client that checks every answer of the app against the OpenAPI document the
    app serves (read once, with ``auth``): the status is one the operation documents, and a
    JSON body matches the documented schema, with no field the document does not list. An
    answer outside the document's operations (a page, /metrics, an unknown route, a 405)
    that is an error has the error shape."""

    def __init__(self, app, auth: dict[str, str]) -> None:
        super().__init__(app)
        served = super().simulate_request("GET", "/api/openapi.json", headers=auth)
        assert served.status_code == 200, served.text
        self.document = served.json
        #: (method, path pattern, operation), the fixed paths before those with values.
        self.operations = sorted(
            (
                (method, re.compile("^" + re.sub(r"{\w+}", "[^/]+", path) + "$"), op)
                for path, ops in self.document["paths"].items()
                for method, op in ops.items()
            ),
            key=lambda entry: entry[1].pattern.count("[^/]+"),
        )
        self.validators: dict[str, jsonschema.Draft202012Validator] = {}
        #: How many answers of the document's operations were checked.
        self.checked = 0

    def simulate_request(self, method: str = "GET", path: str = "/", *args, **kwargs):
        result = super().simulate_request(method, path, *args, **kwargs)
        self.check(method, path, result)
        return result

    def check(self, method: str, path: str, result) -> None:
        label = f"{method.upper()} {path}: {result.status_code}"
        # HEAD is GET without the body.
        method = "get" if method.upper() == "HEAD" else method.lower()
        path = urlsplit(path).path.rstrip("/") or "/"
        found = (op for m, pattern, op in self.operations if m == method and pattern.match(path))
        op = next(found, None)
        # A 500 is a bug, documented nowhere: the tests that cause one on purpose say so
        # (and the fuzz tests that no input causes one); it still has the error shape.
        if op is None or result.status_code == 500:
            # A page of the dashboard that does not exist is a page that says so (HTML).
            page = path.startswith("/dashboard/") and result.headers.get(
                "content-type", ""
            ).startswith("text/html")
            if result.status_code >= 400 and result.content and not page:
                self._validate(label, {"$ref": "#/components/schemas/Error"}, result.json)
            return
        status = str(result.status_code)
        assert status in op["responses"], f"{label} is not documented: {result.text[:300]}"
        self.checked += 1
        content = op["responses"][status].get("content", {}).get("application/json")
        if content is not None and result.content:
            self._validate(label, content["schema"], result.json)

    def _validate(self, label: str, schema: dict, body: Any) -> None:
        key = json.dumps(schema, sort_keys=True)
        if key not in self.validators:
            whole = {"allOf": [schema], "components": self.document["components"]}
            self.validators[key] = jsonschema.Draft202012Validator(strict(whole))
        errors = sorted(self.validators[key].iter_errors(body), key=str)
        assert not errors, f"{label}: the body does not match the document: {errors[0]}"


def strict(schema):
    """The schema with ``additionalProperties: false`` on every object that lists its
    properties, so that a field the document does not list fails the validation."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [strict(value) for value in schema]
    return schema


@dataclasses.dataclass
class Endpoint:
    method: str
    path: str
    roles: frozenset[str]
    body: Any = None


class Walk:
    """Concrete requests for the document's operations: fresh objects for each call, so
    that a retry finds a failed job and a revoke finds a token."""

    BODIES = {
        ("post", "/api/jobs"): lambda: {"actor_name": "tests.noop", "args": [1], "priority": 1},
        ("post", "/api/users"): lambda: {
            "email": f"walk-{uuid.uuid4().hex[:8]}@example.com",
            "password": PASSWORD,
            "role": "viewer",
        },
        ("patch", "/api/users/{user_id}"): lambda: {"active": True},
        ("post", "/api/users/{user_id}/tokens"): lambda: {"name": "walk"},
        ("post", "/api/auth/login"): lambda: {"email": "viewer@example.com", "password": PASSWORD},
        ("put", "/api/queues/{queue_name}/limit"): lambda: {"limit": 3},
        ("post", "/api/auth/logout"): dict,
        ("delete", "/api/tokens/{token_id}"): dict,
        **{
            ("post", f"/api/{path}"): dict
            for path in (
                "jobs/{job_id}/retry",
                "jobs/{job_id}/cancel",
                "jobs/{job_id}/abort",
                "jobs/{job_id}/requeue",
                "queues/{queue_name}/pause",
                "queues/{queue_name}/resume",
                "queues/{queue_name}/requeue-expired",
                "workflows/{workflow_id}/abort",
                "workflows/{workflow_id}/retry",
            )
        },
    }

    def __init__(self, env: AdminEnv) -> None:
        self.env = env

    def queue(self) -> str:
        """A queue a worker declared (pausing it does not touch another test's)."""
        name = f"walk_{uuid.uuid4().hex[:8]}"
        self.env.declare(queues=[name])
        return name

    def path(self, method: str, template: str) -> str:
        env = self.env
        job_id = {
            "/api/jobs/{job_id}/retry": env.failed,
            "/api/jobs/{job_id}/cancel": env.enqueue,
            "/api/jobs/{job_id}/requeue": env.lease_expired,
        }.get(template, lambda: env.create_job()["id"])
        values = {
            "{queue_name}": self.queue,
            "{job_id}": job_id,
            "{user_id}": lambda: str(env.users["viewer"].id),
            "{workflow_id}": lambda: env.workflow(cancelled=template.endswith("/retry")),
            "{token_id}": lambda: str(
                env.accounts.create_token(env.users["viewer"].id, "walk").token.id
            ),
        }
        for placeholder, make in values.items():
            if placeholder in template:
                template = template.replace(placeholder, make())
        return template

    def call(self, method: str, template: str, op, role, **kwargs):
        body = self.BODIES.get((method, template))
        if "requestBody" in op and "json" not in kwargs:
            assert body is not None, f"give a sample body for {method.upper()} {template}"
            kwargs["json"] = body()
        headers = {**self.env.auth(role), **CSRF}
        return self.env.client.simulate_request(
            method.upper(), self.path(method, template), headers=headers, **kwargs
        )
