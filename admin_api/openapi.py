"""The OpenAPI 3.1 document of the API, served at ``/api/openapi.json``.

Request bodies are generated from the same field lists the resources validate with, and
the query parameters from the same bounds, so the document says what the API accepts. A
test checks that every route and method is documented and that real responses have the
documented fields.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, UUID

from dramatiq_pg_broker import __version__
from dramatiq_pg_broker.events import ALL as EVENT_TYPES
from dramatiq_pg_broker.events import STATUSES

from .accounts import ROLES
from .queries import JOB_COLUMNS, LIST_COLUMNS, PREVIEW_CHARS
from .resources import dashboard as dashboard_resource
from .resources import events as events_resource
from .resources import jobs as jobs_resource
from .resources.sessions import LOGIN_FIELDS
from .resources.users import TOKEN_FIELDS, USER_FIELDS, USER_UPDATE_FIELDS
from .tables import jobs
from .validation import MAX_BODY_BYTES, object_schema


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


def _body(fields) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": object_schema(fields)}}}


def _optional_body(fields) -> dict[str, Any]:
    """The body of an action endpoint: none at all, or a JSON object of ``fields`` (any
    other field is a 400, a body that is not JSON a 415)."""
    return {
        "required": False,
        "description": "Optional: send none, or an empty JSON object.",
        "content": {"application/json": {"schema": object_schema(fields)}},
    }


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

_NULLABLE_TIME = {"type": ["string", "null"], "format": "date-time"}
_TIME = {"type": "string", "format": "date-time"}


def _column_schema(column: sa.Column) -> dict[str, Any]:
    """The JSON Schema of a table column's values as the API shows them."""
    kind = column.type
    if isinstance(kind, JSONB):
        return {}  # any JSON value, null included
    if isinstance(kind, UUID):
        schema: dict[str, Any] = {"type": "string", "format": "uuid"}
    elif isinstance(kind, sa.DateTime):
        schema = {"type": "string", "format": "date-time"}
    elif isinstance(kind, sa.Integer):
        schema = {"type": "integer"}
    elif isinstance(kind, sa.Boolean):
        schema = {"type": "boolean"}
    else:
        schema = {"type": "string"}
    if column.nullable:
        schema["type"] = [schema["type"], "null"]
    return schema


