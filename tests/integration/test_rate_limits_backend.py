"""PostgresRateLimiterBackend against real PostgreSQL: the scenarios Dramatiq runs against
its Redis and Memcached backends (barriers, concurrent, bucket and window limiters, group
callbacks), made deterministic, plus TTLs, races between connections and reclaiming.

Threads here each borrow their own pooled connection, so every race is a race between
database sessions, as between processes (the real-process case is in tests/e2e)."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import dramatiq
import pytest
from dramatiq.middleware import GroupCallbacks
from dramatiq.rate_limits import (
    Barrier,
    BucketRateLimiter,
    ConcurrentRateLimiter,
    RateLimitExceeded,
    WindowRateLimiter,
)
from psycopg import sql

from dramatiq_pg_broker.rate_limits import PostgresRateLimiterBackend, prune_expired

from .results_support import BROKER_KINDS, BrokerHarness

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def backend(pg_url, schema):
    backend = PostgresRateLimiterBackend(url=pg_url, schema=schema)
    yield backend
    backend.close()


@pytest.fixture
def key():
    return f"k-{uuid.uuid4().hex}"


def rows(conn, schema, like):
    query = sql.SQL("SELECT key, value FROM {}.rate_limits WHERE key LIKE %s ORDER BY key")
    return conn.execute(query.format(sql.Identifier(schema)), (like,)).fetchall()


# -- the backend operations, with Redis's semantics -------------------------------------------


def test_add_creates_a_key_once(backend, key):
    assert backend.add(key, 3, 60_000)
    assert not backend.add(key, 5, 60_000)
    assert backend.incr(key, 0, 10, 60_000)  # still 3: 3 + 0 <= 10
    assert not backend.incr(key, 8, 10, 60_000)  # 11 > 10, unchanged
    assert backend.incr(key, 7, 10, 60_000)  # exactly 10


def test_incr_and_decr_stay_within_their_bounds(backend, key, conn, schema):
    assert backend.incr(key, 2, 2, 60_000)  # an absent key counts as 0
    assert not backend.incr(key, 1, 2, 60_000)
    assert backend.decr(key, 2, 0, 60_000)
    assert not backend.decr(key, 1, 0, 60_000)
    assert rows(conn, schema, key) == [(key, 0)]
    assert not backend.incr(key, 5, 4, 60_000)  # out of bounds from the start
    assert not backend.decr(f"{key}-absent", 1, 1, 60_000)
    assert rows(conn, schema, f"{key}-absent") == []


def test_an_expired_key_counts_as_absent(backend, key):
    assert backend.add(key, 1, 50)
    assert not backend.add(key, 1, 60_000)
    time.sleep(0.1)
    assert backend.add(key, 7, 60_000), "an expired key must be replaceable"
    other = key + "-2"
    assert backend.incr(other, 5, 5, 50)
    time.sleep(0.1)
    assert backend.incr(other, 5, 5, 60_000), "an expired value must count from 0"


def test_incr_and_sum_counts_every_key_of_the_window(backend, key):
    window = [f"{key}@{i}" for i in range(3)]
    assert backend.incr(window[1], 1, 10, 60_000)
    assert backend.incr(window[2], 1, 10, 60_000)
    assert backend.incr_and_sum(window[0], lambda: window, 1, 3, 60_000)
    assert not backend.incr_and_sum(window[0], lambda: window, 1, 3, 60_000)


def test_incr_and_sum_is_atomic_across_overlapping_windows(backend, key):
    # Two callers at a second boundary: each adds to its own second, both sum both.
    def caller(start, target, window):
        start.wait(10)
        return backend.incr_and_sum(target, lambda: window, 1, 1, 60_000)

    for round_ in range(15):
        window = [f"{key}-{round_}@1", f"{key}-{round_}@2"]
        start = threading.Barrier(2)
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(caller, start, target, window) for target in window]
            results = [f.result() for f in futures]
        assert sorted(results) == [False, True], f"round {round_}: {results}"


def test_racing_increments_never_pass_the_maximum(backend, key):
    start = threading.Barrier(16)

    def caller(_):
        start.wait(10)
        return sum(backend.incr(key, 1, 5, 60_000) for _ in range(5))

    with ThreadPoolExecutor(16) as pool:
        total = sum(pool.map(caller, range(16)))
    assert total == 5


def test_wait_returns_at_once_for_an_event_notified_earlier(backend, key):
    assert not backend.wait(key, 0)
    backend.wait_notify(key, 60_000)
    started = time.monotonic()
    assert backend.wait(key, 10_000)
    assert time.monotonic() - started < 5


def test_wait_wakes_on_notify_and_times_out_without(backend, key):
    started = time.monotonic()
    assert not backend.wait(key, 200)
    assert 0.19 <= time.monotonic() - started < 5
    woke = {}

    def waiter():
        woke["result"] = backend.wait(key, 60_000)
        woke["at"] = time.monotonic()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    notified = time.monotonic()
    backend.wait_notify(key, 60_000)
    thread.join(30)
    assert woke["result"] is True
    assert woke["at"] - notified < 1.0


def test_expired_keys_are_reclaimed_through_the_index(backend, key, conn, schema):
    backend.reclaimer.next_run = float("inf")  # no opportunistic pass in this test
    for i in range(5):
        backend.add(f"{key}-dead-{i}", 1, 1)
    backend.add(f"{key}-live", 1, 60_000)
    time.sleep(0.01)
    assert len(rows(conn, schema, f"{key}%")) == 6
    with conn.transaction():
        conn.execute("SET LOCAL enable_seqscan = off")
        plan = conn.execute(
            "EXPLAIN " + backend.expiring["prune_expired"], {"limit": 10}
        ).fetchall()
    assert "rate_limits_expires_at_idx" in "\n".join(r[0] for r in plan)
    assert prune_expired(conn, schema, limit=2) == 2
    assert prune_expired(conn, schema, limit=100) >= 3
    assert [k for k, _ in rows(conn, schema, f"{key}%")] == [f"{key}-live"]


def test_writers_reclaim_expired_keys_as_they_go(pg_url, schema, key, conn):
    backend = PostgresRateLimiterBackend(url=pg_url, schema=schema, prune_batch=3)
    try:
        backend.reclaimer.next_run = float("inf")
        for i in range(7):
            backend.add(f"{key}-{i}", 1, 1)
        time.sleep(0.01)
        backend.reclaimer.next_run = 0.0
        for _ in range(4):
            backend.incr(f"{key}-live", 1, 100, 60_000)
        assert [k for k, _ in rows(conn, schema, f"{key}%")] == [f"{key}-live"]
    finally:
        backend.close()


def test_the_table_is_unlogged(conn, schema):
    persistence = conn.execute(
        "SELECT relpersistence FROM pg_class WHERE oid = to_regclass(%s)",
        (f'"{schema}".rate_limits',),
    ).fetchone()[0]
    assert persistence == "u"


# -- Dramatiq's rate limiters and barriers ----------------------------------------------------


def test_barrier(backend, key):
    barrier = Barrier(backend, key, ttl=30_000)
    assert barrier.create(parties=2)
    assert not barrier.create(parties=10)
    assert not barrier.wait(block=False)
    assert barrier.wait(block=False)


def test_barriers_can_block(backend, key):
    barrier = Barrier(backend, key, ttl=30_000)
    assert barrier.create(parties=2)
    times = {}

    def party(name, delay):
        time.sleep(delay)
        assert barrier.wait(timeout=30_000)
        times[name] = time.monotonic()

    first = threading.Thread(target=party, args=("first", 0))
    first.start()
    time.sleep(0.5)
    arrived = time.monotonic()
    party("second", 0)
    first.join(30)
    assert times["first"] >= arrived, "the first party passed before the second arrived"
    assert times["first"] - times["second"] < 1.0


def test_barriers_can_time_out(backend, key):
    barrier = Barrier(backend, key, ttl=30_000)
    assert barrier.create(parties=2)
    started = time.monotonic()
    assert not barrier.wait(timeout=1000)
    assert 0.99 <= time.monotonic() - started < 10


def test_concurrent_rate_limiter_releases_the_lock_after_each_call(backend, key):
    mutex = ConcurrentRateLimiter(backend, key, limit=1)
    calls = 0
    for _ in range(8):
        with mutex.acquire(raise_on_failure=False) as acquired:
            if acquired:
                calls += 1
    assert calls == 8


@pytest.mark.parametrize("limit", [1, 4])
def test_concurrent_rate_limiter_admits_exactly_its_limit(backend, key, limit):
    limiter = ConcurrentRateLimiter(backend, key, limit=limit)
    contenders = 16
    start = threading.Barrier(contenders)
    attempted = threading.Barrier(contenders)
    inside = []

    def work():
        start.wait(30)
        try:
            with limiter.acquire():
                inside.append(1)
                # Hold the slot until every contender has tried.
                attempted.wait(30)
        except RateLimitExceeded:
            attempted.wait(30)

    with ThreadPoolExecutor(contenders) as pool:
        for future in [pool.submit(work) for _ in range(contenders)]:
            future.result()
    assert len(inside) == limit
    # Every slot was released.
    with limiter.acquire():
        pass


def test_bucket_rate_limiter_limits_per_bucket(backend, key):
    bucket_ms = 10_000
    now_ms = time.time() * 1000
    if bucket_ms - now_ms % bucket_ms < 3000:  # too close to the next bucket: wait for it
        time.sleep((bucket_ms - now_ms % bucket_ms) / 1000 + 0.05)
    limiter = BucketRateLimiter(backend, key, limit=2, bucket=bucket_ms)
    calls = 0
    for _ in range(8):
        with limiter.acquire(raise_on_failure=False) as acquired:
            calls += bool(acquired)
    assert calls == 2


def test_window_rate_limiter_limits_per_window(backend, key):
    limiter = WindowRateLimiter(backend, key, limit=2, window=5)
    start = threading.Barrier(8)

    def work():
        start.wait(30)
        calls = 0
        for _ in range(8):
            with limiter.acquire(raise_on_failure=False) as acquired:
                calls += bool(acquired)
        return calls

    with ThreadPoolExecutor(8) as pool:
        total = sum(f.result() for f in [pool.submit(work) for _ in range(8)])
    assert total == 2


def test_window_rate_limiter_admits_again_once_the_window_has_passed(backend, key):
    limiter = WindowRateLimiter(backend, key, limit=1, window=1)
    with limiter.acquire():
        pass
    deadline = time.monotonic() + 10
    while True:
        with limiter.acquire(raise_on_failure=False) as acquired:
            if acquired:
                break
        assert time.monotonic() < deadline, "the window never admitted again"
        time.sleep(0.05)


# -- group completion callbacks -----------------------------------------------------------------


@pytest.mark.parametrize("kind", BROKER_KINDS)
def test_groups_can_have_completion_callbacks(kind, pg_url, schema, backend):
    h = BrokerHarness(kind, pg_url, schema)
    try:
        h.broker.add_middleware(GroupCallbacks(backend))
        done = []
        finished = threading.Event()

        @dramatiq.actor(queue_name=h.queue)
        def do_nothing():
            pass

        @dramatiq.actor(queue_name=h.queue)
        def finalize(n):
            done.append(n)
            finished.set()

        h.start()
        g = dramatiq.group(do_nothing.message() for _ in range(5))
        g.add_completion_callback(finalize.message(42))
        g.run()
        assert finished.wait(30), "the completion callback never ran"
        # Give a duplicate callback every chance to show up.
        time.sleep(0.5)
        assert done == [42]
    finally:
        h.close()
