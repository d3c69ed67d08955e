"""The OpenAPI 3.1 document of the API, served at ``/api/openapi.json``, derived from the
operations the resources declare (:mod:`admin_api.operations`): nothing here names a
path, a role or a status of one operation. The schemas are generated from the pydantic
models: the bodies' and query parameters' (:mod:`admin_api.validation`), and the answers'
(:mod:`admin_api.responses`). A test checks every answer of the API's tests against it.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from dramatiq_pg_broker import __version__

from . import responses
from .accounts import ROLES
from .app import API
from .operations import ANY_QUERY, MAX_BODY_BYTES, PATH_PARAMETERS, PUBLIC, Operation, operations
from .request_limits import REQUEST_FIELD_BYTES, REQUEST_FIELDS, REQUEST_LINE_BYTES

#: Where the component schemas are.
REF = "#/components/schemas/{model}"
JSON = "application/json"

#: What an operation of each kind may answer besides its own statuses (see :func:`_answers`).
ERRORS = {
    400: "Bad input; the message says what was wrong.",
    401: "No credentials, or invalid ones.",
    403: "The caller's role may not do this (or a cross-site request was refused).",
    411: "The body is chunked: send it with a Content-Length.",
    413: f"The body is larger than {MAX_BODY_BYTES} bytes.",
    415: "The body is not JSON.",
    503: "The database is unavailable, or the query ran past the statement timeout "
    "(DRAMATIQ_PG_STATEMENT_TIMEOUT); Retry-After says when to try again.",
    # Answered by the server itself, before the app, to any request (gunicorn_conf).
    414: f"The request line is longer than {REQUEST_LINE_BYTES} bytes (answered by the "
    "server, as served by the shipped gunicorn configuration).",
    431: f"The request has more than {REQUEST_FIELDS} header fields or one longer than "
    f"{REQUEST_FIELD_BYTES} bytes (answered by the server, as served by the shipped "
    "gunicorn configuration).",
}
_IF_NONE_MATCH = {
    "name": "If-None-Match",
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "The ETag of an earlier answer: when the answer has not changed since, it "
    "is a 304 with no body (how the dashboard polls an unfinished job).",
}


class Schemas(GenerateJsonSchema):
    """pydantic's JSON Schemas, written as this document writes them: no titles (the
    property names say it), ``"type": [..., "null"]`` for a nullable value (and ``null``
    among its ``enum``), no ``"default": null`` (absent means not given), no empty
    ``items``."""

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
        if not isinstance(inner.get("type"), str):
            return super().nullable_schema(schema)
        if "enum" in inner:
            inner = {**inner, "enum": [*inner["enum"], None]}
        return {**inner, "type": [inner["type"], "null"]}

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


def _operation(path: str, op: Operation) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": op.summary}
    description = op.description
    if op.roles is PUBLIC:
        out["security"] = []
    else:
        description += f"\n\nRoles: {roles(op)}."
    if description.strip():
        out["description"] = description.strip()
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": PATH_PARAMETERS[name].schema,
         "description": PATH_PARAMETERS[name].description}
        for name in re.findall(r"{(\w+)}", path)
    ] + ([_IF_NONE_MATCH] if op.etag else [])  # fmt: skip
    if op.query not in (None, ANY_QUERY):
        properties = op.query.model_json_schema(schema_generator=Schemas)["properties"]
        # Given empty (a form's empty field), a parameter is left out: see Params.
        parameters += [
            {"name": name, "in": "query", "required": False, "allowEmptyValue": True,
             "schema": schema, "description": schema.pop("description", "")}
            for name, schema in properties.items()
        ]  # fmt: skip
    if parameters:
        out["parameters"] = parameters
    if op.body is not None:
        schema = body_schema(op.body)
        out["requestBody"] = {"required": op.body_required, "content": {JSON: {"schema": schema}}}
        if not op.body_required:
            out["requestBody"]["description"] = "Optional: send none, or an empty JSON object."
    out["responses"] = _answers(op)
    return out


def roles(op: Operation) -> str:
    """Who may call ``op``: "any", or its roles, with its ``scope``."""
    if op.roles is PUBLIC:
        return "anyone, without credentials"
    named = "any" if op.roles == set(ROLES) else ", ".join(r for r in ROLES if r in op.roles)
    return f"{named} ({op.scope})" if op.scope else named


def _answers(op: Operation) -> dict[str, Any]:
    """The operation's own answers, then those of its kind: a 400 when it reads a query
    string or a body, a 401 and a 403 when it needs credentials, a 503 when it needs the
    database (credentials do), 411, 413 and 415 when it reads a body, and the 414 and
    431 the server answers to any request whose head is too long."""
    answers = dict(op.responses)
    if op.etag:
        answers[304] = "Not modified: the answer still has the ETag sent in If-None-Match."
    protected, body = op.roles is not PUBLIC, op.body is not None
    kinds = {400: op.query != ANY_QUERY or body, 401: protected, 403: protected}
    kinds |= {503: protected or op.database, 411: body, 413: body, 415: body}
    kinds |= {414: True, 431: True}
    for status, applies in kinds.items():
        if applies:
            answers.setdefault(status, ERRORS[status])
    out = {}
    for status, answer in answers.items():
        model, description = answer if isinstance(answer, tuple) else (None, answer)
        if model is None and status >= 400:
            model = responses.Error
        out[str(status)] = {"description": description}
        if model is not None:
            ref = {"$ref": REF.format(model=model.__name__)}
            out[str(status)]["content"] = {JSON: {"schema": ref}}
        if op.etag and status == 200:
            tag = "A tag of this answer, to send back in If-None-Match."
            out["200"]["headers"] = {"ETag": {"description": tag, "schema": {"type": "string"}}}
    return out


def build() -> dict[str, Any]:
    """The OpenAPI document."""
    paths: dict[str, Any] = {}
    for resource in API:
        for method, op in operations(resource).items():
            if op.documented:
                operation = _operation(resource.route, op)
                paths.setdefault(resource.route, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "dramatiq-pg-broker admin API",
            "version": __version__,
            "description": "See and steer the jobs of a dramatiq-pg-broker queue. Errors are "
            '{"error": code, "message": sentence}. State-changing requests authenticated by '
            "the session cookie must send the header X-Requested-With. A query parameter "
            "given empty (?queue=) is the same as one left out.",
        },
        "servers": [{"url": "/"}],
        "security": [{"bearerToken": []}, {"sessionCookie": []}],
        "paths": paths,
        "components": {
            "schemas": _components(),
            "securitySchemes": {
                "bearerToken": {"type": "http", "scheme": "bearer"},
                "sessionCookie": {"type": "apiKey", "in": "cookie", "name": "dpb_session"},
            },
        },
    }
