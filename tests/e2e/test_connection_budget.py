"""A worker process's connections stay within its documented budget whatever its threads:
``pool_max_size``, one LISTEN connection and maintenance's turn
(:attr:`.Settings.connection_budget`).

One real ``dramatiq tests.e2e.budget_app`` process of 32 threads and four queues runs
everything that can take a connection in a worker (:mod:`tests.e2e.budget_app`): sends
from actors, a drain, stored and awaited results, retries, a rate limiter, progress,
operator aborts and dramatiq-abort's watcher, the heartbeat, the reaper (the test claims
jobs as a worker that dies, whose leases then expire) and the scheduler's maintenance
(every second). Meanwhile the test samples ``pg_stat_activity`` every few milliseconds and
counts the connections of each of the worker's processes by their ``application_name``
(``dramatiq-pg-broker/<pid>``). Before one LISTEN connection served the whole process, each
queue's consumer held its own: a worker of four queues held the pool, four LISTEN
connections, the results listener and maintenance's turn (16).
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import psycopg
import pytest

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.errors import PgBrokerError

from .budget_actors import QUEUES, declare

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: Threads of the worker process.
THREADS = 32
#: Seconds the load lasts.
LOAD_SECONDS = 15.0
#: Seconds between two samples of pg_stat_activity.
SAMPLE_SECONDS = 0.01


@pytest.fixture
def sender(pg_url, schema):
    """A broker in the test process with the worker's actors, to send their messages."""
    broker = PostgresBroker(url=pg_url, schema=schema)
    declare(broker)
    yield broker
    broker.close()


class Sampler(threading.Thread):
    """Counts, every :data:`SAMPLE_SECONDS`, the connections of each process of the
    package other than this one (by ``application_name``), in the module's database;
    keeps the largest count seen per process."""

    def __init__(self, pg_url: str) -> None:
        super().__init__(daemon=True)
        self.pg_url = pg_url
        self.stop = threading.Event()
        self.peaks: dict[str, int] = {}
        self.at_peak: dict[str, list] = {}
        self.samples = 0

    def run(self) -> None:
        mine = f"dramatiq-pg-broker/{os.getpid()}"
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            while not self.stop.is_set():
                rows = conn.execute(
                    "SELECT application_name, count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() "
                    "AND application_name LIKE 'dramatiq-pg-broker/%%' "
                    "AND application_name <> %s GROUP BY 1",
                    (mine,),
                ).fetchall()
                for name, count in rows:
                    if count > self.peaks.get(name, 0):
                        #: What the connections were doing at the peak, for the message.
                        self.at_peak[name] = conn.execute(
                            "SELECT state, left(query, 60), backend_start FROM pg_stat_activity "
                            "WHERE application_name = %s ORDER BY backend_start",
                            (name,),
                        ).fetchall()
                    self.peaks[name] = max(self.peaks.get(name, 0), count)
                self.samples += 1
                time.sleep(SAMPLE_SECONDS)


def test_a_worker_of_32_threads_stays_within_its_connection_budget(
    pg_url, schema, conn, sender, start_worker
):
    budget = Settings.load(environ={}).connection_budget
    assert budget == 12, "the documented default: a pool of 10, one LISTEN, one for maintenance"
    worker = start_worker(
        app="tests.e2e.budget_app",
        threads=THREADS,
        DRAMATIQ_PG_RETENTION_INTERVAL="1",
        DRAMATIQ_PG_HEARTBEAT_SECONDS="0.5",
    )
    worker.wait_ready(120)
    sampler = Sampler(pg_url)
    sampler.start()
    actors = sender.actors
    store = sender.store
    dead_claims = aborted = 0
    slow_ids: list[str] = []
    try:
        deadline = time.monotonic() + LOAD_SECONDS
        # A loaded machine's worker may have taken every job of a tick before the dead
        # worker's claim, or finished a slow job before its abort: the load goes on (for a
        # minute at most) until both have happened at least once.
        last = deadline + 60
        tick = 0
        while time.monotonic() < deadline or (
            not (dead_claims and aborted) and time.monotonic() < last
        ):
            messages = (
                [actors["double"].message(n) for n in range(10)]
                + [actors["fan_out"].message(10)]
                + [actors["await_double"].message(n) for n in range(3)]
                + [actors["flaky"].message() for _ in range(3)]
                + [actors["limited"].message() for _ in range(10)]
                + [actors["slow"].message(1.0)]
            )
            sent = sender.enqueue_many(messages)
            slow_ids.append(sent[-1].message_id)
            tick += 1
            if tick % 5 == 0:
                # A worker that claims and dies: its leases expire and the worker's reaper
                # gives the jobs back.
                owner = f"gone:{uuid.uuid4().hex[:8]}:dead"
                dead_claims += len(store.claim(QUEUES[0], 5, owner, 0.3))
                # An operator aborts a slow job (running, or still waiting).
                try:
                    store.abort(slow_ids[-5] if len(slow_ids) >= 5 else slow_ids[0], by="test")
                    aborted += 1
                except PgBrokerError:
                    pass  # it finished already
            time.sleep(0.2)
        for queue in QUEUES:
            sender.join(queue, timeout=120_000)
    finally:
        sampler.stop.set()
        sampler.join(10)
    assert dead_claims and aborted, "the load left out the reaper or the aborts"
    assert sampler.samples > 100, f"only {sampler.samples} samples"
    assert sampler.peaks, "no connection of the worker was seen"
    peak = max(sampler.peaks.values())
    print(f"\nconnections per worker process, at most: {sampler.peaks} ({sampler.samples} samples)")
    assert peak <= budget, (
        f"a worker process of {THREADS} threads held {peak} connections at once, over its "
        f"budget of {budget} (pool 10, LISTEN, maintenance): {sampler.peaks}\n"
        f"at the peak: {sampler.at_peak}\n"
        f"{worker.log_tail()}"
    )
    # Every queue drained: the retried jobs and the reaped ones ran too.
    rows = conn.execute(
        f"SELECT count(*) FROM {schema}.jobs WHERE status IN ('queued', 'running')"
    ).fetchone()[0]
    assert rows == 0
