"""Bad messages are dead-lettered with their error, never dropped."""

from __future__ import annotations

import uuid

import dramatiq

from dramatiq_pg_broker.jobs import Attempt, NewJob


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
               message=message.asdict(), max_attempts=21)
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
        NewJob(
            id=job_id,
            queue_name=queue,
            actor_name="known",
            message_bytes=b"\x80\x04garbage",
            max_attempts=21,
        )
    )

    broker.start_worker()
    broker.join(queue, timeout=15_000)

    row = broker.store.get(job_id)
    assert row["status"] == "failed"
    assert row["last_error"].startswith("cannot decode message: DecodeError")


def test_a_batch_of_failures_keeps_each_error_with_its_job(broker):
    queue = f"dl_{uuid.uuid4().hex[:8]}"
    ids = sorted(str(uuid.uuid4()) for _ in range(4))
    for job_id in ids:
        broker.store.enqueue(
            NewJob(
                id=job_id, queue_name=queue, actor_name="a", message={"args": []}, max_attempts=21
            )
        )
    attempts = [
        Attempt(job.id, "owner", job.attempts) for job in broker.store.claim(queue, 4, "owner", 30)
    ]
    # Given in reverse id order: the store sorts attempts by id and must keep the pairing.
    attempts.sort(key=lambda a: a.id, reverse=True)

    failed = broker.store.fail(attempts, [f"error of {a.id}" for a in attempts])

    assert failed == set(ids)
    for job_id in ids:
        assert broker.store.get(job_id)["last_error"] == f"error of {job_id}"


def test_a_stored_message_with_an_eta_option_runs_instead_of_being_acked(broker):
    queue = f"dl_{uuid.uuid4().hex[:8]}"
    ran = []
    dramatiq.actor(lambda: ran.append(1), actor_name="eta_actor", queue_name=queue, broker=broker)
    job_id = str(uuid.uuid4())
    message = dramatiq.Message(
        queue_name=queue, actor_name="eta_actor", args=(), kwargs={},
        options={"eta": 0}, message_id=job_id,
    )  # fmt: skip
    # Written around enqueue (which strips eta), as another tool might.
    broker.store.enqueue(
        NewJob(
            id=job_id,
            queue_name=queue,
            actor_name="eta_actor",
            message=message.asdict(),
            max_attempts=21,
        )
    )

    broker.start_worker()
    broker.join(queue, timeout=15_000)

    assert ran == [1]
    assert broker.store.get(job_id)["status"] == "succeeded"
