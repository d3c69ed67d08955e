"""Queue limits with real ``dramatiq`` worker processes: a queue limited to 3, drained by two
worker processes of 8 threads each with 0.2 s jobs, never has more than 3 jobs running
(sampled from the database every 20 ms); an unlimited queue drains meanwhile at about its
usual rate, and the limited queue still gets threads while it does; a limit raised to 5,
then lowered to 1, mid-drain, holds within a second.

The figures (the limited queue's throughput at its limit, the unlimited queue's drain time
alone and beside the limited one) are printed: run with ``-s`` to see them."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.control import limits as queue_limits

from .queue_limits_actors import JOB_SECONDS, LIMITED, UNLIMITED, declare
from .workers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

THREADS = 8


class Sampler:
    """The running jobs of both queues, counted from the database every 20 ms."""

    def __init__(self, pg_url: str, schema: str) -> None:
        #: (monotonic time, running of LIMITED, running of UNLIMITED)
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._query = sql.SQL(
            "SELECT count(*) FILTER (WHERE queue_name = %s), "
            "count(*) FILTER (WHERE queue_name = %s) "
            "FROM {}.jobs WHERE status = 'running'"
        ).format(sql.Identifier(schema))
        self._conn = psycopg.connect(pg_url, autocommit=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            limited, unlimited = self._conn.execute(self._query, (LIMITED, UNLIMITED)).fetchone()
            self.samples.append((time.monotonic(), limited, unlimited))
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._conn.close()

    def limited_max(self, start: float, end: float) -> int:
        return max((n for t, n, _ in self.samples if start <= t < end), default=0)

    def unlimited_max(self, start: float, end: float) -> int:
        return max((n for t, _, n in self.samples if start <= t < end), default=0)

    def describe(self, start: float, end: float) -> str:
        return " ".join(f"{t - start:.2f}:{n}" for t, n, _ in self.samples if start <= t < end)


@pytest.fixture
def broker(pg_url, schema):
    broker = PostgresBroker(url=pg_url, schema=schema)
    yield broker
    broker.close()


def set_limit(broker: PostgresBroker, limit: int | None) -> tuple[float, float]:
    """Set the limited queue's limit as an operator does; returns when it was asked (the
    end of the previous limit's span: a sample taken after may already see the new one)
    and when it was committed."""
    asked = time.monotonic()
    with broker.pool.connection() as conn:
        queue_limits.set_limit(conn, broker.settings.schema, LIMITED, limit, by="e2e", force=True)
    return asked, time.monotonic()


def drain(broker: PostgresBroker, actor, n: int, timeout: float) -> float:
    """Send ``n`` jobs of ``actor`` and return the seconds until its queue is empty."""
    started = time.monotonic()
    broker.enqueue_many([actor.message(i) for i in range(n)])
    wait_for(lambda: broker.store.count_unfinished(actor.queue_name) == 0, timeout, "a drain")
    return time.monotonic() - started


def test_a_limit_holds_across_two_worker_processes_and_changes_within_a_second(
    broker, start_worker, pg_url, schema
):
    limited, unlimited = declare(broker)
    set_limit(broker, 3)
    workers = [start_worker(app="tests.e2e.queue_limits_app", threads=THREADS) for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    sampler = Sampler(pg_url, schema)
    try:
        # The unlimited queue alone: its usual drain time on this machine, now.
        unlimited_jobs = 10 * 2 * THREADS
        alone = drain(broker, unlimited, unlimited_jobs, 60)

        # The limited queue, at 3: 3 x 1/0.2 s = 15 jobs a second at most.
        total = 300
        broker.enqueue_many([limited.message(i) for i in range(total)])
        start = time.monotonic()
        wait_for(
            lambda: broker.store.count_unfinished(LIMITED) <= total - 10, 30, "limited jobs to run"
        )
        # Meanwhile the unlimited queue drains again, beside it.
        unlimited_start = time.monotonic()
        limited_left = broker.store.count_unfinished(LIMITED)
        beside = drain(broker, unlimited, unlimited_jobs, 60)
        unlimited_end = time.monotonic()
        # How fast the limited queue went while the unlimited one drained beside it.
        rate_beside = (limited_left - broker.store.count_unfinished(LIMITED)) / beside
        # The throughput at the limit, over 2 s once the unlimited queue is done.
        left = broker.store.count_unfinished(LIMITED)
        window_start = time.monotonic()
        time.sleep(2.0)  # the measured window, not a wait for a result
        window = time.monotonic() - window_start
        rate = (left - broker.store.count_unfinished(LIMITED)) / window

        # Raised to 5 mid-drain.
        raise_asked, raised = set_limit(broker, 5)
        time.sleep(2.0)  # the limit's span: the samples are read afterwards
        lower_asked, lowered = set_limit(broker, 1)
        time.sleep(2.0)  # the same
        clear_asked, _ = set_limit(broker, None)
        wait_for(lambda: broker.store.count_unfinished(LIMITED) == 0, 60, "the limited drain")
        end = time.monotonic()
    finally:
        sampler.stop()

    at_3 = sampler.limited_max(start, raise_asked)
    at_5_first_second = sampler.limited_max(raised, raised + 1.0)
    at_5 = sampler.limited_max(raised + 1.0, lower_asked)
    at_1 = sampler.limited_max(lowered + 1.0, clear_asked)
    print(
        f"\nqueue limits e2e: 2 processes x {THREADS} threads, {JOB_SECONDS}s jobs; "
        f"limited queue at 3: {rate:.1f} jobs/s (ideal {3 / JOB_SECONDS:.0f}); sampled max "
        f"{at_3} at 3, {at_5_first_second} within 1 s of 5, {at_5} at 5, {at_1} at 1; "
        f"unlimited queue ({unlimited_jobs} jobs): {alone:.2f}s alone, {beside:.2f}s beside "
        f"the limited one (max {sampler.unlimited_max(unlimited_start, unlimited_end)} "
        f"running; the limited queue ran {rate_beside:.1f} jobs/s meanwhile); "
        f"{len(sampler.samples)} samples over {end - start:.1f}s"
    )
    assert at_3 == 3, f"at limit 3 the sampled running jobs peaked at {at_3}: " + (
        sampler.describe(start, raise_asked)
    )
    assert at_5_first_second == 5, (
        f"within 1 s of the raise to 5 the running jobs peaked at {at_5_first_second}: "
        + sampler.describe(raised, raised + 1.0)
    )
    assert at_5 == 5, sampler.describe(raised, lower_asked)
    assert at_1 == 1, (
        f"from 1 s after the limit fell to 1, the running jobs peaked at {at_1}: "
        + sampler.describe(lowered, clear_asked)
    )
    # The limited queue ran at its limit: a third of the ideal at least, on a busy machine.
    assert rate >= 3 / JOB_SECONDS / 3, f"{rate:.1f} jobs/s at limit 3"
    # The unlimited queue was not held behind the limited one: it drained at about its
    # usual rate (3 of the 16 threads were the limited queue's).
    assert beside <= 2 * alone + 1.0, f"unlimited drain: {alone:.2f}s alone, {beside:.2f}s beside"
    assert sampler.unlimited_max(unlimited_start, unlimited_end) > 3
    # Nor was the limited queue starved while the unlimited one kept every thread busy:
    # the other consumers left it the threads it waited for (QueueLimits.hungry).
    assert rate_beside >= 1.5, f"the limited queue ran {rate_beside:.1f} jobs/s meanwhile"
