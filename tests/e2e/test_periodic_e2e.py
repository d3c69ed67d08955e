"""A 1-second schedule in three real ``dramatiq`` worker processes: one job per tick, and no
tick lost across a restart of every worker (the catch-up policy)."""

from __future__ import annotations

import datetime as dt
import signal

import psycopg

from .workers import wait_for

APP = "tests.e2e.periodic_app"
SECOND = dt.timedelta(seconds=1)


def tick_jobs(pg_url: str, schema: str) -> list[tuple[dt.datetime, int, str]]:
    """(tick, missed, status) of every job the schedule enqueued, in tick order."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(
            f"SELECT (message -> 'options' -> 'periodic' ->> 'tick')::timestamptz, "
            f"(message -> 'options' -> 'periodic' ->> 'missed')::int, status "
            f"FROM {schema}.all_jobs WHERE actor_name = 'every_second' ORDER BY 1"
        ).fetchall()
    return [(r[0], r[1], r[2]) for r in rows]


def server_now(pg_url: str) -> dt.datetime:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        return conn.execute("SELECT now()").fetchone()[0]


def started(worker) -> bool:
    return "Scheduler started" in worker.log_path.read_text(errors="replace")


def ticks_with_all_up(pg_url, schema, workers, ticks: int, what: str, logs):
    """Wait until the schedulers of ``workers`` all started, then until ``ticks`` ticks
    passed after that; return the moment all were up and the tick jobs so far (ticks
    with one job each: a doubled tick would be a second row with the same tick)."""
    wait_for(lambda: all(started(w) for w in workers), 90, what, on_timeout=logs)
    all_up = server_now(pg_url)
    wait_for(
        lambda: sum(t > all_up for t, _, _ in tick_jobs(pg_url, schema)) >= ticks,
        60,
        f"{ticks} ticks with {what} up",
        on_timeout=logs,
    )
    jobs = tick_jobs(pg_url, schema)
    ticks_seen = [t for t, _, _ in jobs]
    assert len(ticks_seen) == len(set(ticks_seen)), f"a tick has two jobs: {ticks_seen}"
    return all_up, jobs


def test_three_workers_one_job_per_tick_and_no_tick_lost_across_a_restart(
    start_worker, pg_url, schema
):
    workers = [start_worker(app=APP, threads=1) for _ in range(3)]

    def logs():
        return "\n".join(w.log_tail(15) for w in workers)

    all_up, before = ticks_with_all_up(pg_url, schema, workers, 11, "the 3 schedulers", logs)

    # Exactly one job per tick while the three ran: consecutive seconds, none missing, none
    # doubled.
    ticks = [t for t, _, _ in before]
    live = [t for t in ticks if t > all_up]
    assert len(live) >= 11
    assert all(b - a == SECOND for a, b in zip(ticks, ticks[1:])), f"a tick is missing: {ticks}"
    assert all(t.microsecond == 0 for t in ticks)
    assert all(missed == 1 for _, missed, _ in before)

    # Every worker stops; ticks come and go with nobody to enqueue them.
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(60) == 0, worker.log_tail()
    stopped_after = max(t for t, _, _ in tick_jobs(pg_url, schema))
    wait_for(lambda: server_now(pg_url) >= stopped_after + 4 * SECOND, 30, "4 ticks with no worker")

    restarted = [start_worker(app=APP, threads=1) for _ in range(3)]
    workers = restarted
    _, jobs = ticks_with_all_up(pg_url, schema, restarted, 5, "the 3 restarted schedulers", logs)
    ticks = [t for t, _, _ in jobs]
    # A job for tick t standing for `missed` ticks covers t - missed + 1 .. t. Under the
    # catch-up policy every tick from the first to the last is covered: none was lost.
    covered = set()
    for tick, missed, _ in jobs:
        covered.update(tick - k * SECOND for k in range(missed))
    first, last = ticks[0], ticks[-1]
    expected = {first + k * SECOND for k in range(int((last - first) / SECOND) + 1)}
    assert expected <= covered, f"ticks lost: {sorted(expected - covered)}"
    gap = [j for j in jobs if stopped_after < j[0] and j[1] > 1]
    assert gap, f"no catch-up job for the ticks missed after {stopped_after}: {jobs}"
    assert gap[0][1] >= 4, f"the catch-up job stands for too few ticks: {gap}"

    # The jobs are ordinary jobs: the workers ran them.
    wait_for(
        lambda: all(s == "succeeded" for _, _, s in tick_jobs(pg_url, schema)[:-2]),
        60,
        "the tick jobs to run",
        on_timeout=logs,
    )
