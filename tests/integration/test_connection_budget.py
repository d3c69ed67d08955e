"""A worker's pool is its whole budget (``pool_max_size``, plus one LISTEN connection): what
waits for a pooled connection must neither deadlock nor starve the heartbeat.

- No thread of a worker ever holds two pooled connections at once: with every thread
  holding one and waiting for a second, a full pool would deadlock until ``pool_timeout``.
  Checked under a mixed load in process (sends from actors, results stored and awaited,
  retries, a rate limiter, progress, aborts, the heartbeat and reaper, maintenance).
- A pool of two shared by twelve threads that take connections back to back does not keep
  the heartbeat from renewing leases of one second: psycopg_pool hands connections out in
  the order they were asked for, and every holder gives its connection back within a
  statement or a short transaction.
- An admin API process of 64 threads opens at most 2 × ``pool_max_size``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback

import dramatiq
import psycopg
import pytest
from dramatiq.rate_limits import ConcurrentRateLimiter
from dramatiq.results import Results

from dramatiq_pg_broker import current_job
from dramatiq_pg_broker.db.core import ProcessPool
from dramatiq_pg_broker.history.retention import prune_with_settings
from dramatiq_pg_broker.rate_limits import PostgresRateLimiterBackend
from dramatiq_pg_broker.results import PostgresBackend

from ..helpers import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def nested(monkeypatch):
    """The stacks at which a thread asked the pool for a connection while it held one."""
    found: list[str] = []
    held = threading.local()
    original = ProcessPool.connection

    @contextlib.contextmanager
    def counting(self, **kwargs):
        depth = getattr(held, "depth", 0)
        if depth:
            found.append("".join(traceback.format_stack(limit=12)))
        held.depth = depth + 1
        try:
            with original(self, **kwargs) as conn:
                yield conn
        finally:
            held.depth = depth

    monkeypatch.setattr(ProcessPool, "connection", counting)
    return found


def test_no_thread_of_a_worker_holds_two_pooled_connections(h, nested):
    broker = h.broker(lease_seconds=1.0, heartbeat_seconds=0.2, reaper_interval=0.2)
    results = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=results))
    limiter = ConcurrentRateLimiter(PostgresRateLimiterBackend(broker=broker), "nest", limit=2)
    queue = h.queue

    @dramatiq.actor(broker=broker, queue_name=queue, store_results=True)
    def double(n):
        return 2 * n

    @dramatiq.actor(broker=broker, queue_name=queue)
    def fan_out(n):
        for i in range(n):
            double.send(i)

    @dramatiq.actor(broker=broker, queue_name=queue)
    def await_double(n):
        double.send(n).get_result(backend=results, block=True, timeout=10_000)
        h.record("awaited")

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=2, min_backoff=10)
    def flaky():
        if current_job().attempt == 1:
            raise RuntimeError("the first attempt fails")
        h.record("retried")

    @dramatiq.actor(broker=broker, queue_name=queue)
    def limited():
        with limiter.acquire(raise_on_failure=False):
            current_job().progress({"holding": True})
        h.record("limited")

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def slow():
        time.sleep(5)

    h.start(broker, threads=8)
    for n in range(4):
        fan_out.send(10)
        await_double.send(n)
        flaky.send()
        limited.send()
    aborted = slow.send()
    wait_for(lambda: h.ran("limited") == 4, 30, "the limited jobs")
    broker.store.abort(aborted.message_id, by="test")
    # A dead worker's claim: the reaper gives it back.
    double.send(99)
    broker.store.claim(queue, 1, "gone:1:0:x", 0.2)
    prune_with_settings(broker.pool, broker.settings)
    wait_for(
        lambda: h.ran("awaited") == 4 and h.ran("retried") == 4, 30, "the awaited and retried jobs"
    )
    broker.join(queue, timeout=30_000)
    assert nested == [], f"{len(nested)} nested acquisitions; the first at:\n{nested[0]}"


def test_a_busy_pool_does_not_starve_the_heartbeat(h, conn):
    """Twelve threads each take a pooled connection back to back for three leases; the
    heartbeat waits its turn in the same pool and renews every lease in time: no attempt
    is lost or run twice."""
    broker = h.broker(
        pool_max_size=2, lease_seconds=1.0, heartbeat_seconds=0.25, reaper_interval=0.2
    )

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def hog():
        job = current_job()
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            with broker.pool.connection() as c:
                c.execute("SELECT pg_sleep(0.002)")
        h.record("done", job.id)

    h.start(broker, threads=12)
    ids = [hog.send().message_id for _ in range(12)]
    wait_for(lambda: all(h.ran("done", i) for i in ids), 60, "the twelve jobs")
    broker.join(h.queue, timeout=10_000)
    assert [h.ran("done", i) for i in ids] == [1] * 12
    rows = conn.execute(
        f'SELECT status, attempts, interruptions FROM "{h.schema}".all_jobs WHERE id = ANY(%s)',
        (ids,),
    ).fetchall()
    assert rows == [("succeeded", 1, 0)] * 12, rows


def test_an_admin_api_process_stays_within_twice_its_pool(pg_url, schema, conn):
    """64 threads of one admin API process (the gunicorn default) calling reads, the
    metrics, the health findings and job creations at once: its connections, named
    ``dramatiq-pg-admin/<pid>``, stay within its budget of 2 × ``pool_max_size`` (the read
    engine's pool and the changes' pool)."""
    import os

    from falcon import testing

    from admin_api.accounts import AccountStore
    from admin_api.app import APPLICATION, create_app
    from dramatiq_pg_broker.config import Settings

    settings = Settings(url=pg_url, schema=schema, admin_adhoc_actors=True)
    accounts = AccountStore(ProcessPool(settings), schema, bcrypt_rounds=4)
    user = accounts.create_user(f"budget-{os.getpid()}@example.com", "a long password", "admin")
    auth = {"Authorization": f"Bearer {accounts.create_token(user.id, 'budget').secret}"}
    accounts.pool.close()
    client = testing.TestClient(create_app(settings))
    paths = ["/api/jobs", "/api/queues", "/api/workers", "/api/jobs/stats", "/metrics"]
    paths.append("/api/health/findings")
    name = f"{APPLICATION}/{os.getpid()}"
    # An admin API app of an earlier test of this process (pytest-xdist runs several test
    # modules in one process) may still hold idle connections of the same name: count the
    # ones opened since this test began.
    began = conn.execute("SELECT clock_timestamp()").fetchone()[0]
    peak = 0
    statuses: set[int] = set()
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        with psycopg.connect(pg_url, autocommit=True) as c:
            while not stop.is_set():
                n = c.execute(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE application_name = %s AND backend_start >= %s",
                    (name, began),
                ).fetchone()[0]
                peak = max(peak, n)
                time.sleep(0.01)

    def calls(n: int) -> None:
        for i in range(20):
            if (n + i) % 4 == 0:
                result = client.simulate_post(
                    "/api/jobs",
                    headers=auth,
                    json={"actor_name": "tests.budget", "queue_name": "budget"},
                )
            else:
                result = client.simulate_get(paths[(n + i) % len(paths)], headers=auth)
            statuses.add(result.status_code)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=calls, args=(n,)) for n in range(64)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        stop.set()
        sampler.join(10)
    print(f"\nadmin API process: at most {peak} connections")
    assert statuses <= {200, 201}, statuses
    assert 2 <= peak <= 2 * settings.pool_max_size, f"{peak} connections at once"
