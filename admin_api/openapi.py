"""The OpenAPI 3.1 document of the API, served at ``/api/openapi.json``.

Nothing here declares a body or a query parameter: request bodies are the
:class:`~admin_api.validation.Body` models the resources validate with, query parameters
their :class:`~admin_api.validation.Params` models, response bodies the models of
:mod:`admin_api.responses`; the JSON Schemas are generated from those classes
(:class:`Schemas`). What is written here is what no model says: the paths, the path and
header parameters, statuses and roles, and the authentication schemes. A test checks that
every route and method is documented and that real responses match their schemas.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from dramatiq_pg_broker import __version__

from . import responses
from .resources import dashboard as dashboard_resource
from .resources import events as events_resource
from .resources import jobs as jobs_resource
from .resources.jobs import ActionRequest, JobRequest
from .resources.queues import LimitRequest
from .resources.sessions import LoginRequest
from .resources.users import TokenRequest, UserRequest, UserUpdate
from .validation import MAX_BODY_BYTES

#: Where the component schemas are.
REF = "#/components/schemas/{model}"


class Schemas(GenerateJsonSchema):
    """pydantic's JSON Schemas, written as this document writes them: no titles (the
    property names say it), ``"type": [..., "null"]`` for a nullable value, no
    ``"default": null`` (absent means not given), no empty ``items``."""

    def field_title_should_be_set(self, schema) -> bool:
        return False

    def model_schema(self, schema):
        json_schema = super().model_schema(schema)
        json_schema.pop("title", None)
        return json_schema

    def default_schema(self, schema):
        json_schema = super().default_schema(schema)
        if "default" in json_schema and json_schema["default"] is None:
            del json_schema["default"]
        return json_schema

    def nullable_schema(self, schema):
        inner = self.generate_inner(schema["schema"])
        if isinstance(inner.get("type"), str):
            return {**inner, "type": [inner["type"], "null"]}
        return super().nullable_schema(schema)

    def list_schema(self, schema):
        json_schema = super().list_schema(schema)
        if json_schema.get("items") == {}:
            del json_schema["items"]
        return json_schema


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A request body's schema, inline (it is one operation's); ``required`` even when
    empty, so that a reader of the document need not guess."""
    schema = model.model_json_schema(ref_template=REF, schema_generator=Schemas)
    schema.setdefault("required", [])
    return schema


def _components() -> dict[str, Any]:
    """The schemas of every model of :mod:`admin_api.responses`, by class name."""
    models = [
        value
        for value in vars(responses).values()
        if isinstance(value, type) and issubclass(value, BaseModel) and value is not BaseModel
    ]
    _, top = models_json_schema(
        [(model, "serialization") for model in models], ref_template=REF, schema_generator=Schemas
    )
    return dict(sorted(top["$defs"].items()))


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _error(description: str) -> dict[str, Any]:
    return _json(responses.Error, description)


