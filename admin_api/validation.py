"""Reading what a client sends: JSON bodies into :class:`Body` models, query parameters
into :class:`Params` models. Every failure is a 400 whose message names the field and
says what it must be.

A model is the only declaration of a body or of an endpoint's parameters: pydantic
validates the request with it, and the OpenAPI document (:mod:`admin_api.openapi`) takes
the schema from it, so the document cannot drift from what the API accepts. What is this
API's own is here: the sentences of its errors (pydantic's are translated, see
:func:`_explain`), names refused rather than stripped, blank strings, date-times without
an offset read as UTC, integers in ASCII digits, and what PostgreSQL cannot store
(:func:`check_json_value`).
"""

from __future__ import annotations

import datetime as dt
import math
import re
import typing
import uuid
from typing import Annotated, Any, Literal, TypeVar

import falcon
import pydantic
from pydantic import AfterValidator, BeforeValidator, StringConstraints, WithJsonSchema
from pydantic_core import PydanticCustomError

from . import media
from .errors import ApiError, bad_request

#: How deep a JSON body may nest (job arguments included).
MAX_DEPTH = 32
#: The largest request body accepted, in bytes (job arguments included). Larger ones are a
#: 413: they would only cost memory in the API and, past jsonb's limit, fail in PostgreSQL.
MAX_BODY_BYTES = 1024 * 1024

_INTEGER_RE = re.compile(r"-?[0-9]+")
#: A UUID in ASCII: 32 hex digits with or without hyphens, in braces or as a URN.
_UUID_RE = re.compile(r"(?:urn:uuid:)?\{?[0-9a-fA-F-]{32,36}\}?", re.ASCII)

B = TypeVar("B", bound="Body")
P = TypeVar("P", bound="Params")


class Body(pydantic.BaseModel):
    """A JSON request body, declared once: the model validates the request and is the
    body's schema in the OpenAPI document. Its types are JSON's, strictly (``"5"`` is not
    an integer, nor are ``1.0`` and ``true``), and a field it does not declare is
    refused, so a misspelt option is reported instead of silently ignored.

    A field that is optional and may not be ``null`` defaults to ``None``: ``None`` means
    "not given" (see :func:`given`), as ``null`` does for a nullable field.
    """

    model_config = pydantic.ConfigDict(extra="forbid", strict=True, frozen=True)


def given(body: Body) -> dict[str, Any]:
    """The fields of ``body`` the client gave, without those absent or ``null``."""
    return {name: value for name, value in body if value is not None}


def _problem(text: str) -> PydanticCustomError:
    """An error of this API's own wording; the field's name is put before it."""
    return PydanticCustomError("api", "{problem}", {"problem": text})


