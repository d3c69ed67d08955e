"""Dramatiq's own composition on PostgreSQL alone (issue 46, item 1), with real ``dramatiq``
worker processes: the example ``examples.composition`` runs a pipeline whose results are
piped, a pipeline with ``pipe_ignore``, a group's ``run()``, ``wait()`` and
``get_results()``, and a group's completion callback, on this package's broker, result
backend and rate-limiter backend, with no other server.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from psycopg import sql

from .workers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SIZE = 10


def test_pipelines_groups_and_a_completion_callback_run_on_postgres_alone(
    pg_url, schema, conn, start_worker
):
    worker = start_worker(app="examples.composition.example", processes=2, threads=4)
    worker.wait_ready(120, "both worker processes to be ready")
    environ = dict(os.environ, DRAMATIQ_PG_URL=pg_url, DRAMATIQ_PG_SCHEMA=schema)
    done = subprocess.run(
        [sys.executable, "-m", "examples.composition.example", "--size", str(SIZE)],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr + "\n" + worker.log_tail()
    lines = done.stdout.splitlines()
    assert lines == [
        "pipeline 3 6 60",
        "pipe_ignore 3 20",
        "group " + " ".join(str(2 * i) for i in range(SIZE)),
        f"callback {sum(i + 1 for i in range(SIZE))}",
    ], done.stdout

    jobs = sql.Identifier(schema, "all_jobs")
    counts = dict(
        conn.execute(
            sql.SQL("SELECT actor_name || ':' || status, count(*) FROM {} GROUP BY 1").format(jobs)
        ).fetchall()
    )
    # The pipelines' 3 additions and 2 multiplications, the two groups' members, one
    # callback: each ran once, and nothing else ran.
    assert counts == {
        "add:succeeded": 3 + 2 * SIZE,
        "multiply:succeeded": 2,
        "total:succeeded": 1,
    }, counts
