"""Queue limits with real ``dramatiq`` worker processes: a queue limited to 3, drained by two
worker processes of 8 threads each with 0.2 s jobs, never has more than 3 jobs running
(sampled from the database every 20 ms); an unlimited queue drains meanwhile at about its
usual rate, and the limited queue still gets threads while it does; a limit raised to 5,
then lowered to 1, mid-drain, holds within a second.

The timed tests record when each job's actor starts and when its thread leaves it (by the
database's clock), and count from those spans how many ran at once: a limit declared in
code holds from the first claim of a fresh deploy's workers (and an older worker that does
not declare it is held within a second); an aborted job keeps its place until its thread
leaves the actor; a SIGKILLed worker's place comes back within one lease.

The figures (the limited queue's throughput at its limit, the unlimited queue's drain time
alone and beside the limited one) are printed: run with ``-s`` to see them."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import time

import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.control import limits as queue_limits

from ..rows import status_of
from .queue_limits_actors import (
    ABORT_LIMITED,
    CODE_LIMITED,
    CRASH_LIMITED,
    JOB_SECONDS,
    LIMITED,
    MIXED_LIMITED,
    UNLIMITED,
    declare,
    declare_spans,
)
from .worker_actors import create_executions_table
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


def set_limit(
    broker: PostgresBroker, limit: int | None, queue: str = LIMITED
) -> tuple[float, float]:
    """Set a queue's limit (the limited queue's by default) as an operator does; returns
    when it was asked (the end of the previous limit's span: a sample taken after may
    already see the new one) and when it was committed."""
    asked = time.monotonic()
    with broker.pool.connection() as conn:
        queue_limits.set_limit(conn, broker.settings.schema, queue, limit, by="e2e", force=True)
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


# -- timed spans ----------------------------------------------------------------------------

APP = "tests.e2e.queue_limits_app"


@dataclasses.dataclass
class Span:
    """One attempt of a job, as its actor recorded it: its process, when it started and
    when its thread left the actor (None: it never did, its process was killed)."""

    job_id: str
    attempt: int
    pid: int
    start: dt.datetime
    finish: dt.datetime | None


@pytest.fixture
def span_actors(broker, conn, schema):
    """The actors of :func:`.queue_limits_actors.declare_spans` on the test's broker, by
    queue, with an empty ``executions`` table."""
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}.executions").format(sql.Identifier(schema)))
    create_executions_table(conn, schema)
    return declare_spans(broker)


def spans(conn, schema: str, job_ids) -> list[Span]:
    rows = conn.execute(
        sql.SQL(
            "SELECT job_id::text, attempt, min(pid), min(at) FILTER (WHERE phase = 'start'), "
            "max(at) FILTER (WHERE phase = 'finish') FROM {}.executions "
            "WHERE job_id = ANY(%s::uuid[]) GROUP BY 1, 2 ORDER BY 4"
        ).format(sql.Identifier(schema)),
        (list(job_ids),),
    ).fetchall()
    return [Span(*row) for row in rows]


def most_at_once(
    spans: list[Span], *, since: dt.datetime | None = None, until: dt.datetime | None = None
) -> int:
    """The most spans that were open at one moment from ``since`` on; a span without a
    finish ends at ``until`` (its process's death)."""
    moments = []
    for span in spans:
        end = span.finish or until
        assert end is not None, f"{span} never finished"
        if since is not None and end <= since:
            continue
        start = span.start if since is None else max(span.start, since)
        # A finish sorts before a start at the same moment: back to back is not at once.
        moments += [(start, 1), (end, -1)]
    running = most = 0
    for _, step in sorted(moments, key=lambda m: (m[0], m[1])):
        running += step
        most = max(most, running)
    return most


def describe(spans: list[Span], origin: dt.datetime) -> str:
    def at(moment):
        return "-" if moment is None else f"{(moment - origin).total_seconds():.2f}"

    return "; ".join(
        f"{s.job_id[:8]}#{s.attempt} pid {s.pid} {at(s.start)}..{at(s.finish)}" for s in spans
    )


def db_now(conn) -> dt.datetime:
    return conn.execute("SELECT clock_timestamp()").fetchone()[0]


def all_done(broker, job_ids) -> bool:
    return all(status_of(broker.store, j) in ("succeeded", "cancelled") for j in job_ids)


def test_a_limit_in_code_holds_from_the_first_claim_of_a_fresh_deploy(
    broker, span_actors, start_worker, conn, schema
):
    """The deploy that introduces a limit in code: no limit row yet, jobs waiting, two
    worker processes of 4 threads start with ``DRAMATIQ_PG_QUEUE_LIMITS``: never more
    than 1 ran at once, from the first claim on."""
    with broker.pool.connection() as c:
        assert queue_limits.get(c, schema, CODE_LIMITED) is None
    actor = span_actors[CODE_LIMITED]
    ids = [actor.send(0.3).message_id for _ in range(12)]
    begun = db_now(conn)
    worker = start_worker(
        app=APP,
        processes=2,
        threads=4,
        options=("--queues", CODE_LIMITED),
        DRAMATIQ_PG_QUEUE_LIMITS=f"{CODE_LIMITED}=1",
    )
    wait_for(lambda: all_done(broker, ids), 60, "the queue to drain", on_timeout=worker.log_tail)

    ran = spans(conn, schema, ids)
    assert len(ran) == 12 and {status_of(broker.store, j) for j in ids} == {"succeeded"}
    assert most_at_once(ran) == 1, describe(ran, begun)
    with broker.pool.connection() as c:
        limit = queue_limits.get(c, schema, CODE_LIMITED)
    assert (limit.limit, limit.source) == (1, "code")


def test_a_worker_that_declares_a_limit_holds_an_older_one_that_does_not_within_a_second(
    broker, span_actors, start_worker, conn, schema
):
    """A worker whose code has no limit drains the queue with 3 threads; a worker of the
    new code, declaring a limit of 1, starts beside it: from a second after the limit is
    written, never more than 1 runs at once (the older worker hears of it on the queue's
    channel; what it had started finishes)."""
    actor = span_actors[MIXED_LIMITED]
    ids = [actor.send(0.3).message_id for _ in range(40)]
    older = start_worker(app=APP, threads=3, options=("--queues", MIXED_LIMITED))
    wait_for(
        lambda: len(spans(conn, schema, ids)) >= 6,
        60,
        "the older worker to run jobs",
        on_timeout=older.log_tail,
    )
    newer = start_worker(
        app=APP,
        threads=3,
        options=("--queues", MIXED_LIMITED),
        DRAMATIQ_PG_QUEUE_LIMITS=f"{MIXED_LIMITED}=1",
    )

    def written():
        with broker.pool.connection() as c:
            return queue_limits.get(c, schema, MIXED_LIMITED)

    limit = wait_for(written, 60, "the newer worker to write its limit", on_timeout=newer.log_tail)
    wait_for(lambda: all_done(broker, ids), 90, "the queue to drain", on_timeout=older.log_tail)

    ran = spans(conn, schema, ids)
    assert most_at_once(ran, until=limit.set_at) > 1, "the older worker never ran 2: void"
    held_from = limit.set_at + dt.timedelta(seconds=1)
    assert most_at_once(ran, since=held_from) == 1, describe(ran, limit.set_at)


def test_an_aborted_job_keeps_its_place_until_its_thread_leaves_the_actor(
    broker, span_actors, start_worker, conn, schema
):
    """Limit 1, a worker of 2 threads: a job blocked in a 3 s sleep is aborted (no
    exception interrupts the sleep); the next job starts only once the aborted one's
    thread left the actor, and the aborted job ends cancelled."""
    set_limit(broker, 1, ABORT_LIMITED)
    actor = span_actors[ABORT_LIMITED]
    worker = start_worker(app=APP, threads=2, options=("--queues", ABORT_LIMITED))
    blocked = actor.send(3.0).message_id
    wait_for(
        lambda: spans(conn, schema, [blocked]), 60, "the job to start", on_timeout=worker.log_tail
    )
    quick = [actor.send(0.1).message_id for _ in range(3)]
    asked = db_now(conn)
    broker.store.abort(blocked, by="e2e")
    wait_for(lambda: all_done(broker, [blocked, *quick]), 30, "every job to end")
    ran = wait_for(
        lambda: (
            len(r := spans(conn, schema, [blocked, *quick])) == 4 and all(s.finish for s in r) and r
        ),
        30,
        "every thread to leave its actor",
    )
    assert status_of(broker.store, blocked) == "cancelled"
    assert {status_of(broker.store, j) for j in quick} == {"succeeded"}
    assert most_at_once(ran) == 1, describe(ran, asked)
    left = next(s.finish for s in ran if s.job_id == blocked)
    first_next = min(s.start for s in ran if s.job_id != blocked)
    assert first_next >= left, describe(ran, asked)
    assert (left - asked).total_seconds() > 1.5, "the sleep ended early: the test is void"


def test_after_a_sigkill_the_place_comes_back_within_one_lease(
    broker, span_actors, start_worker, conn, schema
):
    """Limit 1, a 3 s lease, the reaper every 30 s: the worker running the queue's one job
    is SIGKILLed; another worker starts the next job within the lease (plus a second) of
    the kill, long before any reaper takes the dead worker's job back."""
    lease = 3.0
    settings = {"DRAMATIQ_PG_LEASE_SECONDS": str(lease), "DRAMATIQ_PG_REAPER_INTERVAL": "30"}
    set_limit(broker, 1, CRASH_LIMITED)
    actor = span_actors[CRASH_LIMITED]
    first = start_worker(app=APP, threads=2, options=("--queues", CRASH_LIMITED), **settings)
    hung = actor.send(120, True).message_id  # only its first attempt hangs
    wait_for(lambda: spans(conn, schema, [hung]), 60, "the job to start", on_timeout=first.log_tail)
    second = start_worker(app=APP, threads=2, options=("--queues", CRASH_LIMITED), **settings)
    second.wait_ready()
    quick = [actor.send(0.1).message_id for _ in range(3)]

    first.kill_group()
    killed = db_now(conn)
    wait_for(
        lambda: all_done(broker, quick), 60, "the next jobs to run", on_timeout=second.log_tail
    )

    ran = spans(conn, schema, [hung, *quick])
    came_back = min(s.start for s in ran if s.job_id != hung)
    waited = (came_back - killed).total_seconds()
    print(f"\nqueue limits e2e: the place came back {waited:.2f}s after the kill ({lease}s lease)")
    assert waited <= lease + 1.0, f"{waited:.2f}s: " + describe(ran, killed)
    assert most_at_once(ran, until=killed) == 1, describe(ran, killed)
