"""The admin API's job detail shows what the results backend stored for the job: its result,
or its stored failure, until the result expires."""

from __future__ import annotations

import time
import uuid

import pytest
from dramatiq.encoder import PickleEncoder
from dramatiq.message import Message

from dramatiq_pg_broker.results import PostgresBackend


@pytest.fixture
def backend(pg_url, schema):
    backend = PostgresBackend(url=pg_url, schema=schema)
    yield backend
    backend.close()


def message_of(job_id: str) -> Message:
    return Message(
        queue_name="default", actor_name="work", args=(), kwargs={}, options={}, message_id=job_id
    )


def detail(env, job_id):
    response = env.get(f"/api/jobs/{job_id}")
    assert response.status_code == 200, response.text
    return response.json


def test_a_job_without_a_stored_result_shows_none(env):
    job_id = env.enqueue(queue=f"q{uuid.uuid4().hex[:8]}")
    assert detail(env, job_id)["result"] is None


def test_the_stored_result_is_shown(env, backend):
    job_id = env.enqueue(queue=f"q{uuid.uuid4().hex[:8]}")
    backend.store_result(message_of(job_id), {"total": 42}, 60_000)
    result = detail(env, job_id)["result"]
    assert result["failed"] is False
    assert result["value"] == {"total": 42}
    assert result["expires_at"]


def test_a_stored_failure_is_shown_with_its_type_and_message(env, backend):
    job_id = env.enqueue(queue=f"q{uuid.uuid4().hex[:8]}")
    backend.store_exception(message_of(job_id), KeyError("customer"), 60_000)
    result = detail(env, job_id)["result"]
    assert result["failed"] is True
    assert result["error"] == {"type": "KeyError", "message": "'customer'"}


def test_an_expired_result_is_no_longer_shown(env, backend):
    job_id = env.enqueue(queue=f"q{uuid.uuid4().hex[:8]}")
    backend.store_result(message_of(job_id), 1, 1)
    time.sleep(0.01)
    assert detail(env, job_id)["result"] is None


def test_a_pickled_result_is_shown_as_binary(env, pg_url, schema):
    backend = PostgresBackend(url=pg_url, schema=schema, encoder=PickleEncoder())
    try:
        job_id = env.enqueue(queue=f"q{uuid.uuid4().hex[:8]}")
        backend.store_result(message_of(job_id), {1, 2}, 60_000)
        result = detail(env, job_id)["result"]
        assert result["encoding"] == "binary" and "value" not in result
    finally:
        backend.close()
