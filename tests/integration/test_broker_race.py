"""Concurrency: 3 processes x 8 threads race to claim 5,000 jobs.

Every thread has its own connection and all of them are released together by one barrier.
Every tenth job is rescheduled once, so jobs are raced for on a second attempt too.
Afterwards: each (job, attempt) was claimed by exactly one thread, attempts are gapless,
every job ended succeeded exactly once, and the event log agrees with the claims.
"""

from __future__ import annotations

import collections
import datetime as dt
import multiprocessing
import queue as queue_module
import threading
import time
import uuid

import psycopg
import pytest

from dramatiq_pg_broker import Attempt, JobStore, Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.jobs import NewJob

PROCESSES = 3
THREADS = 8
JOBS = 5000
#: Jobs whose number is a multiple of this fail their first attempt and run again.
RESCHEDULE_EVERY = 10
#: The whole race must finish within this many seconds.
DEADLINE = 120


def _store(url: str, schema: str) -> JobStore:
    # The racing threads pass their own connections; the pool serves only the schema
    # handshake of their first statements, so two connections are plenty.
    return JobStore(ProcessPool(Settings(url=url, schema=schema, pool_max_size=2)), schema)


def _claimer(url, store, queue_name, reschedule, barrier, results, thread_no, proc_no, stop_at):
    """One racing thread: claim small batches, reschedule some first attempts, complete the
    rest, until the queue has nothing left. Records (job id, attempt, owner) per claim."""
    owner = f"p{proc_no}:t{thread_no}"
    claims: list[tuple[str, int, str]] = []
    lost: list[tuple[str, int]] = []
    try:
        _claim_until_empty(
            url, store, queue_name, reschedule, barrier, owner, claims, lost, stop_at
        )
    except BaseException as e:  # reported, so the test says what broke instead of hanging
        results.put((owner, claims, lost, f"{type(e).__name__}: {e}"))
    else:
        results.put((owner, claims, lost, None))


def _claim_until_empty(url, store, queue_name, reschedule, barrier, owner, claims, lost, stop_at):
    with psycopg.connect(url, autocommit=True) as conn:
        barrier.wait(timeout=60)
        empty_in_a_row = 0
        while time.time() < stop_at:
            jobs = store.claim(queue_name, 5, owner, 300, conn=conn)
            if not jobs:
                # Rescheduled jobs come back runnable at once; a few empty looks in a row
                # mean the queue is drained.
                empty_in_a_row += 1
                if empty_in_a_row >= 5:
                    break
                time.sleep(0.01)
                continue
            empty_in_a_row = 0
            done = []
            for job in jobs:
                claims.append((job.id, job.attempts, owner))
                attempt = Attempt(job.id, owner, job.attempts)
                if job.attempts == 1 and job.id in reschedule:
                    if not store.reschedule(
                        attempt, queue_name, 0, "first attempt fails", conn=conn
                    ):
                        lost.append((job.id, job.attempts))
                else:
                    done.append(attempt)
            owned = store.complete(done, conn=conn)
            lost.extend((a.id, a.attempt) for a in done if a.id not in owned)


