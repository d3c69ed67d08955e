"""Reading what a client sends: JSON bodies against a field list, and query parameters with
bounds. Every failure is a 400 whose message names the field and says what it must be.

The field lists are also what the OpenAPI document describes (see :mod:`admin_api.openapi`),
so the document cannot drift from what the API accepts.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import falcon

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


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a JSON body.

    Attributes:
      type(str): ``string``, ``integer``, ``boolean``, ``array``, ``object`` or
        ``datetime`` (an ISO 8601 string; without an offset it is UTC).
      description(str): what it means (shown in the OpenAPI document).
      required(bool): the body must have it.
      nullable(bool): ``null`` is accepted (and means "not given").
      minimum(int), maximum(int): bounds of an integer.
      min_length(int), max_length(int): the shortest and the longest string.
      pattern(str): a regular expression a string must match (anchored with ^ and $).
      enum(tuple): the accepted values of a string.
      default: the value used when the field is absent (documentation only).
      trim(bool): strip surrounding whitespace from a string (not for passwords).
      name(bool): the string is a name (an actor's, a queue's): whitespace at either end,
        control characters (tabs and line breaks included) and the line and paragraph
        separators U+2028 and U+2029 are refused, never stripped, so that the name stored is
        the name sent, and two names that look alike are not made one.
    """

    type: str
    description: str
    required: bool = False
    nullable: bool = False
    minimum: int | None = None
    maximum: int | None = None
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    enum: tuple[str, ...] | None = None
    default: Any = None
    trim: bool = True
    name: bool = False

    def schema(self) -> dict[str, Any]:
        """The field as an OpenAPI 3.1 schema."""
        if self.type == "datetime":
            schema: dict[str, Any] = {"type": "string", "format": "date-time"}
        else:
            schema = {"type": self.type}
        if self.nullable:
            schema["type"] = [schema["type"], "null"]
        for key, value in (
            ("minimum", self.minimum),
            ("maximum", self.maximum),
            ("maxLength", self.max_length),
            ("pattern", self.pattern),
            ("enum", list(self.enum) if self.enum else None),
            ("default", self.default),
        ):
            if value is not None:
                schema[key] = value
        if self.type == "string" and not self.enum:
            schema["minLength"] = self.min_length or 1
        schema["description"] = self.description
        return schema


def object_schema(fields: Mapping[str, Field]) -> dict[str, Any]:
    """A field list as an OpenAPI object schema (no other properties allowed)."""
    return {
        "type": "object",
        "properties": {name: field.schema() for name, field in fields.items()},
        "required": [name for name, field in fields.items() if field.required],
        "additionalProperties": False,
    }


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


def check_name(where: str, value: str) -> None:
    """Refuse a name (an actor's, a queue's) with whitespace at either end, a control
    character or a line or paragraph separator: such a name is a mistake or a disguise,
    and stripping it would store a name the client did not send.

    Raises:
      ApiError: 400 saying which of these it has.
    """
    bad = _NAME_FORBIDDEN_RE.search(value)
    if bad is not None:
        raise bad_request(
            f"{where} must not contain control characters, tabs, line breaks or line or "
            f"paragraph separators; it has U+{ord(bad.group()):04X} at position {bad.start()}"
        )
    if value != value.strip():
        raise bad_request(f"{where} must not begin or end with whitespace: send the name alone")


def _check_text(text: str, where: str) -> None:
    if "\x00" in text:
        raise bad_request(f"{where} contains a NUL character, which cannot be stored")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"{where} contains an unpaired surrogate, which is not valid text"
        ) from None


def read_object(
    req: falcon.Request, fields: Mapping[str, Field], *, what: str = "the body"
) -> dict[str, Any]:
    """Read a JSON object body and check it against ``fields``.

    Returns:
      dict: the fields the client gave (strings trimmed, datetimes parsed and made
      timezone-aware); absent and ``null`` optional fields are left out.

    Raises:
      ApiError: 400 for a body that is not an object, an unknown or missing field, or a
        value of the wrong type or out of range.
    """
    body = read_json(req)
    return check_object(body, fields, what=what)


def read_optional_object(
    req: falcon.Request, fields: Mapping[str, Field], *, what: str = "the body"
) -> dict[str, Any]:
    """Like :func:`read_object`, but no body at all (no Content-Length, or 0) is an empty
    object: for the action endpoints, whose body is optional. A body that is sent is held
    to every rule of :func:`read_json` (415, 413, 411, 400) and to ``fields``."""
    chunked = req.content_length is None and req.get_header("Transfer-Encoding")
    if not req.content_length and not chunked:
        return {}
    return read_object(req, fields, what=what)


