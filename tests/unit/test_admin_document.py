"""The OpenAPI document says what the API does: a value it allows is accepted, one it
refuses is refused, and a value an answer may hold is allowed. No database: the document
and the models alone (the integration tests check every real answer against it)."""

from __future__ import annotations

import re

import pytest

from admin_api import openapi
from admin_api.errors import ApiError
from admin_api.operations import operations
from admin_api.validation import check_body

DOCUMENT = openapi.build()


def _schemas(value, where="#"):
    """Every schema in the document, with where it is."""
    if isinstance(value, dict):
        if "type" in value or "enum" in value:
            yield where, value
        for key, child in value.items():
            yield from _schemas(child, f"{where}/{key}")
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _schemas(child, f"{where}/{index}")


def test_a_nullable_value_with_an_enum_allows_null_in_it():
    """A nullable field's ``enum`` lists null too, or a validator refuses every null the
    API answers (``"source": null`` when a queue has no limit)."""
    nullable = [
        (where, schema)
        for where, schema in _schemas(DOCUMENT)
        if isinstance(schema.get("type"), list) and "null" in schema["type"] and "enum" in schema
    ]
    assert nullable, "no nullable enum left to check: the test lost its subject"
    for where, schema in nullable:
        assert None in schema["enum"], where


def _bodies():
    """(operation, body model) of every documented operation that reads a body."""
    from admin_api.app import API

    for resource in API:
        for method, op in operations(resource).items():
            if op.documented and op.body is not None:
                yield f"{method} {resource.route}", op.body


#: A valid body of each model, to change one field at a time.
VALID = {
    "JobRequest": {"actor_name": "tests.noop"},
    "LoginRequest": {"email": "a@b.c", "password": "correct horse"},
    "UserRequest": {"email": "a@b.c", "password": "correct horse", "role": "viewer"},
    "UserUpdate": {"active": True},
    "TokenRequest": {"name": "ci"},
    "LimitRequest": {"limit": 3},
    "ActionRequest": {},
}


def _accepted(model, body) -> bool:
    try:
        check_body(model, body)
    except ApiError:
        return False
    return True


@pytest.mark.parametrize(
    ("label", "model"), list(_bodies()), ids=lambda v: getattr(v, "__name__", v)
)
def test_a_bodys_documented_bounds_are_the_ones_it_is_checked_with(label, model):
    """At each bound the document gives a field (minLength, maxLength, minimum, maximum),
    the value on the bound is accepted and the one past it refused."""
    schema = openapi.body_schema(model)
    checked = 0
    for name, field in schema["properties"].items():
        variants = field.get("anyOf", [field])
        for variant in variants:
            for bound, inside, outside in (
                ("minLength", lambda n: "x" * n, lambda n: "x" * (n - 1)),
                ("maxLength", lambda n: "x" * n, lambda n: "x" * (n + 1)),
                ("minimum", lambda n: n, lambda n: n - 1),
                ("maximum", lambda n: n, lambda n: n + 1),
            ):
                if bound not in variant:
                    continue
                value = variant[bound]
                # A pattern the bound's value does not match refuses it whatever its length.
                if "pattern" in variant and not re.search(variant["pattern"], inside(value)):
                    continue
                body = VALID[model.__name__]
                assert _accepted(model, {**body, name: inside(value)}), (label, name, bound)
                assert not _accepted(model, {**body, name: outside(value)}), (label, name, bound)
                checked += 1
    if model.__name__ in ("UserRequest", "UserUpdate"):
        assert schema["properties"]["password"]["minLength"] == 8
        assert checked
