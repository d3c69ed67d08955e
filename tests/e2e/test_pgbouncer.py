"""Real ``dramatiq`` workers draining jobs through a real PgBouncer in transaction mode.

Many worker connections share a few server connections: every job must still end
``succeeded`` exactly once, the workers must log no error, and the server must never see
more connections from the pooler than its pool size, however many clients it has.
"""

from __future__ import annotations

import collections
import re
import signal
import threading

import psycopg
import pytest

from benchmarks import pgbouncer
from dramatiq_pg_broker import PostgresBroker

from .worker_actors import QUEUE, create_executions_table, declare
from .workers import wait_for, worker_starter

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        pgbouncer.binary() is None,
        reason="the pgbouncer binary is not installed (Debian: apt-get install pgbouncer)",
    ),
]

POOL_SIZE = 3
WORKERS = 3
THREADS = 4
JOBS = 300

#: Poll-only consumers and no server-side prepared statements: what the deployment guide asks
#: for behind PgBouncer in transaction mode. Leases longer than the e2e default, so that a slow
#: shared machine cannot make a job run twice.
POOLED = {
    "DRAMATIQ_PG_LISTEN": "false",
    "DRAMATIQ_PG_PREPARED_STATEMENTS": "false",
    "DRAMATIQ_PG_LEASE_SECONDS": "60",
}

ERROR_RE = re.compile(r"\b(ERROR|CRITICAL|Traceback)\b|Lost job|prepared statement")


@pytest.fixture
def bouncer(pg_url):
    with pgbouncer.PgBouncer(pg_url, pool_size=POOL_SIZE) as running:
        yield running


@pytest.fixture
def start_pooled_worker(bouncer, schema, tmp_path):
    yield from worker_starter(bouncer.url, schema, tmp_path)


class ConnectionSampler(threading.Thread):
    """Samples the pooler's server-side connections (as the server counts them) and its
    client connections, every few milliseconds, until stopped."""

    def __init__(self, url: str, bouncer: pgbouncer.PgBouncer) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.bouncer = bouncer
        self.max_server = 0
        self.max_clients = 0
        self.samples = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                while not self._halt.is_set():
                    self.max_server = max(self.max_server, self.bouncer.server_connections(conn))
                    self.max_clients = max(self.max_clients, self.bouncer.client_connections())
                    self.samples += 1
                    self._halt.wait(0.02)
        except BaseException as e:  # reported by the test
            self.error = e

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def test_workers_drain_through_pgbouncer_in_transaction_mode(
    pg_url, schema, conn, bouncer, start_pooled_worker
):
    create_executions_table(conn, schema)
    sampler = ConnectionSampler(pg_url, bouncer)
    sampler.start()

    # Sends go through the pooler too, with more of them than psycopg's prepare threshold.
    sender = PostgresBroker(url=bouncer.url, schema=schema, listen=False, prepared_statements=False)
    actors = declare(sender)
    ids = {actors["quick"].send().message_id for _ in range(JOBS)}
    sender.close()

    workers = [start_pooled_worker(threads=THREADS, **POOLED) for _ in range(WORKERS)]

    def logs() -> str:
        return "\n\n".join(w.log_tail(30) for w in workers) + "\npgbouncer:\n" + bouncer.log_tail()

    def statuses() -> collections.Counter:
        rows = conn.execute(
            f'SELECT status, count(*) FROM "{schema}".all_jobs WHERE queue_name = %s GROUP BY 1',
            (QUEUE,),
        ).fetchall()
        return collections.Counter(dict(rows))

    wait_for(lambda: statuses()["succeeded"] == JOBS, 150, "every job to succeed", on_timeout=logs)
    sampler.stop()
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(60) == 0, logs()

    assert sampler.error is None, f"sampling connections failed: {sampler.error!r}"
    assert statuses() == {"succeeded": JOBS}

    runs = collections.Counter(
        job_id
        for (job_id,) in conn.execute(
            f"SELECT job_id::text FROM \"{schema}\".executions WHERE phase = 'start'"
        ).fetchall()
    )
    assert set(runs) == ids, "every job ran, and only the jobs that were sent"
    assert max(runs.values()) == 1, f"jobs that ran twice: {[j for j, n in runs.items() if n > 1]}"
    events = conn.execute(
        f'SELECT type, count(*), count(DISTINCT job_id) FROM "{schema}".job_events '
        "WHERE type IN ('claimed', 'succeeded') GROUP BY type"
    ).fetchall()
    assert sorted(events) == [("claimed", JOBS, JOBS), ("succeeded", JOBS, JOBS)]

    for worker in workers:
        text = worker.log_path.read_text(errors="replace")
        bad = [line for line in text.splitlines() if ERROR_RE.search(line)]
        assert not bad, "errors in a worker log:\n" + "\n".join(bad[:20])
    assert not bouncer.errors(), "errors in the pgbouncer log:\n" + "\n".join(bouncer.errors())

    # The point of the pooler: many clients, a bounded number of server connections.
    assert sampler.samples > 10, "the sampler should have run during the drain"
    assert sampler.max_clients > POOL_SIZE, (
        f"the workers should hold more client connections ({sampler.max_clients}) than the "
        f"pool has server connections ({POOL_SIZE})"
    )
    assert 1 <= sampler.max_server <= POOL_SIZE, (
        f"{sampler.max_server} server connections from the pooler; its pool size is {POOL_SIZE}"
    )
