"""The results and rate-limiter backends across real ``dramatiq`` processes.

- ``ConcurrentRateLimiter(limit=1)`` under ``--processes 2 --threads 4``: never two holders
  at once, checked on the database's clock.
- ``GroupCallbacks``: a group's completion callback runs exactly once, whichever process
  finishes the last member.
- The results example (``examples/results``) runs with PostgreSQL as the only server.
"""

from __future__ import annotations

import subprocess
import sys

import dramatiq
import pytest
from dramatiq.middleware import GroupCallbacks
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.rate_limits import PostgresRateLimiterBackend

from .worker_actors import create_executions_table
from .workers import REPO, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUEUE = "limits"
EXCLUSIVE_JOBS = 16

#: Each process holds at most this many messages (Dramatiq's default is twice the threads),
#: so that one process cannot take every job while the other is still starting.
PREFETCH = "4"


def start_both(start_worker):
    """``dramatiq tests.e2e.limits_app --processes 2 --threads 4``, once both processes are
    ready for action."""
    worker = start_worker(
        app="tests.e2e.limits_app", processes=2, threads=4, dramatiq_queue_prefetch=PREFETCH
    )
    worker.wait_ready(120, "both worker processes to be ready")
    return worker


@pytest.fixture(scope="module")
def executions(pg_url, schema):
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as c:
        create_executions_table(c, schema)


@pytest.fixture
def broker(pg_url, schema):
    """A broker in the test process with stand-ins for the workers' actors (same names and
    queue), to send their messages."""
    broker = PostgresBroker(url=pg_url, schema=schema)
    backend = PostgresRateLimiterBackend(broker=broker)
    broker.add_middleware(GroupCallbacks(backend))
    for name in ("exclusive", "member", "group_done"):
        dramatiq.actor(lambda *args: None, broker=broker, queue_name=QUEUE, actor_name=name)
    yield broker
    broker.close()


def rows(conn, schema, job_ids):
    query = sql.SQL(
        "SELECT job_id::text, pid, phase FROM {}.executions WHERE job_id = ANY(%s::uuid[]) "
        "ORDER BY at, id"
    ).format(sql.Identifier(schema))
    return conn.execute(query, (list(job_ids),)).fetchall()


def test_a_mutex_never_has_two_holders_across_processes(
    pg_url, schema, conn, executions, broker, start_worker
):
    worker = start_both(start_worker)
    ids = [
        broker.enqueue(
            dramatiq.Message(
                queue_name=QUEUE, actor_name="exclusive", args=(0.1,), kwargs={}, options={}
            )
        ).message_id
        for _ in range(EXCLUSIVE_JOBS)
    ]
    wait_for(
        lambda: sum(1 for r in rows(conn, schema, ids) if r[2] == "finish") >= EXCLUSIVE_JOBS,
        180,
        f"{EXCLUSIVE_JOBS} exclusive jobs to finish",
        on_timeout=worker.log_tail,
    )
    timeline = rows(conn, schema, ids)
    holder = None
    for job_id, _pid, phase in timeline:
        if phase == "start":
            assert holder is None, f"job {job_id} started while {holder} held the mutex"
            holder = job_id
        else:
            assert holder == job_id, f"job {job_id} finished but {holder} held the mutex"
            holder = None
    assert len(timeline) == 2 * EXCLUSIVE_JOBS
    pids = {pid for _job, pid, _phase in timeline}
    assert len(pids) >= 2, f"every holder ran in one process ({pids}): nothing was shared"


def test_a_group_completion_callback_runs_once_across_processes(
    pg_url, schema, conn, executions, broker, start_worker
):
    worker = start_both(start_worker)
    member = broker.get_actor("member")
    done = broker.get_actor("group_done")
    group = dramatiq.group([member.message(0.2) for _ in range(16)], broker=broker)
    group.add_completion_callback(done.message())
    group.run()
    member_ids = [m.message_id for m in group.children]

    def callback_runs():
        query = sql.SQL(
            "SELECT e.job_id::text, e.pid FROM {s}.executions e "
            "JOIN {s}.all_jobs j ON j.id = e.job_id "
            "WHERE j.actor_name = 'group_done' AND j.created_at > %s"
        ).format(s=sql.Identifier(schema))
        return conn.execute(query, (started,)).fetchall()

    started = conn.execute("SELECT now() - interval '1 minute'").fetchone()[0]
    wait_for(callback_runs, 120, "the completion callback to run", on_timeout=worker.log_tail)
    broker.join(QUEUE, timeout=120_000)
    finished = [r for r in rows(conn, schema, member_ids) if r[2] == "finish"]
    assert len({r[0] for r in finished}) == 16
    assert len(callback_runs()) == 1
    assert len({r[1] for r in finished}) >= 2, "the members all ran in one process"


def test_the_results_example_runs_on_postgres_alone(pg_url, schema, tmp_path):
    env = {"DRAMATIQ_PG_URL": pg_url, "DRAMATIQ_PG_SCHEMA": schema}
    from .workers import WorkerProcess

    worker = WorkerProcess(
        pg_url,
        schema,
        tmp_path / "example-worker.log",
        app="examples.results.example",
        processes=2,
        threads=4,
    )
    try:
        import os

        environ = dict(os.environ, **env)
        done = subprocess.run(
            [sys.executable, "-m", "examples.results.example", "6", "--max-sleep", "1"],
            cwd=REPO,
            env=environ,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr + "\n" + worker.log_tail()
        sums = done.stdout.split()
        assert len(sums) == 6 and all(0 <= int(s) <= 2000 for s in sums), done.stdout
    finally:
        worker.kill_group()
