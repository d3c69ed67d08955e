"""kill -9 of a real ``dramatiq`` worker process in the middle of a job.

Another worker finishes the job once its lease expires; no job is lost, and none runs twice
except what was in flight in the killed process (started there, outcome not yet written).
"""

from __future__ import annotations

import collections
import os
import signal

import pytest

from .worker_actors import QUEUE
from .workers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

QUICK_JOBS = 20


def test_kill_9_mid_job_loses_nothing_and_reruns_only_what_was_in_flight(
    schema, conn, start_worker, recorded_actors
):
    broker, actors = recorded_actors
    hung = actors["hang_first"].send(120)
    quick = [actors["quick"].send(0.2) for _ in range(QUICK_JOBS)]
    ids = [hung.message_id] + [m.message_id for m in quick]

    def executions():
        return conn.execute(
            f'SELECT job_id::text, attempt, pid, phase FROM "{schema}".executions ORDER BY id'
        ).fetchall()

    def statuses():
        rows = conn.execute(
            f'SELECT id::text, status, locked_by FROM "{schema}".all_jobs WHERE queue_name = %s',
            (QUEUE,),
        ).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    first = start_worker()
    started = wait_for(
        lambda: [e for e in executions() if e[0] == hung.message_id and e[3] == "start"],
        60,
        "the hanging job to start",
        on_timeout=first.log_tail,
    )
    victim_pid = started[0][2]
    assert victim_pid != first.pid, "the job should run in the forked worker process"
    _wait_for_recorded_start(conn, schema, hung.message_id, first)
    # Wait for recorded outcomes, not just finished actors: an ack is written one round
    # trip after its actor returns, and the kill must land after a few of them.
    wait_for(
        lambda: sum(1 for s, _ in statuses().values() if s == "succeeded") >= 3,
        30,
        "a few quick jobs to succeed beside it",
        on_timeout=first.log_tail,
    )

    os.kill(victim_pid, signal.SIGKILL)
    wait_for(lambda: _gone(victim_pid), 10, "the killed process to disappear")
    # The dead process writes nothing more: this is what it left behind.
    at_kill = statuses()
    ran_in_victim = {e[0] for e in executions() if e[2] == victim_pid and e[3] == "start"}
    in_flight = {
        job_id
        for job_id, (status, owner) in at_kill.items()
        if status == "running" and job_id in ran_in_victim
    }
    assert hung.message_id in in_flight
    states = collections.Counter(status for status, _ in at_kill.values())
    assert states["succeeded"] >= 3 and states["queued"] + states["running"] >= 2, (
        f"the kill should land mid-stream, with jobs done and jobs left: {states}"
    )
    assert at_kill[hung.message_id][1].split(":")[1] == str(victim_pid), (
        "the lease owner id should name the worker process"
    )
    # The main dramatiq process notices its worker died and stops.
    first.wait(20)

    second = start_worker()
    wait_for(
        lambda: all(s == "succeeded" for s, _ in statuses().values()),
        60,
        "every job to succeed after the crash",
        on_timeout=lambda: (
            f"{collections.Counter(s for s, _ in statuses().values())}\n" + second.log_tail()
        ),
    )
    second.signal(signal.SIGTERM)
    assert second.wait(30) == 0, second.log_tail()

    final = statuses()
    assert set(final) == set(ids) and {s for s, _ in final.values()} == {"succeeded"}
    starts = collections.Counter(e[0] for e in executions() if e[3] == "start")
    finishes = collections.Counter(e[0] for e in executions() if e[3] == "finish")
    for job_id in ids:
        allowed = 2 if job_id in in_flight else 1
        assert 1 <= starts[job_id] <= allowed, (
            f"job {job_id} started {starts[job_id]} times (in flight at the kill: "
            f"{job_id in in_flight})"
        )
        assert finishes[job_id] >= 1
    rerun = {job_id for job_id in ids if starts[job_id] == 2}
    assert hung.message_id in rerun

    # The hung job: attempt 1 died with its process, the reaper requeued it once its lease
    # expired, and attempt 2 ran in the other worker.
    row = broker.store.get(hung.message_id)
    assert row["attempts"] == 2
    events = broker.store.events_of(hung.message_id)
    types = [(e["type"], e["attempt"]) for e in events]
    assert types[:3] == [("created", 0), ("claimed", 1), ("timeout_requeued", 1)], types
    assert types[-2:] == [("claimed", 2), ("succeeded", 2)], types
    second_run = [e for e in executions() if e[0] == hung.message_id and e[1] == 2]
    assert second_run and all(e[2] != victim_pid for e in second_run)


PREFETCH = 10