def _not_blank(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():
        raise _problem("must not be empty or only whitespace")
    return value


def _name(value: Any) -> Any:
    value = _not_blank(value)
    if isinstance(value, str):
        problem = name_problem(value)
        if problem is not None:
            raise _problem(problem)
    return value


def _strip(value: Any) -> Any:
    return value.strip() if isinstance(value, str) else value


def _datetime(value: Any) -> dt.datetime:
    if not isinstance(value, str):
        raise _problem("must be an ISO 8601 date-time string")
    parsed, problem = _read_datetime(value)
    if problem is not None:
        raise _problem(problem)
    return parsed


#: A string, whitespace at either end stripped, that may not be empty.
Text = Annotated[
    str, BeforeValidator(_not_blank), StringConstraints(strip_whitespace=True, min_length=1)
]
#: A string taken as sent (a password), that may not be empty or only whitespace.
Secret = Annotated[str, BeforeValidator(_not_blank), StringConstraints(min_length=1)]
#: A name (an actor's, a queue's): whitespace at either end, control characters (tabs and
#: line breaks included) and the line and paragraph separators U+2028 and U+2029 are
#: refused, never stripped, so that the name stored is the name sent, and two names that
#: look alike are not made one.
Name = Annotated[str, BeforeValidator(_name), StringConstraints(min_length=1)]
#: An ISO 8601 date-time; without an offset it is UTC.
DateTime = Annotated[dt.datetime, BeforeValidator(_datetime)]


def choice(values: tuple[str, ...]) -> Any:
    """A string that is one of ``values`` (whitespace at either end stripped)."""
    return Annotated[Literal[values], BeforeValidator(_strip)]  # type: ignore[valid-type]


def check_body(model: type[B], body: Any, *, what: str = "the body") -> B:
    """Check a parsed body against ``model``; see :func:`read_body`."""
    if not isinstance(body, dict):
        raise bad_request(f"{what} must be a JSON object, not {_json_type(body)}")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        raise bad_request(_explain(model, body, e.errors(include_url=False), what)) from None


def _explain(model: type[Body], body: dict, errors: list, what: str) -> str:
    """The first of pydantic's ``errors`` as a sentence: unknown fields first, then missing
    ones, then the first bad value in the order the client sent them."""
    fields = model.model_fields
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        known = f"the fields are {', '.join(fields)}" if fields else "it takes no fields"
        return f"{what} has unknown field(s) {', '.join(map(repr, unknown))}; {known}"
    missing = {e["loc"][0] for e in errors if e["type"] == "missing"}
    if missing:
        return f"{what} lacks the required field(s) {', '.join(n for n in fields if n in missing)}"
    order = list(body)
    error = min(errors, key=lambda e: order.index(e["loc"][0]) if e["loc"] else 0)
    name = str(error["loc"][0]) if error["loc"] else what
    return f"{name} {_sentence(error, fields.get(name))}"


#: pydantic's error types, said as this API says them (after the field's name).
_SENTENCES = {
    "string_type": "must be a string, not {json}",
    "int_type": "must be an integer, not {json}",
    "bool_type": "must be true or false, not {json}",
    "list_type": "must be a JSON array, not {json}",
    "dict_type": "must be a JSON object, not {json}",
    "greater_than_equal": "must be at least {ge}",
    "less_than_equal": "must be at most {le}",
    "string_too_short": "must have at least {min_length} characters",
    "string_too_long": "must be at most {max_length} characters long",
    "too_long": "must be at most {max_length} characters long",
    "string_pattern_mismatch": "must match the pattern {pattern}",
}


def _sentence(error: dict, field: pydantic.fields.FieldInfo | None) -> str:
    value, ctx = error["input"], error.get("ctx", {})
    if error["type"] == "api":
        return ctx["problem"]
    if value is None:
        return "must not be null"
    if error["type"] == "literal_error":
        if not isinstance(value, str):
            return f"must be a string, not {_json_type(value)}"
        return f"must be one of {', '.join(_literals(field.annotation if field else None))}"
    template = _SENTENCES.get(error["type"])
    if template is None:  # a type this API's bodies do not use: pydantic's own words
        return f"is not valid: {error['msg']}"
    return template.format(json=_json_type(value), **ctx)


def _literals(annotation: Any) -> list[str]:
    """The strings of the ``Literal`` in ``annotation`` (through ``| None``)."""
    if typing.get_origin(annotation) is Literal:
        return [str(value) for value in typing.get_args(annotation)]
    return [v for arg in typing.get_args(annotation) for v in _literals(arg)]


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
            _check_text(item, path)
        elif isinstance(item, float) and not math.isfinite(item):
            raise bad_request(f"{path} is a number too large to store")
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, f"a key in {path}")
                stack.append((child, f"{path}.{key}", depth + 1))
        elif isinstance(item, list):
            for index, child in enumerate(item):
                stack.append((child, f"{path}[{index}]", depth + 1))


#: What a name may not contain: control characters (C0, DEL, C1; tabs and line breaks
#: among them) and the line and paragraph separators.
_NAME_FORBIDDEN_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def name_problem(value: str) -> str | None:
    """What is wrong with a name (an actor's, a queue's), or None: whitespace at either
    end, a control character or a line or paragraph separator. Such a name is a mistake or
    a disguise, and stripping it would store a name the client did not send."""
    bad = _NAME_FORBIDDEN_RE.search(value)
    if bad is not None:
        return (
            "must not contain control characters, tabs, line breaks or line or paragraph "
            f"separators; it has U+{ord(bad.group()):04X} at position {bad.start()}"
        )
    if value != value.strip():
        return "must not begin or end with whitespace: send the name alone"
    return None


def check_name(where: str, value: str) -> None:
    """Refuse a name that has a :func:`name_problem`.

    Raises:
      ApiError: 400 saying which problem it has.
    """
    problem = name_problem(value)
    if problem is not None:
        raise bad_request(f"{where} {problem}")


def _check_text(text: str, where: str) -> None:
    if "\x00" in text:
        raise bad_request(f"{where} contains a NUL character, which cannot be stored")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"{where} contains an unpaired surrogate, which is not valid text"
        ) from None


def read_body(req: falcon.Request, model: type[B], *, what: str = "the body") -> B:
    """Read a JSON object body and check it against ``model``.

    Returns:
      Body: the body, strings trimmed (not a :data:`Secret` or a :data:`Name`), datetimes
      parsed and made timezone-aware; :func:`given` has the fields the client gave.

    Raises:
      ApiError: 400 for a body that is not an object, an unknown or missing field, or a
        value of the wrong type or out of range; see :func:`read_json` for the others.
    """
    return check_body(model, read_json(req), what=what)