_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "properties": {
            "error": {"type": "string", "description": "A stable code, e.g. bad_request."},
            "message": {"type": "string", "description": "What was wrong, as a sentence."},
        },
        "required": ["error", "message"],
    },
    "Job": {
        "type": "object",
        "properties": {
            # The row's columns the API shows, typed from the table's definition.
            **{name: _column_schema(jobs.c[name]) for name in JOB_COLUMNS},
            "status": {"type": "string", "enum": list(STATUSES)},
            "message": {
                "type": ["object", "null"],
                "description": "The Dramatiq message (args, kwargs, options ...); null when "
                "it is stored in a binary encoding.",
            },
            "message_encoding": {"type": "string", "enum": ["json", "binary"]},
            "owner": {
                "type": ["string", "null"],
                "description": "Email of the user who created the job through the API.",
            },
            "abort_requested_at": {
                **_NULLABLE_TIME,
                "description": "When an operator asked for the job's abort (null: never).",
            },
            "abort_requested_by": {
                "type": ["string", "null"],
                "description": "Who asked for the job's abort.",
            },
        },
    },
    "JobSummary": {
        "type": "object",
        "description": "A job in a list: its fields, but bounded previews instead of its "
        "arguments, result and last error (the job's own endpoint has them whole).",
        "properties": {
            "args_preview": {
                "type": ["string", "null"],
                "maxLength": PREVIEW_CHARS,
                "description": f"The arguments (args, then kwargs when there are any) as "
                f"JSON, at most {PREVIEW_CHARS} characters, ending with '…' when cut; null "
                "for a message in a binary encoding.",
            },
            "error_preview": {
                "type": ["string", "null"],
                "maxLength": PREVIEW_CHARS,
                "description": f"The last error, at most {PREVIEW_CHARS} characters.",
            },
        },
    },
    "JobPage": {
        "type": "object",
        "properties": {
            "count": {
                "type": "integer",
                "description": "Matching jobs, counted up to 10,000 (see count_exact).",
            },
            "count_exact": {
                "type": "boolean",
                "description": "False when more than 10,000 jobs match: count is then 10,000.",
            },
            "next": {
                "type": ["string", "null"],
                "format": "uri-reference",
                "description": "Older jobs (a keyset cursor link; relative unless "
                "DRAMATIQ_PG_PUBLIC_URL is set).",
            },
            "previous": {
                "type": ["string", "null"],
                "format": "uri-reference",
                "description": "Newer jobs (a keyset cursor link).",
            },
            "results": {"type": "array", "items": _ref("JobSummary")},
        },
    },
    "Event": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "job_id": {"type": "string", "format": "uuid"},
            "type": {"type": "string", "enum": list(EVENT_TYPES)},
            "attempt": {"type": "integer"},
            "actor": {"type": ["string", "null"], "description": "Worker or operator."},
            "data": {},
            "created_at": _TIME,
        },
    },
    "JobTimeline": {
        "type": "object",
        "properties": {
            "job_id": {"type": "string", "format": "uuid"},
            "results": {"type": "array", "items": _ref("Event")},
        },
    },
    "EventPage": {
        "type": "object",
        "properties": {
            "next": {"type": ["string", "null"], "format": "uri-reference"},
            "previous": {"type": ["string", "null"], "format": "uri-reference"},
            "results": {"type": "array", "items": _ref("Event")},
        },
    },
    "Schedule": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "kind": {"type": "string", "enum": ["actor", "maintenance"]},
            "actor_name": {"type": ["string", "null"]},
            "queue_name": {"type": ["string", "null"]},
            "trigger": {"type": "string", "description": "'cron <expr>' or 'every <n><unit>'."},
            "timezone": {"type": "string"},
            "missed": {"type": "string", "enum": ["run_once", "skip"]},
            "last_tick": {"type": ["string", "null"], "format": "date-time"},
            "next_run": {"type": ["string", "null"], "format": "date-time"},
            "last_job_id": {"type": ["string", "null"], "format": "uuid"},
            "last_job_status": {"type": ["string", "null"]},
            "updated_at": {"type": "string", "format": "date-time"},
        },
    },
    "Stats": {
        "type": "object",
        "properties": {
            "total": {"type": "integer"},
            "estimated": {
                "type": "boolean",
                "description": (
                    "total and at least one of succeeded, failed and cancelled are "
                    "estimates (that status's history is big)."
                ),
            },
            "by_status": {
                "type": "object",
                "properties": {s: {"type": "integer"} for s in STATUSES},
            },
            "by_queue": {
                "type": "object",
                "description": "Unfinished jobs per queue.",
                "additionalProperties": {
                    "type": "object",
                    "properties": {"queued": {"type": "integer"}, "running": {"type": "integer"}},
                },
            },
            "expired_leases": {
                "type": "integer",
                "description": "Running jobs whose lease expired (the reaper will requeue them).",
            },
            "retries_pending": {
                "type": "integer",
                "description": "Queued jobs waiting for a retry after a failed attempt.",
            },
            "oldest_queued": {
                "type": ["object", "null"],
                "properties": {
                    "id": {"type": "string", "format": "uuid"},
                    "queue_name": {"type": "string"},
                    "actor_name": {"type": "string"},
                    "created_at": _TIME,
                    "age_seconds": {"type": "number"},
                },
            },
        },
    },
    "Health": {
        "type": "object",
        "properties": {
            "status": {"type": "string", "enum": ["ok", "unavailable"]},
            "database": {"type": "string", "enum": ["ok", "unreachable"]},
            "schema": {
                "type": "string",
                "enum": ["ok", "missing", "migrations_pending", "code_too_old"],
            },
            "detail": {"type": "string"},
        },
    },
    "Settings": {
        "type": "object",
        "description": "Settings without secrets (see the settings reference).",
    },
    "QueueState": {
        "type": "object",
        "properties": {
            "queue_name": {"type": "string"},
            "paused": {"type": "boolean"},
            "paused_at": _NULLABLE_TIME,
            "paused_by": {"type": ["string", "null"]},
            "resumed_at": _NULLABLE_TIME,
            "resumed_by": {"type": ["string", "null"]},
            "declared_at": _TIME,
        },
    },
    "Worker": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "description": "host:pid:random, per process start."},
            "host": {"type": "string"},
            "pid": {"type": "integer"},
            "queues": {"type": "array", "items": {"type": "string"}},
            "actors": {"type": "array", "items": {"type": "string"}},
            "version": {"type": ["string", "null"]},
            "started_at": _TIME,
            "heartbeat_at": _TIME,
            "expires_at": {
                **_TIME,
                "description": "Without a heartbeat by then, the process counts as gone.",
            },
            "in_flight": {
                "type": "integer",
                "description": "Attempts it held at its last heartbeat (prefetched, running "
                "or waiting for their outcome to be written).",
            },
        },
    },
    "Actor": {
        "type": "object",
        "properties": {
            "actor_name": {"type": "string"},
            "queue_name": {"type": "string"},
            "declared_at": _TIME,
            "seen_at": {**_TIME, "description": "When a worker last declared it."},
            "live_workers": {"type": "integer", "description": "Live workers declaring it."},
        },
    },
    "User": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "email": {"type": "string"},
            "role": {"type": "string", "enum": list(ROLES)},
            "active": {"type": "boolean"},
            "created_at": _TIME,
        },
    },
    "Token": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "user_id": {"type": "integer"},
            "created_at": _TIME,
            "last_used_at": _NULLABLE_TIME,
            "revoked": {"type": "boolean"},
            "token": {"type": "string", "description": "Only when created; shown once."},
        },
    },
}

