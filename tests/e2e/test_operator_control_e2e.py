"""Operator control with real ``dramatiq`` worker processes: an aborted running job ends
cancelled when its thread leaves the actor (a busy loop within 2 s; a thread blocked in
``time.sleep`` when the call returns, the job running until then) and never runs again; an
aborted queued job never runs; a paused queue holds across two worker processes and drains
after its resume; the workers register themselves and the actors they declare, and the
admin API refuses a job for an actor none declared."""

from __future__ import annotations

import signal
import time

import pytest

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.control import queues as queue_control
from dramatiq_pg_broker.control.workers import list_workers
from tests.integration.admin_support import CSRF, AdminEnv

from .worker_actors import PAUSABLE, QUEUE, create_executions_table, declare
from .workers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def broker(pg_url, schema):
    broker = PostgresBroker(url=pg_url, schema=schema)
    yield broker
    broker.close()


@pytest.fixture(scope="module")
def actors(broker):
    return declare(broker)


@pytest.fixture
def executions(conn, schema):
    create_executions_table(conn, schema)

    def rows(job_id: str) -> list[tuple[int, str]]:
        return conn.execute(
            f'SELECT attempt, phase FROM "{schema}".executions WHERE job_id = %s ORDER BY id',
            (job_id,),
        ).fetchall()

    yield rows
    conn.execute(f'DROP TABLE "{schema}".executions')


def status(broker, job_id: str) -> str:
    return broker.store.get(job_id)["status"]


@pytest.mark.parametrize(("actor", "seconds"), [("nap", 3), ("spin", 30)])
def test_an_aborted_running_job_ends_cancelled_when_its_thread_leaves_and_never_runs_again(
    broker, actors, executions, start_worker, actor, seconds
):
    worker = start_worker()
    job_id = actors[actor].send(seconds).message_id
    wait_for(lambda: executions(job_id), 60, "the job starting", on_timeout=worker.log_tail)

    asked = time.monotonic()
    broker.store.abort(job_id, by="ops@example.com")
    # A busy loop is interrupted at its next instruction; no exception interrupts a sleep,
    # so that job runs (its abort requested) until the call returns.
    wait_for(
        lambda: status(broker, job_id) == "cancelled",
        2 if actor == "spin" else seconds + 2,
        f"the {actor} job cancelled within 2 s of its thread leaving the actor",
        on_timeout=worker.log_tail,
    )
    took = time.monotonic() - asked
    events = broker.store.events_of(job_id)
    assert [(e["type"], e["actor"]) for e in events][-2:] == [
        ("abort_requested", "ops@example.com"),
        ("aborted", "ops@example.com"),
    ]
    # Never again: a sentinel job sent after it runs and finishes on the same worker (one
    # queue, in order), and a retry would have run before it (backoff 100 ms).
    sentinel = actors["quick"].send().message_id
    wait_for(
        lambda: status(broker, sentinel) == "succeeded",
        30,
        "a later job of the queue finishing",
        on_timeout=worker.log_tail,
    )
    if actor == "nap":
        # Cancelled once the sleep returned (its rest: the 3 s less the start's notice).
        assert took > 1.5, f"cancelled {took:.2f}s after the abort, its thread still asleep"
    else:
        assert took < 2
    assert executions(job_id) == [(1, "start")], "the aborted job ran again or went on"
    assert status(broker, job_id) == "cancelled"


def test_an_aborted_queued_job_never_runs(broker, actors, executions, start_worker):
    aborted = actors["quick"].send_with_options(args=(0,), delay=1500).message_id
    after = actors["quick"].send_with_options(args=(0,), delay=2000).message_id
    job = broker.store.abort(aborted, by="ops")
    assert job["status"] == "cancelled"
    worker = start_worker()
    wait_for(
        lambda: status(broker, after) == "succeeded",
        60,
        "the job due after it running",
        on_timeout=worker.log_tail,
    )
    assert executions(aborted) == []
    assert status(broker, aborted) == "cancelled"


def test_a_paused_queue_holds_across_two_workers_and_drains_after_resume(
    broker, actors, executions, start_worker, conn, schema
):
    first, second = start_worker(), start_worker()
    wait_for(
        lambda: len(list_workers(conn, schema)) >= 2,
        60,
        "both worker processes registered",
        on_timeout=lambda: first.log_tail() + "\n" + second.log_tail(),
    )
    queue_control.pause(conn, schema, PAUSABLE, by="ops@example.com")
    sent = [actors["tick"].send().message_id for _ in range(20)]  # accepted while paused
    # Ten seconds of two idle workers, each claiming every poll interval (0.2 s): nothing.
    time.sleep(10)  # the span the pause must hold, not a wait for a result
    assert all(status(broker, job_id) == "queued" for job_id in sent)
    assert not any(executions(job_id) for job_id in sent)
    state = queue_control.get(conn, schema, PAUSABLE)
    assert state.paused and state.paused_by == "ops@example.com"

    resumed = time.monotonic()
    queue_control.resume(conn, schema, PAUSABLE, by="ops@example.com")
    wait_for(
        lambda: all(status(broker, job_id) == "succeeded" for job_id in sent),
        10,
        "the queue drained after its resume",
        on_timeout=lambda: first.log_tail() + "\n" + second.log_tail(),
    )
    assert time.monotonic() - resumed < 5


def test_workers_register_and_the_api_takes_only_their_actors(
    broker, executions, pg_url, schema, conn, start_worker
):
    earlier = {w["id"] for w in list_workers(conn, schema)}  # other tests' workers
    worker = start_worker()
    registered = wait_for(
        lambda: [w for w in list_workers(conn, schema) if w["id"] not in earlier],
        60,
        "the worker's registration",
        on_timeout=worker.log_tail,
    )
    assert QUEUE in registered[0]["queues"] and PAUSABLE in registered[0]["queues"]
    assert "nap" in registered[0]["actors"]
    api = AdminEnv(pg_url, schema, admin_adhoc_actors=False)
    try:
        created = api.post(
            "/api/jobs", "member", headers=CSRF, json={"actor_name": "nap", "args": [0]}
        )
        assert created.status_code == 201, created.text
        assert created.json["queue_name"] == QUEUE
        refused = api.post("/api/jobs", "member", headers=CSRF, json={"actor_name": "napp"})
        assert refused.status_code == 400
        assert "no worker has declared an actor named 'napp'" in refused.json["message"]
    finally:
        api.close()
    # The job the API created runs: the worker is fully up (its signals handled).
    wait_for(
        lambda: status(broker, created.json["id"]) == "succeeded",
        30,
        "the API's job running",
        on_timeout=worker.log_tail,
    )
    worker.signal(signal.SIGTERM)  # a clean exit deregisters
    assert worker.wait(30) == 0
    # Deleted, not merely expired (its lease is two seconds here).
    rows = conn.execute(
        f'SELECT id FROM "{schema}".workers WHERE id = ANY(%s)', ([w["id"] for w in registered],)
    ).fetchall()
    assert rows == [], "the worker's row outlived its clean exit"
