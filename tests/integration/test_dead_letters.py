"""Bad messages are dead-lettered with their error, never dropped."""

from __future__ import annotations

import uuid

import dramatiq
import pytest

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.jobs import NewJob


@pytest.fixture
def broker(pg_url, schema):
    previous = dramatiq.broker.global_broker
    broker = PostgresBroker(url=pg_url, schema=schema, poll_interval=0.1)
    worker = None

    def start():
        nonlocal worker
        worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
        worker.start()

    broker.start_worker = start
    yield broker
    if worker is not None:
        worker.stop(timeout=10_000)
    broker.close()
    dramatiq.broker.global_broker = previous


def test_a_message_for_an_undeclared_actor_is_dead_lettered(broker):
    queue = f"dl_{uuid.uuid4().hex[:8]}"
    dramatiq.actor(lambda: None, actor_name="known", queue_name=queue, broker=broker)
    job_id = str(uuid.uuid4())
    message = dramatiq.Message(
        queue_name=queue, actor_name="nobody.declares.me", args=(), kwargs={}, options={},
        message_id=job_id,
    )  # fmt: skip
    broker.store.enqueue(
        NewJob(id=job_id, queue_name=queue, actor_name=message.actor_name,
               message=message.asdict())
    )  # fmt: skip

    broker.start_worker()
    broker.join(queue, timeout=15_000)

    row = broker.store.get(job_id)
    assert row["status"] == "failed"
    assert "ActorNotFound" in row["last_error"] and "nobody.declares.me" in row["last_error"]
    assert [e["type"] for e in broker.store.events_of(job_id)][-1] == "failed"


def test_a_message_that_cannot_be_decoded_is_dead_lettered(broker):
    queue = f"dl_{uuid.uuid4().hex[:8]}"
    dramatiq.actor(lambda: None, actor_name="known", queue_name=queue, broker=broker)
    job_id = str(uuid.uuid4())
    # Bytes that the JSON encoder in use cannot read.
    broker.store.enqueue(
        NewJob(id=job_id, queue_name=queue, actor_name="known", message_bytes=b"\x80\x04garbage")
    )

    broker.start_worker()
    broker.join(queue, timeout=15_000)

    row = broker.store.get(job_id)
    assert row["status"] == "failed"
    assert row["last_error"].startswith("cannot decode message: DecodeError")
