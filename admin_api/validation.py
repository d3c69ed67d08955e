"""What a client may send: JSON bodies are :class:`Body` models, query parameters
:class:`Params` models (an operation declares them, :mod:`admin_api.operations` reads the
request with them). Every failure is a 400 whose message names the field and says what it
must be.

A model is the only declaration of a body or of an endpoint's parameters: pydantic
validates the request with it, and the OpenAPI document (:mod:`admin_api.openapi`) takes
the schema from it, so the document cannot drift from what the API accepts. What is this
API's own is here: the sentences of its errors (pydantic's are translated, see
:func:`_explain`), names refused rather than stripped, blank strings, date-times without
an offset read as UTC, integers in ASCII digits. What PostgreSQL cannot store is refused
as the body is read (:func:`admin_api.operations.check_json_value`).
"""

from __future__ import annotations

import datetime as dt
import re
import typing
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import pydantic
from pydantic import AfterValidator, BeforeValidator, StringConstraints, WithJsonSchema
from pydantic_core import PydanticCustomError

from .errors import bad_request

_INTEGER_RE = re.compile(r"-?[0-9]+")
#: A UUID in ASCII: 32 hex digits with or without hyphens, in braces or as a URN.
_UUID_RE = re.compile(r"(?:urn:uuid:)?\{?[0-9a-fA-F-]{32,36}\}?", re.ASCII)

B = TypeVar("B", bound="Body")


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


def _validator(read: Callable[[Any], tuple[Any, str | None]]) -> Callable[[Any], Any]:
    """A validator from ``read``, which returns the value read and what is wrong with it."""

    def validate(value: Any) -> Any:
        read_value, problem = read(value)
        if problem is not None:
            raise _problem(problem)
        return read_value

    return validate


def refuse(where: str, read: Callable[[str], tuple[Any, str | None]], raw: str) -> Any:
    """``raw`` read with ``read``, or a 400 saying what is wrong with ``where``."""
    value, problem = read(raw)
    if problem is not None:
        raise bad_request(f"{where} {problem}")
    return value


def _name(value: Any) -> Any:
    return _validator(read_name)(_not_blank(value))


def _strip(value: Any) -> Any:
    return value.strip() if isinstance(value, str) else value


#: What a name may not contain: control characters (C0, DEL, C1; tabs and line breaks
#: among them) and the line and paragraph separators.
_NAME_FORBIDDEN_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def read_name(value: Any) -> tuple[Any, str | None]:
    """A name (an actor's, a queue's), and what is wrong with it: whitespace at either
    end, a control character or a line or paragraph separator. Such a name is a mistake or
    a disguise, and stripping it would store a name the client did not send."""
    bad = _NAME_FORBIDDEN_RE.search(value) if isinstance(value, str) else None
    if bad is not None:
        return value, (
            "must not contain control characters, tabs, line breaks or line or paragraph "
            f"separators; it has U+{ord(bad.group()):04X} at position {bad.start()}"
        )
    if isinstance(value, str) and value != value.strip():
        return value, "must not begin or end with whitespace: send the name alone"
    return value, None


def _read_datetime(text: Any) -> tuple[Any, str | None]:
    """``text`` as a timezone-aware date-time, and what is wrong with it."""
    if not isinstance(text, str):
        return None, "must be an ISO 8601 date-time string"
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


def read_uuid(raw: str) -> tuple[Any, str | None]:
    """``raw`` as a UUID in its canonical text form, and what is wrong with it."""
    # ASCII hex only: uuid.UUID() reads the digits with int(), which also takes other
    # scripts' digits ("\u0663" for "3"), "_" and "+", so that another spelling would find
    # a job.
    if _UUID_RE.fullmatch(raw):
        try:
            return str(uuid.UUID(raw)), None
        except ValueError:
            pass
    shown = raw if len(raw) <= 60 else raw[:60] + "..."
    return None, f"must be a UUID such as 6f1c1f9e-6a43-4f7e-9b1f-0a5a1c6e2d3b, not {shown!r}"


