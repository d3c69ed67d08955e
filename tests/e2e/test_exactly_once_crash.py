"""Exactly-once effects under SIGKILL: jobs whose one database write commits with their
success (``current_job().complete_in()``), run by real ``dramatiq`` processes that are
killed at random moments and started again.

Each kill leaves attempts in flight: some with the effect written and not committed (the
server rolls it back with the dead connection), some committed just before the kill (the
job is done; its row is gone from the jobs table, so the reaper finds nothing to give
back). The expired leases of the others are reaped and their jobs run again. At the end
every job has succeeded, and the application's table holds exactly one row per job.
"""

from __future__ import annotations

import random
import time

import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker

from .exactly_once_actors import ISOLATION_ENV, QUEUE, TABLE, create_table, declare
from .workers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

JOBS = 500
#: Kills before the test lets the workers finish in peace.
KILLS = 8
#: Each actor holds its transaction open up to this long after its write, and runs up to
#: this long after its commit.
HOLD_MS = 40


@pytest.mark.parametrize("level", ["READ_COMMITTED", "REPEATABLE_READ"])
def test_kill_9_at_random_moments_leaves_exactly_one_effect_per_job(
    pg_url, schema, conn, start_worker, level
):
    """At REPEATABLE READ each block pins the job's row first and holds it FOR KEY SHARE
    until its commit, its lease not renewed meanwhile: a kill must still leave one effect
    per job, and the reaper must give back what the kills left."""
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(schema, TABLE)))
    conn.execute(
        sql.SQL("TRUNCATE {0}.jobs, {0}.jobs_history, {0}.job_keys CASCADE").format(
            sql.Identifier(schema)
        )
    )
    create_table(conn, schema)
    broker = PostgresBroker(url=pg_url, schema=schema)
    actor = declare(broker)
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    ids = {
        m.message_id for m in broker.enqueue_many([actor.message(n, HOLD_MS) for n in range(JOBS)])
    }
    assert len(ids) == JOBS

    def statuses() -> dict[str, int]:
        rows = conn.execute(
            f'SELECT status, count(*) FROM "{schema}".all_jobs WHERE queue_name = %s '
            "GROUP BY status",
            (QUEUE,),
        ).fetchall()
        return dict(rows)

    def start(i: int):
        return start_worker(
            app="tests.e2e.exactly_once_app",
            threads=4,
            DRAMATIQ_PG_MAX_INTERRUPTIONS="100",
            **{ISOLATION_ENV: level},
        )

    began = time.monotonic()
    workers = [start(0), start(1)]
    wait_for(
        lambda: statuses().get("succeeded", 0) >= 20,
        60,
        "the workers to start running jobs",
        on_timeout=lambda: workers[0].log_tail(),
    )
    kills = []
    for _ in range(KILLS):
        # Each kill lands while both processes work: after some progress since the last.
        target = min(JOBS, statuses().get("succeeded", 0) + 20)
        wait_for(
            lambda target=target: statuses().get("succeeded", 0) >= target,
            60,
            "the workers to make progress",
            on_timeout=lambda: f"statuses: {statuses()}, seed {seed}\n{workers[0].log_tail()}",
        )
        time.sleep(rng.uniform(0, 0.5))
        done = statuses().get("succeeded", 0)
        if done >= JOBS:
            break
        victim = rng.randrange(len(workers))
        workers[victim].kill_group()
        kills.append(done)
        workers[victim] = start(victim)
    wait_for(
        lambda: statuses().get("succeeded", 0) >= JOBS,
        90,
        "every job to succeed",
        on_timeout=lambda: f"statuses: {statuses()}, seed {seed}\n{workers[0].log_tail()}",
    )
    elapsed = time.monotonic() - began

    table = sql.Identifier(schema, TABLE)
    count, distinct = conn.execute(
        sql.SQL("SELECT count(*), count(DISTINCT job_id) FROM {}").format(table)
    ).fetchone()
    context = f"(seed {seed}, {len(kills)} kills at {kills} jobs done, {elapsed:.1f}s)"
    assert statuses() == {"succeeded": JOBS}, f"{statuses()} {context}"
    assert (count, distinct) == (JOBS, JOBS), (
        f"{count} effects for {distinct} jobs: each job must have exactly one {context}"
    )
    effect_ids = {str(r[0]) for r in conn.execute(sql.SQL("SELECT job_id FROM {}").format(table))}
    assert effect_ids == ids, f"effects of unknown or missing jobs {context}"
    # The second check: a unique constraint on the job id holds over the table as it is.
    conn.execute(
        sql.SQL("ALTER TABLE {} ADD CONSTRAINT one_effect_per_job UNIQUE (job_id)").format(table)
    )
    succeeded_events = conn.execute(
        f'SELECT job_id, count(*) FROM "{schema}".job_events WHERE type = %s '
        "AND job_id = ANY(%s::uuid[]) GROUP BY job_id HAVING count(*) <> 1",
        ("succeeded", list(ids)),
    ).fetchall()
    assert not succeeded_events, f"jobs with other than one succeeded event {context}"
    # The kills hit work in flight: some jobs were claimed again after their lease expired
    # (an attempt whose start was not written yet goes back uncharged, so the attempt
    # count alone does not tell).
    rerun = conn.execute(
        f'SELECT count(*) FROM (SELECT job_id FROM "{schema}".job_events WHERE type = %s '
        "AND job_id = ANY(%s::uuid[]) GROUP BY job_id HAVING count(*) > 1) AS again",
        ("claimed", list(ids)),
    ).fetchone()[0]
    assert len(kills) >= 3 and rerun > 0, (
        f"the test must kill workers with jobs in flight: {rerun} job(s) claimed again {context}"
    )
    print(f"exactly-once crash test: {rerun} job(s) claimed again {context}")
