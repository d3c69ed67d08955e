"""What a worker process says about a database outage, counted in the log of a real
``dramatiq`` worker whose own PostgreSQL server is stopped for known lengths of time.

The worker process holds the broker's pool, its LISTEN connection (its consumers' and its
results waiters'), and a second pool of its own (``tests.e2e.outage_app``), all retrying while
the server is down; its reminders come every 2 s instead of a minute. It starts while
the server is down, which it must say at once; the server then comes back after 7 s, and
later goes away again for 3 s under a worker that has connections. For each outage the
log must hold exactly one line saying the database is unreachable (with the error), one
reminder per interval, and one line saying it is back and how long it was gone; no other
warning at all, and nothing from psycopg_pool.
"""

from __future__ import annotations

import math
import time

import psycopg
import pytest

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.migrate import migrate

from .worker_actors import create_executions_table, declare
from .workers import (
    OUTAGE_ENDS,
    OUTAGE_STARTS,
    WorkerProcess,
    log_records,
    outage_seconds,
    outage_story,
    wait_for,
)

# Alone: it stops, crashes or fails over PostgreSQL clusters of its own and times the
# outages to the second, which the parallel tests' load would stretch (make test runs it
# after them, serially).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.alone,
]

SCHEMA = "outage_logs"
REMINDER_SECONDS = 2.0
#: How long the database stays down after the worker first says so, then the second time.
OUTAGES = (7.0, 3.0)
#: How late a reminder may come after its interval: the holders retry at least twice a
#: second, and a reminder rides on a failed attempt.
REMINDER_LAG = 0.5


def test_a_worker_tells_each_outage_once_with_reminders_and_its_end(new_cluster, tmp_path):
    cluster = new_cluster()
    migrate(cluster.url, SCHEMA)
    with psycopg.connect(cluster.url, autocommit=True) as conn:
        create_executions_table(conn, SCHEMA)
    broker = PostgresBroker(url=cluster.url, schema=SCHEMA)
    quick = declare(broker)["quick"]
    log = tmp_path / "worker.log"

    def lines(start: str) -> list:
        return [r for r in log_records(log) if r.message.startswith(start)]

    def succeeded() -> int:
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            return conn.execute(
                f"SELECT count(*) FROM {SCHEMA}.all_jobs WHERE status = 'succeeded'"
            ).fetchone()[0]

    cluster.stop()
    worker = WorkerProcess(
        cluster.url,
        SCHEMA,
        log,
        app="tests.e2e.outage_app",
        DRAMATIQ_PG_OUTAGE_REMINDER_SECONDS=str(REMINDER_SECONDS),
    )
    try:
        wait_for(
            lambda: lines(OUTAGE_STARTS),
            30,
            "the worker to say the database is down",
            on_timeout=worker.log_tail,
        )
        time.sleep(OUTAGES[0])
        cluster.start()
        wait_for(
            lambda: lines(OUTAGE_ENDS),
            30,
            "the worker to say the database is back",
            on_timeout=worker.log_tail,
        )
        quick.send()
        wait_for(
            lambda: succeeded() == 1,
            30,
            "a job to run after the outage",
            on_timeout=worker.log_tail,
        )

        cluster.stop()
        time.sleep(OUTAGES[1])
        cluster.start()
        wait_for(
            lambda: len(lines(OUTAGE_ENDS)) == 2,
            30,
            "the end of the second outage",
            on_timeout=worker.log_tail,
        )
        quick.send()
        wait_for(
            lambda: succeeded() == 2,
            30,
            "a job to run after the second outage",
            on_timeout=worker.log_tail,
        )
    finally:
        worker.kill_group()
        broker.close()

    records = log_records(log, min_level="INFO")
    ready = [r for r in records if r.message == "Worker process is ready for action."]
    story = outage_story(log)
    starts, reminders, ends = story.starts, story.reminders, story.ends
    assert len(ready) == 1, f"one worker process expected, found {len(ready)}"
    assert len(starts) == 2 and len(ends) == 2, f"two outages, each told once:\n{story}"
    assert not story.jobs and not story.others, f"more than the outages:\n{story}"
    assert {r.pid for r in starts + reminders + ends} == {ready[0].pid}, (
        f"a line came from another process than the worker's:\n{story}"
    )
    assert "Connection refused" in starts[0].message, f"the error is missing:\n{story}"

    boot_to_first = (starts[0].at - ready[0].at).total_seconds()
    assert boot_to_first < 2.0, f"the worker started silent for {boot_to_first:.1f}s"

    for n, (start, end, down) in enumerate(zip(starts, ends, OUTAGES)):
        told = outage_seconds(end)
        logged = (end.at - start.at).total_seconds()
        assert logged - 0.5 <= told <= logged + 1.5, (
            f"outage {n}: the end line says {told}s, its lines are {logged:.1f}s apart"
        )
        assert told >= down - 0.5, f"outage {n} lasted {down}s, the log says {told}s"
        within = [r for r in reminders if start.at < r.at < end.at]
        fewest = math.floor(told / (REMINDER_SECONDS + REMINDER_LAG))
        most = math.floor(told / REMINDER_SECONDS)
        assert fewest <= len(within) <= most, (
            f"outage {n} of {told}s: {len(within)} reminder(s), expected {fewest} to {most}"
            f"\n{story}"
        )
    print(
        f"outages told: {[outage_seconds(e) for e in ends]}s with "
        f"{len(reminders)} reminder(s); first line {boot_to_first:.2f}s after the worker "
        "was ready"
    )