def _body(model: type[BaseModel]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": body_schema(model)}}}


def _optional_body(model: type[BaseModel]) -> dict[str, Any]:
    """The body of an action endpoint: none at all, or a JSON object of ``model`` (any
    other field is a 400, a body that is not JSON a 415)."""
    return {
        "required": False,
        "description": "Optional: send none, or an empty JSON object.",
        "content": {"application/json": {"schema": body_schema(model)}},
    }


def _query(model: type[BaseModel]) -> list[dict[str, Any]]:
    """The query parameters of an endpoint, from its :class:`~admin_api.validation.Params`."""
    properties = model.model_json_schema(schema_generator=Schemas)["properties"]
    return [
        _param(name, "query", schema, schema.pop("description", ""))
        for name, schema in properties.items()
    ]


def _param(name: str, where: str, schema: dict, description: str, required: bool = False):
    return {
        "name": name,
        "in": where,
        "required": required or where == "path",
        "schema": schema,
        "description": description,
    }


_IF_NONE_MATCH = _param(
    "If-None-Match",
    "header",
    {"type": "string"},
    "The ETag of an earlier answer: when the answer has not changed since, it is a 304 with "
    "no body (how the dashboard polls an unfinished job).",
)
_304 = {"description": "Not modified: the answer still has the ETag sent in If-None-Match."}
_ETAG = {
    "ETag": {
        "description": "A tag of this answer, to send back in If-None-Match.",
        "schema": {"type": "string"},
    }
}


def _tagged(response: dict[str, Any]) -> dict[str, Any]:
    return {**response, "headers": _ETAG}


_JOB_ID = _param("job_id", "path", {"type": "string", "format": "uuid"}, "The job's id.")
_USER_ID = _param("user_id", "path", {"type": "integer", "minimum": 0}, "The user's id.")
_TOKEN_ID = _param("token_id", "path", {"type": "integer", "minimum": 0}, "The token's id.")
_QUEUE_NAME = _param(
    "queue_name",
    "path",
    {"type": "string", "maxLength": 255, "pattern": jobs_resource.QUEUE_NAME_PATTERN},
    "The queue's name.",
)

_401 = _error("No credentials, or invalid ones.")
_403 = _error("The caller's role may not do this (or a cross-site request was refused).")
_400 = _error("Bad input; the message says what was wrong.")
_404 = _error("No such job (or, for a member, not one of theirs).")
_503 = _error(
    "The database is unavailable, or the query ran past the statement timeout "
    "(DRAMATIQ_PG_STATEMENT_TIMEOUT); Retry-After says when to try again."
)
_429 = _error(
    "Too many failed logins for this account or from this address, or too many password "
    "checks at once; Retry-After gives the seconds to wait."
)
_413 = _error(f"The body is larger than {MAX_BODY_BYTES} bytes.")
_415 = _error("The body is not JSON.")
_411 = _error("The body is chunked: send it with a Content-Length.")


def _with_body(op: dict[str, Any]) -> dict[str, Any]:
    """An operation that reads a JSON body may also answer 411, 413 and 415."""
    if "requestBody" in op:
        op["responses"].setdefault("411", _411)
        op["responses"].setdefault("413", _413)
        op["responses"].setdefault("415", _415)
    return op


def _protected(op: dict[str, Any], roles: str) -> dict[str, Any]:
    op["description"] = (op.get("description", "") + f"\n\nRoles: {roles}.").strip()
    op["responses"].setdefault("400", _400)
    op["responses"]["401"] = _401
    op["responses"]["403"] = _403
    op["responses"]["503"] = _503
    return _with_body(op)


_UNDECLARED = _error("No worker has declared this queue.")


def _tagged_get(
    summary: str, model: type[BaseModel], description: str, *, details: str | None = None
) -> dict[str, Any]:
    """A read of one job, with an ETag: 304 when If-None-Match still names it."""
    op: dict[str, Any] = {"summary": summary, **({"description": details} if details else {})}
    op |= {
        "parameters": [_JOB_ID, _IF_NONE_MATCH],
        "responses": {"200": _tagged(_json(model, description)), "304": _304, "404": _404},
    }
    return {"get": _protected(op, "any (members: their jobs)")}


def _action(
    param: dict[str, Any],
    summary: str,
    ok: tuple[type[BaseModel], str],
    errors: dict[str, Any],
    *,
    description: str = "",
) -> dict[str, Any]:
    """An operator's action on one job or queue: a POST whose body is optional."""
    op = {
        "summary": summary,
        "requestBody": _optional_body(ActionRequest),
        "parameters": [param],
        "responses": {"200": _json(*ok), **errors},
    }
    if description:
        op["description"] = description
    return {"post": _protected(op, "operator, admin")}


def _paths() -> dict[str, Any]:
    return {
        "/api/health": {
            "get": {
                "summary": "Is the database reachable? No credentials needed.",
                "security": [],
                "responses": {
                    "200": _json(responses.Health, "The database answers and is migrated."),
                    "503": _json(responses.Health, "It does not; detail says why."),
                },
            }
        },
        "/api/config": {
            "get": _protected(
                {
                    "summary": "The effective settings, without secrets.",
                    "responses": {"200": _json(responses.Settings, "The settings.")},
                },
                "any",
            )
        },
        "/api/jobs": {
            "get": _protected(
                {
                    "summary": "List jobs, newest first, with filters and keyset pages.",
                    "description": "Members see only the jobs they created. Follow next and "
                    "previous (cursor links) to page; offset serves the first "
                    f"{jobs_resource.MAX_OFFSET:,} jobs only.",
                    "parameters": _query(jobs_resource.JobListParams),
                    "responses": {"200": _json(responses.JobPage, "One page of jobs.")},
                },
                "any",
            ),
            "post": _protected(
                {
                    "summary": "Enqueue a message for an actor by name.",
                    "description": "The API needs no actor code: it stores the message a "
                    "worker of the queue will run. The actor must be one a worker declared "
                    "(GET /api/actors), and the job goes to its queue: another actor name, "
                    "or another queue_name, is a 400 (unless DRAMATIQ_PG_ADMIN_ADHOC_ACTORS "
                    "allows actors no worker declared).",
                    "requestBody": _body(JobRequest),
                    "responses": {
                        "201": _json(responses.Job, "The new job."),
                        "200": _json(
                            responses.Job, "The job that already had this idempotency key."
                        ),
                        "400": _error(
                            "Bad input, an actor no worker declared, or a queue that is not "
                            "the actor's."
                        ),
                        "409": _error("A member reused a key of a job they did not create."),
                    },
                },
                "operator, admin, member",
            ),
        },
        "/api/jobs/stats": {
            "get": _protected(
                {
                    "summary": "Counts by status and queue, expired leases, pending retries, "
                    "the oldest queued job.",
                    "responses": {"200": _json(responses.Stats, "The stats.")},
                },
                "viewer, operator, admin",
            )
        },
        "/api/schedules": {
            "get": _protected(
                {
                    "summary": "Periodic schedules: trigger, missed-tick policy, last tick, "
                    "next run (read-only).",
                    "responses": {
                        "200": _json(
                            responses.ScheduleList, "Every schedule the workers registered."
                        )
                    },
                },
                "viewer, operator, admin",
            )
        },
        "/api/jobs/{job_id}": _tagged_get(
            "One job.",
            responses.Job,
            "The job.",
            details="Its ETag is weak and leaves out locked_until: a running job's lease "
            "renewals alone answer 304 to If-None-Match. Ask without it for the current lease.",
        ),
        "/api/jobs/{job_id}/events": _tagged_get(
            "A job's timeline, oldest first.", responses.JobTimeline, "The events."
        ),
        "/api/jobs/{job_id}/retry": _action(
            _JOB_ID,
            "Move a failed job back to the queue; attempts start from zero.",
            (responses.Job, "The job, queued again."),
            {"404": _404, "409": _error("The job is not failed.")},
        ),
        "/api/jobs/{job_id}/cancel": _action(
            _JOB_ID,
            "Cancel a queued job.",
            (responses.Job, "The job, cancelled."),
            {"404": _404, "409": _error("The job is not queued.")},
        ),
        "/api/jobs/{job_id}/abort": _action(
            _JOB_ID,
            "Abort a job: a waiting one is cancelled at once; a running one is stopped by its "
            "worker and ends cancelled, never retried.",
            (responses.Job, "The job, cancelled or with the abort requested."),
            {
                "404": _404,
                "409": _error("The job has finished (succeeded, failed or cancelled)."),
            },
            description="For a running job the answer comes before the worker stops it: the "
            "job is still running, with abort_requested_at and abort_requested_by set; it ends "
            "cancelled within about a second, with an aborted event naming who asked.",
        ),
        "/api/queues/{queue_name}/pause": _action(
            _QUEUE_NAME,
            "Pause a queue: no worker on any host claims its jobs from now on; sends are still "
            "accepted; the pause survives worker restarts.",
            (responses.QueueState, "The queue, paused."),
            {"404": _UNDECLARED},
            description="Its workers give back the messages they prefetched and had not "
            "started; running jobs finish. Pausing a paused queue changes nothing.",
        ),
        "/api/queues/{queue_name}/resume": _action(
            _QUEUE_NAME,
            "Resume a paused queue: its workers claim its jobs at once.",
            (responses.QueueState, "The queue, active."),
            {"404": _UNDECLARED},
        ),
        "/api/queues/{queue_name}/limit": {
            "put": _protected(
                {
                    "summary": "Limit a queue: at most N of its jobs run at a time, across "
                    "every worker on every host; null lifts the limit.",
                    "description": "In force from the next claim of every worker; jobs "
                    "already running beyond a lowered limit finish. An operator's limit wins "
                    "over the queue_limits setting workers boot with. A job counts as "
                    "running from its claim until its outcome is written, or, if its worker "
                    "died, until the reaper takes it back.",
                    "requestBody": _body(LimitRequest),
                    "parameters": [_QUEUE_NAME],
                    "responses": {
                        "200": _json(responses.QueueLimit, "The queue's limit now."),
                        "404": _UNDECLARED,
                    },
                },
                "operator, admin",
            )
        },
        "/api/workers": {
            "get": _protected(
                {
                    "summary": "The live worker processes: host, pid, queues, actors, start, "
                    "last heartbeat, jobs in flight.",
                    "responses": {
                        "200": _json(responses.WorkerList, "The live workers, oldest first.")
                    },
                },
                "viewer, operator, admin",
            )
        },
        "/api/actors": {
            "get": _protected(
                {
                    "summary": "The actors workers declared, each with its queue: what "
                    "POST /api/jobs accepts.",
                    "responses": {
                        "200": _json(responses.ActorList, "The declared actors, by name.")
                    },
                },
                "any",
            )
        },
        "/api/job-events": {
            "get": _protected(
                {
                    "summary": "Every job's events, newest first, with cursor pages.",
                    "description": "Follow next/previous; a cursor is opaque.",
                    "parameters": _query(events_resource.FeedParams),
                    "responses": {"200": _json(responses.EventPage, "One page of events.")},
                },
                "any (members: events of their jobs)",
            )
        },
        "/api/auth/login": {
            "post": _with_body(
                {
                    "summary": "Log in: sets the session cookie dpb_session.",
                    "description": "Send the header X-Requested-With (any value).",
                    "security": [],
                    "requestBody": _body(LoginRequest),
                    "responses": {
                        "200": _json(responses.Login, "Logged in."),
                        "400": _400,
                        "401": _error("Wrong email or password, or a deactivated account."),
                        "403": _error("X-Requested-With missing, or an origin not allowed."),
                        "429": _429,
                        "503": _503,
                    },
                }
            )
        },
        "/api/auth/logout": {
            "post": {
                "summary": "Log out: ends the session on the server and clears the cookie.",
                "description": "Send the header X-Requested-With (any value).",
                "security": [],
                "responses": {
                    "204": {"description": "Logged out (also when no session was open)."},
                    "403": _error("X-Requested-With missing, or an origin not allowed."),
                },
            }
        },
        "/api/auth/me": {
            "get": _protected(
                {
                    "summary": "The caller's account.",
                    "responses": {"200": _json(responses.Caller, "The account.")},
                },
                "any",
            )
        },
        "/api/users": {
            "get": _protected(
                {
                    "summary": "Every user.",
                    "responses": {"200": _json(responses.UserList, "The users.")},
                },
                "admin",
            ),
            "post": _protected(
                {
                    "summary": "Create a user.",
                    "requestBody": _body(UserRequest),
                    "responses": {
                        "201": _json(responses.User, "The new user."),
                        "409": _error("The email is taken."),
                        "429": _error("Too many password hashes at once; Retry-After: 1."),
                    },
                },
                "admin",
            ),
        },
        "/api/users/{user_id}": {
            "get": _protected(
                {
                    "summary": "One user.",
                    "parameters": [_USER_ID],
                    "responses": {
                        "200": _json(responses.User, "The user."),
                        "404": _error("No such user."),
                    },
                },
                "admin",
            ),
            "patch": _protected(
                {
                    "summary": "Change a user's role, active flag or password.",
                    "parameters": [_USER_ID],
                    "requestBody": _body(UserUpdate),
                    "responses": {
                        "200": _json(responses.User, "The user."),
                        "404": _error("No such user."),
                        "409": _error("It would leave no active admin."),
                        "429": _error("Too many password hashes at once; Retry-After: 1."),
                    },
                },
                "admin",
            ),
        },
        "/api/users/{user_id}/tokens": {
            "get": _protected(
                {
                    "summary": "A user's API tokens (never their values).",
                    "parameters": [_USER_ID],
                    "responses": {
                        "200": _json(responses.TokenList, "The tokens."),
                        "404": _error("No such user."),
                    },
                },
                "admin",
            ),
            "post": _protected(
                {
                    "summary": "Create an API token; its value is in this response only.",
                    "parameters": [_USER_ID],
                    "requestBody": _body(TokenRequest),
                    "responses": {
                        "201": _json(responses.Token, "The token, with its value."),
                        "404": _error("No such user."),
                    },
                },
                "admin",
            ),
        },
        "/api/tokens/{token_id}": {
            "delete": _protected(
                {
                    "summary": "Revoke an API token.",
                    "parameters": [_TOKEN_ID],
                    "responses": {
                        "204": {"description": "Revoked."},
                        "404": _error("No such token."),
                    },
                },
                "admin",
            )
        },
        "/api/openapi.json": {
            "get": _protected(
                {
                    "summary": "This document.",
                    "responses": {"200": {"description": "The OpenAPI document."}},
                },
                "any",
            )
        },
        "/api/docs": {
            "get": {
                "summary": "A page that shows this document (it loads it after you log in).",
                "security": [],
                "responses": {"200": {"description": "HTML."}},
            }
        },
        **_monitoring_paths(),
    }


def _monitoring_paths() -> dict[str, Any]:
    """The endpoints the dashboard reads its overview from."""
    return {
        "/api/queues": {
            "get": _protected(
                {
                    "summary": "Per queue: queued, delayed, running and failed jobs, the age "
                    "of the oldest runnable job, whether it is paused and its limit. Every "
                    "declared queue is listed; another queue only while it has such jobs.",
                    "responses": {"200": _json(responses.QueueList, "The queues, by name.")},
                },
                "viewer, operator, admin",
            )
        },
        "/api/throughput": {
            "get": _protected(
                {
                    "summary": "Succeeded, failed and retried attempts per minute.",
                    "parameters": _query(dashboard_resource.ThroughputParams),
                    "responses": {
                        "200": _json(responses.Throughput, "One bucket per minute, oldest first.")
                    },
                },
                "viewer, operator, admin",
            )
        },
    }


def build() -> dict[str, Any]:
    """The OpenAPI document."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "dramatiq-pg-broker admin API",
            "version": __version__,
            "description": "See and steer the jobs of a dramatiq-pg-broker queue. Errors are "
            '{"error": code, "message": sentence}. State-changing requests authenticated by '
            "the session cookie must send the header X-Requested-With.",
        },
        "servers": [{"url": "/"}],
        "security": [{"bearerToken": []}, {"sessionCookie": []}],
        "paths": _paths(),
        "components": {
            "schemas": _components(),
            "securitySchemes": {
                "bearerToken": {"type": "http", "scheme": "bearer"},
                "sessionCookie": {"type": "apiKey", "in": "cookie", "name": "dpb_session"},
            },
        },
    }