#: Not only whitespace, in the document's words. Each type's validator says what is wrong
#: first: placed after the constraints, it runs before them, and the constraints (their
#: pattern too) are in the document.
_NOT_BLANK = r"\S"
#: A string, whitespace at either end stripped, that may not be empty.
Text = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, pattern=_NOT_BLANK),
    BeforeValidator(_not_blank),
]
#: A string taken as sent (a password), that may not be empty or only whitespace.
Secret = Annotated[
    str, StringConstraints(min_length=1, pattern=_NOT_BLANK), BeforeValidator(_not_blank)
]
#: A name (an actor's, a queue's): whitespace at either end, control characters (tabs and
#: line breaks included) and the line and paragraph separators U+2028 and U+2029 are
#: refused, never stripped, so that the name stored is the name sent, and two names that
#: look alike are not made one. A field of this type without a pattern of its own gives
#: :data:`NAME_PATTERN` (a type's pattern would replace the field's in the validation).
Name = Annotated[str, BeforeValidator(_name), StringConstraints(min_length=1)]
#: A name's ends, in the document's words (``.`` takes no line break); its description
#: says the rest.
NAME_PATTERN = r"^\S(.*\S)?$"
#: An ISO 8601 date-time (in a body or a query string); without an offset it is UTC.
DateTime = Annotated[dt.datetime, BeforeValidator(_validator(_read_datetime))]


def choice(values: tuple[str, ...]) -> Any:
    """A string that is one of ``values`` (whitespace at either end stripped)."""
    return Annotated[Literal[values], BeforeValidator(_strip)]  # type: ignore[valid-type]


def check_body(model: type[B], body: Any, what: str = "the body") -> B:
    """Check a parsed body against ``model``.

    Returns:
      Body: the body, strings trimmed (not a :data:`Secret` or a :data:`Name`), datetimes
      parsed and made timezone-aware; :func:`given` has the fields the client gave.

    Raises:
      ApiError: 400 for a body that is not an object, an unknown or missing field, or a
        value of the wrong type or out of range.
    """
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
    "too_short": "must have at least {min_length} characters",
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
    """The query parameters of an endpoint, declared once: the operation reads them with
    the model, the OpenAPI document lists them from it. A parameter given empty is
    absent. Its types are the ``Query*`` ones below: a query parameter is text, and each
    says how it becomes a value (or a 400 naming the parameter)."""

    model_config = pydantic.ConfigDict(strict=True, frozen=True)


def _query_int(value: Any) -> Any:
    # ASCII digits only: int() would also take "+5", "1_000" and other scripts' digits.
    digits = value.strip()
    if _INTEGER_RE.fullmatch(digits) and len(digits) <= 20:
        return int(digits)
    return value  # not an integer: the int schema refuses it


#: An integer, in ASCII digits; bound it with ``Field(ge=..., le=...)``.
QueryInt = Annotated[int, BeforeValidator(_query_int)]
#: A name to filter by (see :func:`read_name`); bound it with ``Field(max_length=...)``.
QueryName = Annotated[str, AfterValidator(_validator(read_name))]
#: A UUID, in its canonical text form.
QueryUuid = Annotated[
    str,
    BeforeValidator(_validator(read_uuid)),
    WithJsonSchema({"type": "string", "format": "uuid"}),
]


def explain_param(name: str, field: Any, error: dict, raw: str) -> str:
    """pydantic's ``error`` of the query parameter ``name`` (sent as ``raw``), as a sentence."""
    if error["type"] == "literal_error":
        return f"{name} must be one of {', '.join(_literals(field.annotation))}, not {raw!r}"
    if error["type"] in ("int_type", "greater_than_equal", "less_than_equal"):
        bounds = {
            key: getattr(m, key) for m in field.metadata for key in ("ge", "le") if hasattr(m, key)
        }
        return f"{name} must be an integer from {bounds['ge']} to {bounds['le']}, not {raw!r}"
    return f"{name} {_sentence(error, field)}"