def _process(url, schema, queue_name, reschedule, barrier, results, proc_no, stop_at):
    # One store per process, as a worker has: its threads pass their own connections, so
    # the store's pool stays nearly idle (a store per thread held a pool each: 3 x 8 pools
    # beside the 24 racing connections, most of a 100-connection server).
    store = _store(url, schema)
    threads = [
        threading.Thread(
            target=_claimer,
            args=(url, store, queue_name, reschedule, barrier, results, t, proc_no, stop_at),
        )
        for t in range(THREADS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.pool.close()


@pytest.fixture
def filled_queue(pg_url, schema):
    queue_name = f"race_{uuid.uuid4().hex[:8]}"
    store = _store(pg_url, schema)
    ids = [str(uuid.uuid4()) for _ in range(JOBS)]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        with conn.transaction():
            for n, job_id in enumerate(ids):
                store.enqueue(
                    NewJob(
                        id=job_id,
                        queue_name=queue_name,
                        actor_name="race",
                        message={"n": n},
                        max_attempts=3,
                    ),
                    conn=conn,
                )
    reschedule = frozenset(ids[::RESCHEDULE_EVERY])
    yield queue_name, ids, reschedule
    store.pool.close()


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE + 60)
def test_every_job_is_claimed_once_per_attempt_and_succeeds_once(pg_url, schema, filled_queue):
    queue_name, ids, reschedule = filled_queue
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES * THREADS)
    results = ctx.Queue()
    stop_at = time.time() + DEADLINE
    procs = [
        ctx.Process(
            target=_process,
            args=(pg_url, schema, queue_name, reschedule, barrier, results, p, stop_at),
        )
        for p in range(PROCESSES)
    ]
    started = time.monotonic()
    for p in procs:
        p.start()

    reports = []
    try:
        while len(reports) < PROCESSES * THREADS:
            remaining = DEADLINE + 30 - (time.monotonic() - started)
            try:
                reports.append(results.get(timeout=min(max(remaining, 0.1), 1.0)))
                continue
            except queue_module.Empty:
                pass
            if remaining <= 0 or not any(p.is_alive() for p in procs):
                pytest.fail(
                    f"only {len(reports)} of {PROCESSES * THREADS} racing threads reported "
                    f"within {DEADLINE + 30}s: a claim hung or a process died "
                    f"(exit codes {[p.exitcode for p in procs]})"
                )
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    elapsed = time.monotonic() - started
    assert all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}"
    assert elapsed < DEADLINE, f"the race took {elapsed:.0f}s, over its {DEADLINE}s bound"

    claims_of = collections.defaultdict(list)
    lost = []
    threads_that_claimed = set()
    errors = [f"{owner}: {error}" for owner, _, _, error in reports if error]
    assert not errors, f"racing threads failed: {errors[:5]}"
    for owner, claims, owner_lost, _ in reports:
        lost.extend(owner_lost)
        for job_id, attempt, claimed_by in claims:
            claims_of[(job_id, attempt)].append(claimed_by)
            threads_that_claimed.add(owner)
    double = {k: v for k, v in claims_of.items() if len(v) > 1}
    assert not double, f"{len(double)} attempts claimed by more than one thread, e.g. " + str(
        list(double.items())[:3]
    )
    assert not lost, f"a thread lost ownership of attempts it claimed: {lost[:5]}"
    expected = {(i, 1) for i in ids} | {(i, 2) for i in reschedule}
    assert set(claims_of) == expected, (
        f"{len(expected - set(claims_of))} expected attempts never claimed, "
        f"{len(set(claims_of) - expected)} unexpected ones"
    )
    # With 24 threads racing, more than one of them must have won some jobs.
    assert len(threads_that_claimed) > 1, "one thread claimed everything: there was no race"

    with psycopg.connect(pg_url, autocommit=True) as conn:
        statuses = dict(
            conn.execute(
                f'SELECT status, count(*) FROM "{schema}".all_jobs WHERE queue_name = %s '
                "GROUP BY status",
                (queue_name,),
            ).fetchall()
        )
        assert statuses == {"succeeded": JOBS}, f"end states: {statuses}"
        attempts = dict(
            conn.execute(
                f'SELECT attempts, count(*) FROM "{schema}".all_jobs WHERE queue_name = %s '
                "GROUP BY attempts",
                (queue_name,),
            ).fetchall()
        )
        assert attempts == {1: JOBS - len(reschedule), 2: len(reschedule)}, attempts
        events = conn.execute(
            f"""
            SELECT e.job_id::text, e.type, e.attempt, e.actor
            FROM "{schema}".job_events e JOIN "{schema}".all_jobs j ON j.id = e.job_id
            WHERE j.queue_name = %s AND e.type IN ('claimed', 'succeeded', 'retry_scheduled')
            """,
            (queue_name,),
        ).fetchall()
    claimed_events = collections.Counter((j, a) for j, t, a, _ in events if t == "claimed")
    assert set(claimed_events) == expected and set(claimed_events.values()) == {1}, (
        "the claimed events disagree with the claims the threads saw"
    )
    claimed_by = {(j, a): actor for j, t, a, actor in events if t == "claimed"}
    assert claimed_by == {k: v[0] for k, v in claims_of.items()}, (
        "an event names a different owner than the thread that claimed the attempt"
    )
    succeeded = collections.Counter(j for j, t, _, _ in events if t == "succeeded")
    assert len(succeeded) == JOBS and set(succeeded.values()) == {1}, (
        "some job has no succeeded event or more than one"
    )
    retried = collections.Counter(j for j, t, _, _ in events if t == "retry_scheduled")
    assert set(retried) == set(reschedule) and set(retried.values()) == {1}


