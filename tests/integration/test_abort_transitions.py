"""The abort in the job state machine, against real PostgreSQL: what an operator's abort does
to a job in each state, and how every other exit from ``running`` treats a job whose abort
was requested (never retried, never requeued, never enqueued again)."""

from __future__ import annotations

import datetime as dt
import uuid

import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker.errors import InvalidTransition, JobAlreadyFinished, JobNotFound
from dramatiq_pg_broker.jobs import Attempt, JobStore, NewJob, abort_payload, channel_name


def new_job(store: JobStore, queue: str | None = None, **fields) -> str:
    job_id = str(uuid.uuid4())
    queue = queue or f"q_{uuid.uuid4().hex[:8]}"
    store.enqueue(
        NewJob(
            id=job_id,
            queue_name=queue,
            actor_name="tests.a",
            message={},
            **{"max_attempts": 21, **fields},
        )
    )
    return job_id


def running(store: JobStore, lease: float = 60, **fields) -> Attempt:
    job_id = new_job(store, **fields)
    queue = store.get(job_id)["queue_name"]
    (claimed,) = store.claim(queue, 1, "worker-1", lease)
    return Attempt(job_id, "worker-1", claimed.attempts)


def types(store: JobStore, job_id: str) -> list[tuple[str, str | None]]:
    return [(e["type"], e["actor"]) for e in store.events_of(job_id)]


def test_a_queued_or_delayed_job_is_cancelled_at_once(store):
    for delay in (0, 3_600_000):
        job_id = new_job(store, delay_ms=delay)
        job = store.abort(job_id, by="ops@example.com")
        assert job["status"] == "cancelled" and job["finished_at"] is not None
        assert job["abort_requested_by"] == "ops@example.com"
        assert types(store, job_id) == [("created", None), ("aborted", "ops@example.com")]


def test_a_running_job_is_marked_and_its_queue_is_told(store, pg_url, schema):
    attempt = running(store)
    queue = store.get(attempt.id)["queue_name"]
    with psycopg.connect(pg_url, autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(schema, queue))))
        job = store.abort(attempt.id, by="first")
        payloads = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
    assert payloads == [abort_payload(attempt.id)]
    assert job["status"] == "running" and job["locked_by"] == "worker-1"
    assert job["abort_requested_by"] == "first" and job["abort_requested_at"] is not None
    # A second request keeps the first one's author, and is on the timeline too.
    assert store.abort(attempt.id, by="second")["abort_requested_by"] == "first"
    assert types(store, attempt.id)[-2:] == [
        ("abort_requested", "first"),
        ("abort_requested", "second"),
    ]
    # The heartbeat's renewal reports it (the fallback without NOTIFY).
    renewal = store.renew_leases([attempt], 60)
    assert renewal.owned == {attempt.id} and renewal.abort_requested == {attempt.id}


def test_the_worker_ends_an_aborted_attempt_cancelled_naming_who_asked(store):
    attempt = running(store)
    stranger = running(store)
    store.abort(attempt.id, by="ops")
    # Only an attempt whose abort was requested, and only by its owner.
    assert store.abort_attempts([stranger]) == set()
    assert store.abort_attempts([attempt._replace(owner="worker-2")]) == set()
    assert store.abort_attempts([attempt]) == {attempt.id}
    job = store.get(attempt.id)
    assert (job["status"], job["locked_by"], job["locked_until"]) == ("cancelled", None, None)
    last = store.events_of(attempt.id)[-1]
    assert (last["type"], last["actor"], last["data"]) == ("aborted", "ops", {"worker": "worker-1"})
    assert store.get(stranger.id)["status"] == "running"


def test_a_finished_or_missing_job_cannot_be_aborted(store):
    done = running(store)
    store.complete([done])
    with pytest.raises(InvalidTransition, match="only queued or running jobs can be aborted"):
        store.abort(done.id, by="ops")
    with pytest.raises(JobNotFound):
        store.abort(str(uuid.uuid4()), by="ops")
    assert [t for t, _ in types(store, done.id)] == ["created", "claimed", "succeeded"]


def test_a_failure_after_the_abort_was_requested_is_not_retried(store):
    attempt = running(store)
    store.abort(attempt.id, by="ops")
    queue = store.get(attempt.id)["queue_name"]
    assert store.reschedule(attempt, queue, 100, "ValueError: boom")
    job = store.get(attempt.id)
    assert job["status"] == "cancelled" and job["last_error"] == "ValueError: boom"
    last = store.events_of(attempt.id)[-1]
    assert (last["type"], last["actor"]) == ("aborted", "ops")
    assert last["data"] == {"worker": "worker-1", "error": "ValueError: boom"}


