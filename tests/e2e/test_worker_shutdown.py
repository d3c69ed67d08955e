"""SIGTERM to a real ``dramatiq`` worker: the jobs in flight finish, the prefetched ones go
back to queued at once with their attempts unchanged, and nothing is lost."""

from __future__ import annotations

import collections
import signal

import pytest

from .worker_actors import QUEUE
from .workers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: Long enough that SIGTERM lands while they run.
SLOW_SECONDS = 3


def test_sigterm_finishes_in_flight_jobs_and_releases_prefetched_ones(
    schema, conn, start_worker, recorded_actors
):
    broker, actors = recorded_actors
    # Claim order and Dramatiq's work queue both put the slow actor (priority 0) before the
    # quick one (priority 10): two worker threads take the slow jobs, and the quick jobs
    # claimed with them wait in the worker's memory (prefetched).
    slow = [actors["slow"].send(SLOW_SECONDS) for _ in range(2)]
    quick = [actors["quick"].send() for _ in range(6)]

    def jobs():
        rows = conn.execute(
            f'SELECT id::text, status, attempts, locked_by FROM "{schema}".all_jobs '
            "WHERE queue_name = %s",
            (QUEUE,),
        ).fetchall()
        return {r[0]: r[1:] for r in rows}

    def starts():
        rows = conn.execute(
            f"SELECT job_id::text, pid FROM \"{schema}\".executions WHERE phase = 'start'"
        ).fetchall()
        return collections.Counter(r[0] for r in rows)

    worker = start_worker(threads=2)
    wait_for(
        lambda: set(starts()) == {m.message_id for m in slow},
        60,
        "both slow jobs to start",
        on_timeout=worker.log_tail,
    )
    prefetched = wait_for(
        lambda: [m.message_id for m in quick if jobs()[m.message_id][0] == "running"],
        10,
        "quick jobs to be prefetched beside the slow ones",
        on_timeout=worker.log_tail,
    )
    assert not set(starts()) & {m.message_id for m in quick}

    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.log_tail()

    after = jobs()
    for m in slow:
        status, attempts, owner = after[m.message_id]
        assert (status, attempts, owner) == ("succeeded", 1, None), (
            f"in-flight job {m.message_id} did not finish: {after[m.message_id]}"
        )
    released = set()
    for m in quick:
        status, attempts, owner = after[m.message_id]
        assert (status, attempts, owner) == ("queued", 0, None), (
            f"prefetched or waiting job {m.message_id} is {after[m.message_id]}, "
            "expected back in the queue with no attempt charged"
        )
        events = [(e["type"], e["attempt"]) for e in broker.store.events_of(m.message_id)]
        claims = [e for e in events if e[0] == "claimed"]
        releases = [e for e in events if e[0] == "released"]
        assert len(claims) == len(releases), f"claimed but never given back: {events}"
        assert all(attempt == 0 for _, attempt in releases), events
        if releases:
            released.add(m.message_id)
        row = broker.store.get(m.message_id)
        assert row["available_at"] <= row["updated_at"], "released jobs must be runnable at once"
    assert set(prefetched) <= released, "a prefetched job was not released at shutdown"
    assert not set(starts()) & {m.message_id for m in quick}, "a quick job ran at shutdown"

    # Nothing was lost: another worker runs the released jobs, each exactly once.
    second = start_worker(threads=2)
    wait_for(
        lambda: {s for s, _, _ in jobs().values()} == {"succeeded"},
        60,
        "the released jobs to run",
        on_timeout=second.log_tail,
    )
    second.signal(signal.SIGTERM)
    assert second.wait(30) == 0, second.log_tail()
    assert starts() == {m.message_id: 1 for m in slow + quick}
    assert {a for _, a, _ in jobs().values()} == {1}
