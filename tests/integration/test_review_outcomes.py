"""Outcomes that cannot be written as they are never leave a job running forever."""

from __future__ import annotations

import time

import dramatiq
import pytest

from .test_broker_retries import Harness


@pytest.fixture
def h(pg_url, schema):
    harness = Harness(pg_url, schema)
    yield harness
    harness.close()


def wait_for_status(broker, job_id, status, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = broker.store.get(job_id)
        if row["status"] == status:
            return row
        time.sleep(0.05)
    return broker.store.get(job_id)


def test_an_error_text_with_a_nul_character_is_dead_lettered(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def boom():
        raise ValueError("bad\x00bytes")

    message = boom.send()
    h.start(broker, threads=1)
    row = wait_for_status(broker, message.message_id, "failed")
    assert row["status"] == "failed"
    assert "ValueError" in row["last_error"]
    assert broker.outcomes.flush(timeout=5)


def test_a_retry_with_a_nul_character_in_its_error_is_rescheduled(h):
    broker = h.broker()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=1, min_backoff=10)
    def boom():
        raise ValueError("bad\x00bytes")

    message = boom.send()
    h.start(broker, threads=1)
    broker.join(h.queue, timeout=15_000)
    row = broker.store.get(message.message_id)
    assert (row["status"], row["attempts"]) == ("failed", 2)
    types = [e["type"] for e in broker.store.events_of(message.message_id)]
    assert "retry_scheduled" in types