def test_a_last_failure_after_the_abort_was_requested_ends_the_job_cancelled(store):
    # The worker had not learned of the request (its notice was still on the way) and
    # took the failure for a dead letter: the row knows better.
    attempt = running(store)
    plain = running(store)
    store.abort(attempt.id, by="ops")
    assert store.fail([attempt, plain], ["ValueError: boom", "KeyError: k"]) == {
        attempt.id,
        plain.id,
    }
    job = store.get(attempt.id)
    assert (job["status"], job["last_error"], job["failures"]) == (
        "cancelled",
        "ValueError: boom",
        1,
    )
    last = store.events_of(attempt.id)[-1]
    assert (last["type"], last["actor"]) == ("aborted", "ops")
    assert last["data"] == {"worker": "worker-1", "error": "ValueError: boom"}
    assert store.get(plain.id)["status"] == "failed"
    assert types(store, plain.id)[-1] == ("failed", "worker-1")
    # With events off (DRAMATIQ_PG_EVENTS=false), the failure's event is not written; the
    # abort's is, as every operator action's.
    quiet = running(store)
    store.abort(quiet.id, by="ops")
    store.events = False
    try:
        assert store.fail([quiet], ["ValueError: quiet"]) == {quiet.id}
    finally:
        store.events = True
    assert types(store, quiet.id)[-1] == ("aborted", "ops")
    # A retry of the statement whose reply was lost finds it written.
    assert store.finished_attempts([attempt, plain], ("failed", "cancelled")) == {
        attempt.id,
        plain.id,
    }


def test_the_reaper_cancels_an_aborted_job_whose_worker_died(store):
    attempt = running(store, lease=0.001)
    assert store.start([attempt], 0.001) == {attempt.id}
    store.abort(attempt.id, by="ops")
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=5)
    result = store.reap(
        batch=100, backoff_ms=[1], max_interruptions=5, lease_seconds=0.001, now=later
    )
    assert attempt.id in result.aborted and attempt.id not in result.requeued
    assert store.get(attempt.id)["status"] == "cancelled"
    last = store.events_of(attempt.id)[-1]
    assert (last["type"], last["actor"]) == ("aborted", "ops")
    assert last["data"] == {"worker": "worker-1", "reason": "lease expired"}


def test_an_aborted_job_is_never_enqueued_again(store):
    attempt = running(store)
    store.abort(attempt.id, by="ops")
    job = store.get(attempt.id)
    again = NewJob(
        id=attempt.id,
        queue_name=job["queue_name"],
        actor_name="tests.a",
        message={},
        max_attempts=21,
    )
    with pytest.raises(JobAlreadyFinished, match="being aborted"):
        store.enqueue(again)
    assert store.get(attempt.id)["status"] == "running"


def test_a_claim_marks_a_job_an_older_worker_requeued_after_its_abort(store, pg_url, schema):
    attempt = running(store)
    store.abort(attempt.id, by="ops")
    # What a worker of the previous release does: its retry ignores the request.
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "UPDATE {}.jobs SET status = 'queued', locked_by = NULL, locked_until = NULL,"
                " started = false WHERE id = %s"
            ).format(sql.Identifier(schema)),
            (attempt.id,),
        )
    queue = store.get(attempt.id)["queue_name"]
    (claimed,) = store.claim(queue, 5, "worker-2", 60)
    assert claimed.id == attempt.id and claimed.abort_requested


def test_a_manual_retry_forgets_an_old_abort_request(store, pg_url, schema):
    attempt = running(store)
    store.abort(attempt.id, by="ops")
    # The actor failed for good before its worker stopped it. That ends the job cancelled
    # now; earlier versions ended it failed, the request kept on the row.
    assert store.fail([attempt], ["boom"]) == {attempt.id}
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {}.jobs_history SET status = 'failed' WHERE id = %s").format(
                sql.Identifier(schema)
            ),
            (attempt.id,),
        )
    job = store.retry_failed(attempt.id, by="ops")
    assert job["status"] == "queued" and job["abort_requested_at"] is None
    (claimed,) = store.claim(job["queue_name"], 1, "worker-2", 60)
    assert not claimed.abort_requested


def test_the_abort_columns_go_together(store, pg_url, schema):
    job_id = new_job(store)
    with (
        psycopg.connect(pg_url, autocommit=True) as conn,
        pytest.raises(psycopg.errors.CheckViolation),
    ):
        conn.execute(
            sql.SQL("UPDATE {}.jobs SET abort_requested_at = now() WHERE id = %s").format(
                sql.Identifier(schema)
            ),
            (job_id,),
        )