# A list row has the job's own fields but its arguments, result and last error.
_SCHEMAS["JobSummary"]["properties"] = {
    **{
        name: _SCHEMAS["Job"]["properties"][name]
        for name in (*LIST_COLUMNS, "message_encoding", "owner")
    },
    **_SCHEMAS["JobSummary"]["properties"],
}

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


def _list_of(name: str, description: str) -> dict[str, Any]:
    return _json(
        {
            "type": "object",
            "properties": {
                "count": {"type": "integer"},
                "results": {"type": "array", "items": _ref(name)},
            },
        },
        description,
    )


def _paths() -> dict[str, Any]:
    return {
        "/api/health": {
            "get": {
                "summary": "Is the database reachable? No credentials needed.",
                "security": [],
                "responses": {
                    "200": _json(_ref("Health"), "The database answers and is migrated."),
                    "503": _json(_ref("Health"), "It does not; detail says why."),
                },
            }
        },
        "/api/config": {
            "get": _protected(
                {
                    "summary": "The effective settings, without secrets.",
                    "responses": {"200": _json(_ref("Settings"), "The settings.")},
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
                    "parameters": [
                        _param(
                            "limit",
                            "query",
                            {
                                "type": "integer",
                                "minimum": 1,
                                "maximum": jobs_resource.MAX_LIMIT,
                                "default": jobs_resource.DEFAULT_LIMIT,
                            },
                            "Page size.",
                        ),
                        _param(
                            "offset",
                            "query",
                            {"type": "integer", "minimum": 0, "maximum": jobs_resource.MAX_OFFSET},
                            "Jobs to skip (not with cursor).",
                        ),
                        _param(
                            "cursor",
                            "query",
                            {"type": "string"},
                            "A position from a next or previous link.",
                        ),
                        _param(
                            "status",
                            "query",
                            {"type": "string", "enum": list(jobs_resource.LIST_STATUSES)},
                            "Exact status, or delayed: queued jobs whose available_at is "
                            "still ahead (a delay, an eta, a retry backoff; the overview's "
                            "Delayed count).",
                        ),
                        _param(
                            "queue",
                            "query",
                            {"type": "string", "maxLength": jobs_resource.MAX_FILTER_LENGTH},
                            "Exact queue name.",
                        ),
                        _param(
                            "actor",
                            "query",
                            {"type": "string", "maxLength": jobs_resource.MAX_FILTER_LENGTH},
                            "Case-insensitive substring of the actor's name (at most "
                            "50 actor names may match).",
                        ),
                        _param("created_after", "query", _TIME, "Created at or after (ISO 8601)."),
                        _param("created_before", "query", _TIME, "Created before (ISO 8601)."),
                    ],
                    "responses": {"200": _json(_ref("JobPage"), "One page of jobs.")},
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
                    "requestBody": _body(jobs_resource.JOB_FIELDS),
                    "responses": {
                        "201": _json(_ref("Job"), "The new job."),
                        "200": _json(_ref("Job"), "The job that already had this idempotency key."),
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
                    "responses": {"200": _json(_ref("Stats"), "The stats.")},
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
                            {
                                "type": "object",
                                "properties": {
                                    "schedules": {"type": "array", "items": _ref("Schedule")}
                                },
                            },
                            "Every schedule the workers registered.",
                        )
                    },
                },
                "viewer, operator, admin",
            )
        },
        "/api/jobs/{job_id}": {
            "get": _protected(
                {
                    "summary": "One job.",
                    "description": (
                        "Its ETag is weak and leaves out locked_until: a running job's lease "
                        "renewals alone answer 304 to If-None-Match. Ask without it for the "
                        "current lease."
                    ),
                    "parameters": [_JOB_ID, _IF_NONE_MATCH],
                    "responses": {
                        "200": _tagged(_json(_ref("Job"), "The job.")),
                        "304": _304,
                        "404": _404,
                    },
                },
                "any (members: their jobs)",
            )
        },
        "/api/jobs/{job_id}/events": {
            "get": _protected(
                {
                    "summary": "A job's timeline, oldest first.",
                    "parameters": [_JOB_ID, _IF_NONE_MATCH],
                    "responses": {
                        "200": _tagged(_json(_ref("JobTimeline"), "The events.")),
                        "304": _304,
                        "404": _404,
                    },
                },
                "any (members: their jobs)",
            )
        },
        "/api/jobs/{job_id}/retry": {
            "post": _protected(
                {
                    "summary": "Move a failed job back to the queue; attempts start from zero.",
                    "requestBody": _optional_body(jobs_resource.ACTION_FIELDS),
                    "parameters": [_JOB_ID],
                    "responses": {
                        "200": _json(_ref("Job"), "The job, queued again."),
                        "404": _404,
                        "409": _error("The job is not failed."),
                    },
                },
                "operator, admin",
            )
        },
        "/api/jobs/{job_id}/cancel": {
            "post": _protected(
                {
                    "summary": "Cancel a queued job.",
                    "requestBody": _optional_body(jobs_resource.ACTION_FIELDS),
                    "parameters": [_JOB_ID],
                    "responses": {
                        "200": _json(_ref("Job"), "The job, cancelled."),
                        "404": _404,
                        "409": _error("The job is not queued."),
                    },
                },
                "operator, admin",
            )
        },
        "/api/jobs/{job_id}/abort": {
            "post": _protected(
                {
                    "summary": "Abort a job: a waiting one is cancelled at once; a running one "
                    "is stopped by its worker and ends cancelled, never retried.",
                    "description": "For a running job the answer comes before the worker "
                    "stops it: the job is still running, with abort_requested_at and "
                    "abort_requested_by set; it ends cancelled within about a second, with "
                    "an aborted event naming who asked.",
                    "requestBody": _optional_body(jobs_resource.ACTION_FIELDS),
                    "parameters": [_JOB_ID],
                    "responses": {
                        "200": _json(
                            _ref("Job"), "The job, cancelled or with the abort requested."
                        ),
                        "404": _404,
                        "409": _error("The job has finished (succeeded, failed or cancelled)."),
                    },
                },
                "operator, admin",
            )
        },
        "/api/queues/{queue_name}/pause": {
            "post": _protected(
                {
                    "summary": "Pause a queue: no worker on any host claims its jobs from "
                    "now on; sends are still accepted; the pause survives worker restarts.",
                    "description": "Its workers give back the messages they prefetched and "
                    "had not started; running jobs finish. Pausing a paused queue changes "
                    "nothing.",
                    "requestBody": _optional_body(jobs_resource.ACTION_FIELDS),
                    "parameters": [_QUEUE_NAME],
                    "responses": {
                        "200": _json(_ref("QueueState"), "The queue, paused."),
                        "404": _error("No worker has declared this queue."),
                    },
                },
                "operator, admin",
            )
        },
        "/api/queues/{queue_name}/resume": {
            "post": _protected(
                {
                    "summary": "Resume a paused queue: its workers claim its jobs at once.",
                    "requestBody": _optional_body(jobs_resource.ACTION_FIELDS),
                    "parameters": [_QUEUE_NAME],
                    "responses": {
                        "200": _json(_ref("QueueState"), "The queue, active."),
                        "404": _error("No worker has declared this queue."),
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
                    "responses": {"200": _list_of("Worker", "The live workers, oldest first.")},
                },
                "viewer, operator, admin",
            )
        },
        "/api/actors": {
            "get": _protected(
                {
                    "summary": "The actors workers declared, each with its queue: what "
                    "POST /api/jobs accepts.",
                    "responses": {"200": _list_of("Actor", "The declared actors, by name.")},
                },
                "any",
            )
        },
        "/api/job-events": {
            "get": _protected(
                {
                    "summary": "Every job's events, newest first, with cursor pages.",
                    "description": "Follow next/previous; a cursor is opaque.",
                    "parameters": [
                        _param(
                            "limit",
                            "query",
                            {
                                "type": "integer",
                                "minimum": 1,
                                "maximum": events_resource.MAX_LIMIT,
                                "default": events_resource.DEFAULT_LIMIT,
                            },
                            "Page size.",
                        ),
                        _param("cursor", "query", {"type": "string"}, "From a next/previous link."),
                        _param(
                            "type",
                            "query",
                            {"type": "string", "enum": list(EVENT_TYPES)},
                            "Exact event type.",
                        ),
                        _param("job_id", "query", {"type": "string", "format": "uuid"}, "One job."),
                    ],
                    "responses": {"200": _json(_ref("EventPage"), "One page of events.")},
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
                    "requestBody": _body(LOGIN_FIELDS),
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "user": _ref("User"),
                                    "expires_in": {
                                        "type": "integer",
                                        "description": "Seconds until the session expires.",
                                    },
                                },
                            },
                            "Logged in.",
                        ),
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
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "user": _ref("User"),
                                    "via": {"type": "string", "enum": ["session", "token"]},
                                },
                            },
                            "The account.",
                        )
                    },
                },
                "any",
            )
        },
        "/api/users": {
            "get": _protected(
                {
                    "summary": "Every user.",
                    "responses": {"200": _list_of("User", "The users.")},
                },
                "admin",
            ),
            "post": _protected(
                {
                    "summary": "Create a user.",
                    "requestBody": _body(USER_FIELDS),
                    "responses": {
                        "201": _json(_ref("User"), "The new user."),
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
                        "200": _json(_ref("User"), "The user."),
                        "404": _error("No such user."),
                    },
                },
                "admin",
            ),
            "patch": _protected(
                {
                    "summary": "Change a user's role, active flag or password.",
                    "parameters": [_USER_ID],
                    "requestBody": _body(USER_UPDATE_FIELDS),
                    "responses": {
                        "200": _json(_ref("User"), "The user."),
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
                        "200": _list_of("Token", "The tokens."),
                        "404": _error("No such user."),
                    },
                },
                "admin",
            ),
            "post": _protected(
                {
                    "summary": "Create an API token; its value is in this response only.",
                    "parameters": [_USER_ID],
                    "requestBody": _body(TOKEN_FIELDS),
                    "responses": {
                        "201": _json(_ref("Token"), "The token, with its value."),
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
    count = {"type": "integer", "minimum": 0}
    queue = {
        "type": "object",
        "properties": {
            "queue_name": {"type": "string"},
            "queued": {**count, "description": "Waiting and runnable now."},
            "delayed": {**count, "description": "Waiting for a later available_at."},
            "running": {**count, "description": "Claimed by a worker."},
            "failed": {**count, "description": "In the dead-letter state."},
            "oldest_waiting_seconds": {
                "type": "number",
                "description": "How long the oldest runnable job has waited (0: none).",
            },
            "declared": {
                "type": "boolean",
                "description": "A worker declared the queue (false: jobs wait in a queue no "
                "worker consumes).",
            },
            "live_workers": {
                **count,
                "description": "Live worker processes consuming the queue now (0: its jobs "
                "wait, whether or not a worker declared it before).",
            },
            "paused": {"type": "boolean", "description": "An operator paused the queue."},
            "paused_at": _NULLABLE_TIME,
            "paused_by": {"type": ["string", "null"]},
        },
    }
    bucket = {
        "type": "object",
        "properties": {
            "at": _TIME,
            "succeeded": count,
            "failed": count,
            "retried": count,
        },
    }
    throughput = {
        "type": "object",
        "properties": {
            "since": _TIME,
            "until": _TIME,
            "buckets": {"type": "array", "items": bucket},
            "truncated": {
                "type": "boolean",
                "description": "The window held more events than one read takes; the "
                "oldest minutes are incomplete.",
            },
        },
    }
    minutes = _param(
        "minutes",
        "query",
        {"type": "integer", "minimum": 1, "maximum": dashboard_resource.MAX_THROUGHPUT_MINUTES},
        "The window, in minutes (default 60).",
    )
    return {
        "/api/queues": {
            "get": _protected(
                {
                    "summary": "Per queue: queued, delayed, running and failed jobs, the age "
                    "of the oldest runnable job, and whether it is paused. Every declared "
                    "queue is listed; another queue only while it has such jobs.",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {"results": {"type": "array", "items": queue}},
                            },
                            "The queues, by name.",
                        )
                    },
                },
                "viewer, operator, admin",
            )
        },
        "/api/throughput": {
            "get": _protected(
                {
                    "summary": "Succeeded, failed and retried attempts per minute.",
                    "parameters": [minutes],
                    "responses": {"200": _json(throughput, "One bucket per minute, oldest first.")},
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
            "schemas": _SCHEMAS,
            "securitySchemes": {
                "bearerToken": {"type": "http", "scheme": "bearer"},
                "sessionCookie": {"type": "apiKey", "in": "cookie", "name": "dpb_session"},
            },
        },
    }