def read_optional_body(req: falcon.Request, model: type[B], *, what: str = "the body") -> B:
    """Like :func:`read_body`, but no body at all (no Content-Length, or 0) is an empty
    object: for the action endpoints, whose body is optional. A body that is sent is held
    to every rule of :func:`read_json` (415, 413, 411, 400) and to ``model``."""
    chunked = req.content_length is None and req.get_header("Transfer-Encoding")
    if not req.content_length and not chunked:
        return check_body(model, {}, what=what)
    return read_body(req, model, what=what)


def parse_datetime(name: str, text: str) -> dt.datetime:
    """An ISO 8601 date-time, timezone-aware (UTC when it has no offset).

    Raises:
      ApiError: 400 when it does not parse.
    """
    value, problem = _read_datetime(text)
    if problem is not None:
        raise bad_request(f"{name} {problem}")
    return value


def _read_datetime(text: str) -> tuple[Any, str | None]:
    """``text`` as a timezone-aware date-time, or what is wrong with it."""
    try:
        value = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        return None, f"must be an ISO 8601 date-time such as 2030-01-31T12:00:00Z, not {text!r}"
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    try:
        value.astimezone(dt.timezone.utc)
    except OverflowError:
        return None, "is out of the supported date range"
    return value, None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# -- query parameters --------------------------------------------------------------------


class Params(pydantic.BaseModel):
    """The query parameters of an endpoint, declared once: :func:`read_query` reads them
    with the model, the OpenAPI document lists them from it. A parameter given empty is
    absent. Its types are the ``Query*`` ones below: a query parameter is text, and each
    says how it becomes a value (or a 400 naming the parameter)."""

    model_config = pydantic.ConfigDict(strict=True, frozen=True)


def _query_int(value: Any) -> Any:
    # ASCII digits only: int() would also take "+5", "1_000" and other scripts' digits.
    digits = value.strip()
    if _INTEGER_RE.fullmatch(digits) and len(digits) <= 20:
        return int(digits)
    return value  # not an integer: the int schema refuses it


def _query_name(value: str, info: pydantic.ValidationInfo) -> str:
    check_name(info.field_name, value)
    return value


#: An integer, in ASCII digits; bound it with ``Field(ge=..., le=...)``.
QueryInt = Annotated[int, BeforeValidator(_query_int)]
#: A name to filter by (see :func:`check_name`); bound it with ``Field(max_length=...)``.
QueryName = Annotated[str, AfterValidator(_query_name)]
#: A UUID, in its canonical text form.
QueryUuid = Annotated[
    str,
    BeforeValidator(lambda value, info: parse_uuid(value, info.field_name)),
    WithJsonSchema({"type": "string", "format": "uuid"}),
]
#: An ISO 8601 date-time; without an offset it is UTC.
QueryDateTime = Annotated[
    dt.datetime, BeforeValidator(lambda value, info: parse_datetime(info.field_name, value))
]


def read_query(req: falcon.Request, model: type[P] | None = None) -> P | None:
    """The query parameters of ``req``, read with ``model`` (None: the endpoint takes
    none).

    Raises:
      ApiError: 400 for a parameter the endpoint does not take (a misspelt filter is
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
        _check_text(value, f"query parameter {name}")
        if value != "":
            values[name] = value
    try:
        return model.model_validate(values)
    except pydantic.ValidationError as e:
        error = e.errors(include_url=False)[0]
        name = str(error["loc"][0])
        raise bad_request(_explain_param(name, fields[name], error, values[name])) from None


def _explain_param(name: str, field: Any, error: dict, raw: str) -> str:
    if error["type"] == "literal_error":
        return f"{name} must be one of {', '.join(_literals(field.annotation))}, not {raw!r}"
    if error["type"] in ("int_type", "greater_than_equal", "less_than_equal"):
        bounds = {
            key: getattr(m, key) for m in field.metadata for key in ("ge", "le") if hasattr(m, key)
        }
        return f"{name} must be an integer from {bounds['ge']} to {bounds['le']}, not {raw!r}"
    return f"{name} {_sentence(error, field)}"


def parse_uuid(raw: str, name: str = "job id") -> str:
    """A UUID in its canonical text form.

    Raises:
      ApiError: 400 when ``raw`` is not a UUID.
    """
    try:
        # ASCII hex only: uuid.UUID() reads the digits with int(), which also takes other
        # scripts' digits ("\u0663" for "3"), "_" and "+", so that another spelling would
        # find a job.
        if not isinstance(raw, str) or not _UUID_RE.fullmatch(raw):
            raise ValueError(raw)
        return str(uuid.UUID(raw))
    except (ValueError, TypeError, AttributeError):
        shown = raw if len(raw) <= 60 else raw[:60] + "..."
        raise bad_request(
            f"{name} must be a UUID such as 6f1c1f9e-6a43-4f7e-9b1f-0a5a1c6e2d3b, not {shown!r}"
        ) from None
