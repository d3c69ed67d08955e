"""The admin API's bodies and query parameters are pydantic models; a bad value is a 400
whose sentence is the API's own (pydantic's errors translated), never pydantic's wording
or a 500. No database: the models alone."""

from __future__ import annotations

import pytest
from falcon import testing

from admin_api.errors import ApiError
from admin_api.operations import read_query
from admin_api.resources.dashboard import ThroughputParams
from admin_api.resources.events import FeedParams
from admin_api.resources.jobs import ActionRequest, JobListParams, JobRequest
from admin_api.resources.sessions import LoginRequest
from admin_api.resources.users import TokenRequest, UserRequest, UserUpdate
from admin_api.validation import Body, check_body, given

BODIES = (JobRequest, ActionRequest, LoginRequest, UserRequest, UserUpdate, TokenRequest)
#: A valid body of each model, to break one field at a time.
VALID = {
    JobRequest: {"actor_name": "tests.noop"},
    ActionRequest: {},
    LoginRequest: {"email": "a@b.c", "password": "correct horse"},
    UserRequest: {"email": "a@b.c", "password": "correct horse", "role": "viewer"},
    UserUpdate: {},
    TokenRequest: {"name": "ci"},
}
#: Values of every JSON type: each field refuses some of them.
JSON_VALUES = (None, True, 1, 1.5, "", " ", "x" * 300, [], {}, "2030-01-01", "\n x")


def _message(model: type[Body], body) -> str | None:
    try:
        check_body(model, body)
    except ApiError as e:
        assert e.status_code == 400, e.status
        return e.description
    return None


@pytest.mark.parametrize("model", BODIES, ids=lambda m: m.__name__)
def test_every_refused_value_is_said_in_the_apis_own_words(model):
    for name in model.model_fields:
        for value in JSON_VALUES:
            message = _message(model, {**VALID[model], name: value})
            if message is None:
                continue
            assert message.startswith(f"{name} "), (name, value, message)
            assert "is not valid" not in message and "Input should" not in message, message


def test_the_sentences_name_what_was_wrong():
    assert _message(JobRequest, {"actor_name": "a", "priority": True}) == (
        "priority must be an integer, not a boolean"
    )
    assert _message(JobRequest, {"actor_name": "a", "priority": None}) == (
        "priority must not be null"
    )
    assert _message(JobRequest, {"actor_name": "a\t"}).startswith(
        "actor_name must not contain control characters"
    )
    assert _message(UserRequest, {**VALID[UserRequest], "role": "root"}) == (
        "role must be one of viewer, operator, admin, member"
    )
    # Unknown fields first, then missing ones, then the first bad value as sent.
    assert _message(JobRequest, {"priority": "x", "force": 1}).startswith(
        "the body has unknown field(s) 'force'; the fields are actor_name, queue_name"
    )
    assert _message(JobRequest, {"priority": "x"}) == (
        "the body lacks the required field(s) actor_name"
    )
    assert _message(JobRequest, {"delay": -1, "actor_name": "a", "priority": "x"}) == (
        "delay must be at least 0"
    )
    assert _message(ActionRequest, []) == "the body must be a JSON object, not an array"


def test_null_means_not_given_and_strings_are_trimmed_but_names_and_passwords_are_not():
    body = check_body(JobRequest, {"actor_name": "a", "delay": None, "idempotency_key": " k "})
    assert given(body) == {"actor_name": "a", "args": [], "kwargs": {}, "idempotency_key": "k"}
    assert check_body(LoginRequest, {"email": " a@b.c ", "password": " pw "}).password == " pw "
    assert check_body(UserRequest, {**VALID[UserRequest], "role": " admin "}).role == "admin"
    at = check_body(JobRequest, {"actor_name": "a", "available_at": "2030-01-01T00:00"})
    assert at.available_at.tzinfo is not None


def _query(model, query: str):
    req = testing.create_req(query_string=query)
    try:
        return read_query(req, model)
    except ApiError as e:
        return e.description


@pytest.mark.parametrize(
    ("model", "query", "words"),
    [
        (JobListParams, "limit=0", "limit must be an integer from 1 to 100, not '0'"),
        (JobListParams, "limit=%2B5", "limit must be an integer from 1 to 100, not '+5'"),
        (JobListParams, "status=stopped", "status must be one of ready, delayed, paused"),
        (JobListParams, "queue=a%0A", "queue must not contain control characters"),
        (JobListParams, "limit=1&limit=2", "give the query parameter limit once"),
        (JobListParams, "page=2", "unknown query parameter(s) 'page'; this endpoint takes limit"),
        (FeedParams, "job_id=42", "job_id must be a UUID such as"),
        (ThroughputParams, "minutes=1441", "minutes must be an integer from 1 to 1440"),
        (None, "x=1", "unknown query parameter(s) 'x'; this endpoint takes none"),
    ],
)
def test_query_parameters_are_read_with_their_model(model, query, words):
    assert words in _query(model, query)


def test_query_parameters_have_their_defaults_and_values():
    params = _query(JobListParams, "limit=&status=failed&created_after=2030-01-01")
    assert (params.limit, params.offset, params.status) == (25, 0, "failed")
    assert params.created_after.tzinfo is not None
    feed = _query(FeedParams, "job_id=6F1C1F9E6A434F7E9B1F0A5A1C6E2D3B")
    assert feed.job_id == "6f1c1f9e-6a43-4f7e-9b1f-0a5a1c6e2d3b"