REAPERS = 8
EXPIRED = 600


@pytest.mark.timeout(120)
def test_concurrent_reapers_requeue_each_expired_job_exactly_once(pg_url, schema):
    """Every worker process runs the reaper: eight at once, each with its own connection
    and a small batch, must requeue every expired attempt once and only once."""
    queue_name = f"reap_{uuid.uuid4().hex[:8]}"
    store = _store(pg_url, schema)
    clock = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    ids = [str(uuid.uuid4()) for _ in range(EXPIRED)]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for job_id in ids:
            store.enqueue(
                NewJob(
                    id=job_id, queue_name=queue_name, actor_name="a", message={}, max_attempts=21
                ),
                conn=conn,
            )
        claimed = store.claim(queue_name, EXPIRED, "dead-worker", 1, conn=conn, now=clock)
        # Started: each is an interrupted attempt once its lease expires.
        attempts = [Attempt(job.id, "dead-worker", job.attempts) for job in claimed]
        assert len(store.start(attempts, 1, conn=conn, now=clock)) == EXPIRED
    assert len(claimed) == EXPIRED

    barrier = threading.Barrier(REAPERS)
    reaped: list[list[str]] = [[] for _ in range(REAPERS)]
    errors: list[str] = []
    later = clock + dt.timedelta(seconds=10)

    def reaper(n):
        try:
            with psycopg.connect(pg_url, autocommit=True) as conn:
                barrier.wait(timeout=30)
                while True:
                    result = store.reap(
                        batch=25,
                        backoff_ms=[0],
                        max_interruptions=10,
                        lease_seconds=1,
                        conn=conn,
                        now=later,
                    )
                    if not result.requeued and not result.failed:
                        return
                    reaped[n].extend(result.requeued + result.failed)
        except Exception as e:  # reported below
            errors.append(f"reaper {n}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=reaper, args=(n,)) for n in range(REAPERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a reaper hung"
    assert not errors, errors
    everything = [job_id for part in reaped for job_id in part]
    dupes = [j for j, c in collections.Counter(everything).items() if c > 1]
    assert not dupes, f"{len(dupes)} jobs were reaped by two reapers"
    assert sorted(everything) == sorted(ids), "some expired job was not reaped"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        counts = dict(
            conn.execute(
                f"""SELECT e.type, count(*) FROM "{schema}".job_events e
                    JOIN "{schema}".all_jobs j ON j.id = e.job_id
                    WHERE j.queue_name = %s AND e.type = 'timeout_requeued'
                    GROUP BY e.type""",
                (queue_name,),
            ).fetchall()
        )
        statuses = conn.execute(
            f'SELECT status, attempts, count(*) FROM "{schema}".all_jobs WHERE queue_name = %s '
            "GROUP BY status, attempts",
            (queue_name,),
        ).fetchall()
    assert counts == {"timeout_requeued": EXPIRED}
    assert statuses == [("queued", 1, EXPIRED)]
    store.pool.close()