def test_kill_9_with_a_full_prefetch_of_unstarted_messages_charges_none_of_them(
    schema, conn, start_worker, recorded_actors
):
    """One thread busy with a hanging job, the rest of the prefetch claimed and waiting:
    kill -9. The waiting messages never started, so they go back uncharged; only the job
    that was running counts an interruption (not a failure)."""
    broker, actors = recorded_actors
    hung = actors["hang_first"].send(120)
    waiting = [actors["quick"].send(0.0) for _ in range(PREFETCH - 1)]
    waiting_ids = {m.message_id for m in waiting}

    def rows():
        return {
            r[0]: r[1:]
            for r in conn.execute(
                f"""SELECT id::text, status, locked_by, attempts, failures, interruptions
                    FROM "{schema}".all_jobs WHERE queue_name = %s""",
                (QUEUE,),
            ).fetchall()
        }

    def starts():
        return conn.execute(
            f"""SELECT job_id::text, attempt, pid FROM "{schema}".executions
                WHERE phase = 'start' ORDER BY id"""
        ).fetchall()

    first = start_worker(threads=1, dramatiq_queue_prefetch=str(PREFETCH))
    started = wait_for(
        lambda: [e for e in starts() if e[0] == hung.message_id],
        60,
        "the hanging job to start",
        on_timeout=first.log_tail,
    )
    victim_pid = started[0][2]
    _wait_for_recorded_start(conn, schema, hung.message_id, first)
    wait_for(
        lambda: all(
            r[0] == "running" and r[1].split(":")[1] == str(victim_pid)
            for job_id, r in rows().items()
            if job_id in waiting_ids
        ),
        30,
        "the whole prefetch to be claimed by the worker process",
        on_timeout=first.log_tail,
    )
    assert not waiting_ids & {e[0] for e in starts()}, "a waiting message started"

    os.kill(victim_pid, signal.SIGKILL)
    wait_for(lambda: _gone(victim_pid), 10, "the killed process to disappear")
    first.wait(20)

    second = start_worker(threads=2)
    wait_for(
        lambda: all(r[0] == "succeeded" for r in rows().values()),
        60,
        "every job to succeed after the crash",
        on_timeout=second.log_tail,
    )
    second.signal(signal.SIGTERM)
    assert second.wait(30) == 0, second.log_tail()

    final = rows()
    for job_id in waiting_ids:
        status, _, attempts, failures, interruptions = final[job_id]
        assert (attempts, failures, interruptions) == (1, 0, 0), (
            f"job {job_id}, claimed but never started by the killed worker, was charged: "
            f"attempts={attempts} failures={failures} interruptions={interruptions}"
        )
        types = [e["type"] for e in broker.store.events_of(job_id)]
        assert types == ["created", "claimed", "released", "claimed", "succeeded"], types
    ran = collections.Counter(e[0] for e in starts())
    assert all(ran[job_id] == 1 for job_id in waiting_ids), ran
    _, _, attempts, failures, interruptions = final[hung.message_id]
    assert (attempts, failures, interruptions) == (2, 0, 1), "the running job is an interruption"


def test_a_message_that_kills_its_worker_at_once_ends_failed(
    schema, conn, start_worker, recorded_actors
):
    """A poison message kills its worker process the moment it starts, before the worker
    has written the start. That first death leaves an abandoned claim, given back
    uncharged; from then on the start is written before the actor runs, so every later
    death is an interruption, and the job fails once they reach the bound (2 here)."""
    _, actors = recorded_actors
    poison = actors["die_at_once"].send()

    def job():
        return conn.execute(
            f"""SELECT status, attempts, failures, interruptions, abandoned_claims, last_error
                FROM "{schema}".all_jobs WHERE id = %s""",
            (poison.message_id,),
        ).fetchone()

    deaths = 0
    while job()[0] != "failed":
        assert deaths < 4, f"the poison message is still {job()} after {deaths} deaths"
        worker = start_worker(threads=1, DRAMATIQ_PG_MAX_INTERRUPTIONS="2")
        # Each worker either dies running the message, or (the last one) reaps the job
        # that the previous death left at its bound and stays up.
        wait_for(
            lambda w=worker: w.proc.poll() is not None or job()[0] == "failed",
            90,
            "the worker to die of the poison message, or the job to fail",
            on_timeout=worker.log_tail,
        )
        if job()[0] == "failed":
            worker.signal(signal.SIGTERM)
            assert worker.wait(30) == 0, worker.log_tail()
            break
        worker.wait(20)
        deaths += 1
    status, attempts, failures, interruptions, abandoned, error = job()
    runs = conn.execute(
        f'SELECT count(*) FROM "{schema}".executions WHERE job_id = %s', (poison.message_id,)
    ).fetchone()[0]
    assert (status, failures, interruptions) == ("failed", 0, 2), job()
    # Only the first death can come before the start was written (usually it does).
    assert abandoned <= 1 and runs == deaths == interruptions + abandoned, (job(), runs, deaths)
    assert "interrupted 2 times (the limit)" in error


def _wait_for_recorded_start(conn, schema: str, job_id: str, worker) -> None:
    """A worker writes an attempt's start a moment after its actor began; only from then
    on does its death count as an interruption."""
    wait_for(
        lambda: conn.execute(
            f'SELECT started FROM "{schema}".all_jobs WHERE id = %s', (job_id,)
        ).fetchone()[0],
        30,
        "the worker to record the start",
        on_timeout=worker.log_tail,
    )


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie until its parent reaps it: dead for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
