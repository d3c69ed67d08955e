"""Each operation of the API, declared once, on its responder::

    class JobList:
        route = "/api/jobs"

        @operation(
            roles=READERS,
            summary="List jobs, newest first, with filters and keyset pages.",
            query=JobListParams,
            responses={200: (responses.JobPage, "One page of jobs.")},
        )
        def on_get(self, req, resp, query: JobListParams) -> None: ...

Everything else is derived from that declaration:

- the router (:data:`admin_api.app.API`) adds each resource at its ``route``;
- the authentication middleware (:class:`admin_api.auth.Authentication`) lets exactly
  ``roles`` call the responder (:data:`PUBLIC`: no credentials), and the schema check
  (:mod:`admin_api.schema_check`) runs before it unless ``database=False``;
- before the responder runs, its path's values are read (:data:`PATH_PARAMETERS`), the
  query string with ``query`` (a parameter the model does not declare is a 400, as is any
  parameter of an operation without one) and the body with ``body``; the responder gets
  them as keyword arguments (``query=``, ``body=``);
- the OpenAPI document (:mod:`admin_api.openapi`) lists the operation with its
  parameters, body, answers and roles.

``responses`` maps each status to ``(Model, description)`` for a JSON answer of a model
of :mod:`admin_api.responses`, or to a description alone: an error's body is then the
:class:`~admin_api.responses.Error` shape, a success has none. The statuses every
operation of a kind may answer (400, 401, 403, 503, and 411, 413 and 415 with a body) are
added by the document; ``responses`` holds the operation's own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import falcon
import pydantic

from dramatiq_pg_broker.queue_rules import MAX_QUEUE_NAME, QUEUE_NAME_PATTERN

from . import media
from .errors import ApiError, bad_request
from .validation import (
    Body,
    Params,
    check_body,
    explain_param,
    read_name,
    read_uuid,
    refuse,
)

#: The roles of an operation that needs no credentials.
PUBLIC = None
#: The ``query`` of a page, which takes any query string (its script reads it).
ANY_QUERY = "any"

#: A status's answer: ``(model, description)``, or a description alone.
Answer = tuple[type[pydantic.BaseModel], str] | str


@dataclasses.dataclass(frozen=True)
class Operation:
    """One operation's declaration (see the module's description)."""

    summary: str
    roles: frozenset[str] | None
    responses: Mapping[int, Answer]
    description: str = ""
    #: Who among ``roles`` sees what, said after them ("members: their jobs").
    scope: str = ""
    query: type[Params] | str | None = None
    body: type[Body] | None = None
    #: False: no body at all is an empty object (the action endpoints).
    body_required: bool = True
    #: The answer has an ETag; If-None-Match may make it a 304.
    etag: bool = False
    #: False: served without the database (pages, the document, the health check).
    database: bool = True
    #: False: not in the OpenAPI document (HTML pages, Prometheus text).
    documented: bool = True

    def read(self, req: falcon.Request, params: dict[str, str]) -> dict[str, Any]:
        """The responder's arguments: the path's values, ``query=`` and ``body=``.

        Raises:
          ApiError: 400 (or 411, 413, 415 for a body) naming what was wrong.
        """
        arguments: dict[str, Any] = {}
        if self.query != ANY_QUERY:
            query = read_query(req, self.query)  # type: ignore[arg-type]
            if query is not None:
                arguments["query"] = query
        for name, raw in params.items():
            arguments[name] = PATH_PARAMETERS[name].read(raw) if self.documented else raw
        if self.body is not None:
            reader = read_body if self.body_required else read_optional_body
            arguments["body"] = reader(req, self.body)
        return arguments


def operation(**declaration: Any) -> Callable[[Callable], Callable]:
    """Declare the responder's operation (the fields of :class:`Operation`) and run the
    responder with what it reads."""
    declared = Operation(**declaration)

    def decorate(responder: Callable) -> Callable:
        @functools.wraps(responder)
        def run(resource: object, req: falcon.Request, resp: falcon.Response, **params):
            return responder(resource, req, resp, **declared.read(req, params))

        run.operation = declared  # type: ignore[attr-defined]
        return run

    return decorate


def operations(resource: object) -> dict[str, Operation]:
    """The operations of a resource (a class or an instance), by HTTP method.

    Raises:
      TypeError: a responder declares no operation, or a documented one's route holds a
        value :data:`PATH_PARAMETERS` does not know.
    """
    found = {}
    for name in dir(resource):
        if re.fullmatch(r"on_[a-z]+", name) and name != "on_head":
            declared = getattr(getattr(resource, name), "operation", None)
            if declared is None:
                raise TypeError(f"{resource!r}.{name} declares no operation (@operation)")
            unknown = {
                value
                for path in routes(resource)
                for value in re.findall(r"{(\w+)}", path)
                if declared.documented and value not in PATH_PARAMETERS
            }
            if unknown:
                raise TypeError(f"{resource!r}: add {', '.join(unknown)} to PATH_PARAMETERS")
            found[name[3:].upper()] = declared
    return found


def routes(resource: type) -> tuple[str, ...]:
    """The paths of a resource: its ``route``, or its ``routes`` (a page served at more
    than one address)."""
    return getattr(resource, "routes", None) or (resource.route,)


@dataclasses.dataclass(frozen=True)
class PathParameter:
    """A value of the path (``{job_id}``): its schema in the document, and how it is read
    (a 400 naming it when it cannot be)."""

    description: str
    schema: dict[str, Any]
    read: Callable[[str], Any]


def _id(what: str) -> Callable[[str], int]:
    def read(raw: str) -> int:
        # A bigint: at most 18 digits here.
        if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
            raise bad_request(f"{what} id must be a positive integer, not {raw[:40]!r}")
        return int(raw)

    return read


#: Every value a route's path holds, by its name in the route.
PATH_PARAMETERS = {
    "job_id": PathParameter(
        "The job's id.",
        {"type": "string", "format": "uuid"},
        lambda raw: refuse("job id", read_uuid, raw),
    ),
    "workflow_id": PathParameter(
        "The workflow's id.",
        {"type": "string", "format": "uuid"},
        lambda raw: refuse("workflow id", read_uuid, raw),
    ),
    "user_id": PathParameter("The user's id.", {"type": "integer", "minimum": 0}, _id("user")),
    "token_id": PathParameter("The token's id.", {"type": "integer", "minimum": 0}, _id("token")),
    "queue_name": PathParameter(
        "The queue's name.",
        {"type": "string", "maxLength": MAX_QUEUE_NAME, "pattern": QUEUE_NAME_PATTERN},
        # A name with a line break at its end would pass the pattern's "$": said here, as
        # for the names of a new job, instead of a 404 for a queue that looks real.
        lambda raw: refuse("queue name", read_name, raw),
    ),
}


# -- reading a request -------------------------------------------------------------------

#: How deep a JSON body may nest (job arguments included).
MAX_DEPTH = 32
#: The largest request body accepted, in bytes (job arguments included). Larger ones are a
#: 413: they would only cost memory in the API and, past jsonb's limit, fail in PostgreSQL.
MAX_BODY_BYTES = 1024 * 1024


def read_json(req: falcon.Request) -> Any:
    """The request body, parsed.

    Raises:
      ApiError: 400 when the body is missing or not JSON, 411 when it is chunked, 413
        when it is larger than :data:`MAX_BODY_BYTES`, 415 when it is declared as
        something else than JSON.
    """
    # Media types are case-insensitive (RFC 9110): APPLICATION/JSON is JSON.
    content_type = (req.content_type or falcon.MEDIA_JSON).split(";")[0].strip().lower()
    if content_type != falcon.MEDIA_JSON:
        raise ApiError(
            415, f"The body must be JSON (Content-Type: application/json), not {content_type}."
        )
    if req.content_length is None and req.get_header("Transfer-Encoding"):
        # Falcon reads a WSGI body up to its Content-Length only: a chunked one would
        # look empty.
        raise ApiError(411, "Send the body with a Content-Length header, not chunked.")
    if (req.content_length or 0) > MAX_BODY_BYTES:
        raise ApiError(413, f"The body must be at most {MAX_BODY_BYTES} bytes long.")
    raw = req.bounded_stream.read()
    if not raw.strip():
        raise bad_request("The request body is empty: send a JSON object.")
    try:
        body = media.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid JSON (it is not UTF-8 text).") from None
    except ValueError as e:
        raise bad_request(f"The request body is not valid JSON ({e}).") from None
    check_json_value(body, "body")
    return body


def read_body(req: falcon.Request, model: type[Body]) -> Body:
    """Read a JSON object body and check it against ``model`` (see
    :func:`~admin_api.validation.check_body`; :func:`read_json` for the other statuses)."""
    return check_body(model, read_json(req))


def read_optional_body(req: falcon.Request, model: type[Body]) -> Body:
    """Like :func:`read_body`, but no body at all (no Content-Length, or 0) is an empty
    object. A body that is sent is held to every rule of :func:`read_json` and to
    ``model``."""
    chunked = req.content_length is None and req.get_header("Transfer-Encoding")
    if not req.content_length and not chunked:
        return check_body(model, {})
    return read_body(req, model)


def read_query(req: falcon.Request, model: type[Params] | None) -> Params | None:
    """The query parameters of ``req``, read with ``model`` (None: the operation takes
    none).

    Raises:
      ApiError: 400 for a parameter the operation does not take (a misspelt filter is
        reported instead of silently ignored), one given twice, or a bad value.
    """
    fields = model.model_fields if model is not None else {}
    unknown = sorted(set(req.params) - set(fields))
    if unknown:
        raise bad_request(
            f"unknown query parameter(s) {', '.join(map(repr, unknown))}; this endpoint "
            f"takes {', '.join(fields) or 'none'}"
        )
    if model is None:
        return None
    values = {}
    for name, value in req.params.items():
        if isinstance(value, list):
            raise bad_request(f"give the query parameter {name} once")
        check_text(value, f"query parameter {name}")
        if value != "":
            values[name] = value
    try:
        return model.model_validate(values)
    except pydantic.ValidationError as e:
        error = e.errors(include_url=False)[0]
        name = str(error["loc"][0])
        raise bad_request(explain_param(name, fields[name], error, values[name])) from None


def check_json_value(value: Any, where: str) -> None:
    """Refuse what PostgreSQL cannot store in jsonb or text: NUL characters, unpaired
    surrogates, non-finite numbers, and nesting beyond :data:`MAX_DEPTH`.

    Raises:
      ApiError: 400 naming the place of the first bad value.
    """
    stack = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"{path} is nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, str):
            check_text(item, path)
        elif isinstance(item, float) and not math.isfinite(item):
            raise bad_request(f"{path} is a number too large to store")
        elif isinstance(item, dict):
            for key, child in item.items():
                check_text(key, f"a key in {path}")
                stack.append((child, f"{path}.{key}", depth + 1))
        elif isinstance(item, list):
            for index, child in enumerate(item):
                stack.append((child, f"{path}[{index}]", depth + 1))


def check_text(text: str, where: str) -> None:
    """Refuse text PostgreSQL cannot store: a NUL character or an unpaired surrogate."""
    if "\x00" in text:
        raise bad_request(f"{where} contains a NUL character, which cannot be stored")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"{where} contains an unpaired surrogate, which is not valid text"
        ) from None