def check_object(
    body: Any, fields: Mapping[str, Field], *, what: str = "the body"
) -> dict[str, Any]:
    """Check a parsed object against ``fields``; see :func:`read_object`."""
    if not isinstance(body, dict):
        raise bad_request(f"{what} must be a JSON object, not {_json_type(body)}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        known = f"the fields are {', '.join(fields)}" if fields else "it takes no fields"
        raise bad_request(f"{what} has unknown field(s) {', '.join(map(repr, unknown))}; {known}")
    missing = [name for name, field in fields.items() if field.required and name not in body]
    if missing:
        raise bad_request(f"{what} lacks the required field(s) {', '.join(missing)}")
    values: dict[str, Any] = {}
    for name, value in body.items():
        field = fields[name]
        if value is None:
            if field.nullable:
                continue
            raise bad_request(f"{name} must not be null")
        values[name] = check_value(name, field, value)
    return values


def check_value(name: str, field: Field, value: Any) -> Any:
    """One value checked against its field; see :func:`read_object`."""
    kind = field.type
    if kind == "string":
        if not isinstance(value, str):
            raise bad_request(f"{name} must be a string, not {_json_type(value)}")
        if field.name and value.strip():
            check_name(name, value)
        elif field.trim:
            value = value.strip()
        if field.enum is not None:
            if value not in field.enum:
                raise bad_request(f"{name} must be one of {', '.join(field.enum)}")
        elif not value.strip():
            raise bad_request(f"{name} must not be empty or only whitespace")
        if field.min_length is not None and len(value) < field.min_length:
            raise bad_request(f"{name} must have at least {field.min_length} characters")
        if field.max_length is not None and len(value) > field.max_length:
            raise bad_request(f"{name} must be at most {field.max_length} characters long")
        # fullmatch: with re.search, "$" would also match before a final line break.
        if field.pattern is not None and not re.fullmatch(field.pattern, value):
            raise bad_request(f"{name} must match the pattern {field.pattern}")
        return value
    if kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{name} must be an integer, not {_json_type(value)}")
        if field.minimum is not None and value < field.minimum:
            raise bad_request(f"{name} must be at least {field.minimum}")
        if field.maximum is not None and value > field.maximum:
            raise bad_request(f"{name} must be at most {field.maximum}")
        return value
    if kind == "boolean":
        if not isinstance(value, bool):
            raise bad_request(f"{name} must be true or false, not {_json_type(value)}")
        return value
    if kind == "array":
        if not isinstance(value, list):
            raise bad_request(f"{name} must be a JSON array, not {_json_type(value)}")
        return value
    if kind == "object":
        if not isinstance(value, dict):
            raise bad_request(f"{name} must be a JSON object, not {_json_type(value)}")
        return value
    if kind == "datetime":
        if not isinstance(value, str):
            raise bad_request(f"{name} must be an ISO 8601 date-time string")
        return parse_datetime(name, value)
    raise AssertionError(f"unknown field type {kind}")  # pragma: no cover


def parse_datetime(name: str, text: str) -> dt.datetime:
    """An ISO 8601 date-time, timezone-aware (UTC when it has no offset).

    Raises:
      ApiError: 400 when it does not parse.
    """
    try:
        value = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise bad_request(
            f"{name} must be an ISO 8601 date-time such as 2030-01-31T12:00:00Z, not {text!r}"
        ) from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    try:
        value.astimezone(dt.timezone.utc)
    except OverflowError:
        raise bad_request(f"{name} is out of the supported date range") from None
    return value


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


class Query:
    """The query parameters of one request, read with bounds.

    Parameters:
      req(falcon.Request): the request.
      allowed(Iterable[str]): the parameters the endpoint knows; any other is a 400, so a
        misspelt filter is reported instead of silently ignored.
    """

    def __init__(self, req: falcon.Request, allowed: Iterable[str]) -> None:
        self.params = req.params
        allowed = list(allowed)
        unknown = sorted(set(self.params) - set(allowed))
        if unknown:
            known = ", ".join(allowed) if allowed else "none"
            raise bad_request(
                f"unknown query parameter(s) {', '.join(map(repr, unknown))}; this endpoint "
                f"takes {known}"
            )

    def text(self, name: str) -> str | None:
        value = self.params.get(name)
        if value is None:
            return None
        if isinstance(value, list):
            raise bad_request(f"give the query parameter {name} once")
        _check_text(value, f"query parameter {name}")
        return value

    def integer(self, name: str, default: int, minimum: int, maximum: int) -> int:
        raw = self.text(name)
        if raw is None or raw == "":
            return default
        # ASCII digits only: int() would also take "+5", "1_000" and other scripts' digits.
        digits = raw.strip()
        value = int(digits) if _INTEGER_RE.fullmatch(digits) and len(digits) <= 20 else None
        if value is None or not minimum <= value <= maximum:
            raise bad_request(f"{name} must be an integer from {minimum} to {maximum}, not {raw!r}")
        return value

    def choice(self, name: str, choices: Iterable[str]) -> str | None:
        raw = self.text(name)
        if raw is None or raw == "":
            return None
        choices = tuple(choices)
        if raw not in choices:
            raise bad_request(f"{name} must be one of {', '.join(choices)}, not {raw!r}")
        return raw

    def uuid(self, name: str) -> str | None:
        raw = self.text(name)
        if raw is None or raw == "":
            return None
        return parse_uuid(raw, name)

    def datetime(self, name: str) -> dt.datetime | None:
        raw = self.text(name)
        if raw is None or raw == "":
            return None
        return parse_datetime(name, raw)


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
