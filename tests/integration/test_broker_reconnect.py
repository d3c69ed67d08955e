"""A dropped database connection is survived: every backend of the worker is terminated
(pg_terminate_backend) while it works, twice; the consumer reconnects, sends retry, and no
job is lost or run twice."""

from __future__ import annotations

import threading
import time
import uuid

import dramatiq
import pytest

from dramatiq_pg_broker import PostgresBroker

from ..helpers import wait_for


def with_application_name(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


@pytest.mark.timeout(120)
def test_terminated_backends_are_survived(pg_url, schema, conn):
    app = f"pgb_drop_{uuid.uuid4().hex[:8]}"
    queue = f"q_{uuid.uuid4().hex[:8]}"
    broker = PostgresBroker(
        url=with_application_name(pg_url, app), schema=schema, poll_interval=0.2
    )
    runs: list[str] = []
    lock = threading.Lock()

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def work(n):
        time.sleep(0.05)
        with lock:
            runs.append(n)

    def terminate() -> int:
        killed = conn.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> pg_backend_pid()",
            (app,),
        ).fetchone()[0]
        return killed

    def backends(query_prefix="") -> int:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND query LIKE %s",
            (app, query_prefix + "%"),
        ).fetchone()[0]

    def count(status) -> int:
        return conn.execute(
            f'SELECT count(*) FROM "{schema}".all_jobs WHERE queue_name = %s AND status = %s',
            (queue, status),
        ).fetchone()[0]

    first = [work.send(n) for n in range(60)]
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        wait_for(lambda: len(runs) >= 10, 30, "the worker to get going")
        wait_for(lambda: backends("LISTEN") >= 1, 10, "the consumer to LISTEN")
        assert terminate() >= 2, "the worker's backends (pool and LISTEN) were not found"

        # Sending right after the drop: the pool hands out dead connections first.
        second = [work.send(n) for n in range(60, 80)]

        wait_for(lambda: len(runs) >= 40, 30, "work to resume after the first drop")
        assert terminate() >= 1
        wait_for(lambda: count("succeeded") == 80, 60, "all 80 jobs to succeed")
        # The consumer came back to LISTEN (not only polling).
        wait_for(lambda: backends("LISTEN") >= 1, 10, "the consumer to LISTEN again")
    finally:
        worker.stop(timeout=10_000)
        broker.close()

    assert count("succeeded") == 80 and count("failed") == 0, "a job was lost or failed"
    assert sorted(runs) == list(range(80)), (
        f"each job must run exactly once: ran {len(runs)} times for 80 jobs, "
        f"missing {sorted(set(range(80)) - set(runs))}"
    )
    assert len({m.message_id for m in first + second}) == 80


def test_send_after_the_server_dropped_every_pooled_connection(pg_url, schema, conn):
    """A pool full of dead connections (a database restart, a failover) must not exhaust
    the send's bounded retries: one failure is enough to learn they are all dead."""
    app = f"pgb_pool_{uuid.uuid4().hex[:8]}"
    queue = f"q_{uuid.uuid4().hex[:8]}"
    broker = PostgresBroker(url=with_application_name(pg_url, app), schema=schema, pool_min_size=6)

    @dramatiq.actor(broker=broker, queue_name=queue)
    def task(n):
        pass

    def pids() -> list[int]:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,)
        ).fetchall()
        return [r[0] for r in rows]

    try:
        task.send(0)
        pool = broker.pool.get()
        wait_for(
            lambda: pool.get_stats()["pool_available"] >= 6 and len(pids()) >= 6,
            10,
            "the pool to hold 6 idle connections",
        )
        dead = pids()
        conn.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (dead,))
        wait_for(lambda: not set(dead) & set(pids()), 10, "the pooled backends to go away")
        assert pool.get_stats()["pool_available"] >= 4, "the test needs dead idle connections"
        sent = [task.send(n) for n in range(1, 4)]
    finally:
        broker.close()
    ids = {m.message_id for m in sent}
    stored = conn.execute(
        f'SELECT id::text FROM "{schema}".all_jobs WHERE queue_name = %s', (queue,)
    ).fetchall()
    assert ids <= {r[0] for r in stored}


def test_an_outcome_that_committed_is_told_apart_from_a_lost_one(pg_url, schema):
    """What the outcome writer asks when its second try of an outcome finds the job no
    longer running: did an earlier try end it (the reply lost to a dropped connection), or
    did another worker take it? Only the first is ``finished_attempts``."""
    from dramatiq_pg_broker.config import Settings
    from dramatiq_pg_broker.db import ProcessPool
    from dramatiq_pg_broker.jobs import Attempt, JobStore, NewJob

    store = JobStore(ProcessPool(Settings(url=pg_url, schema=schema)), schema)
    queue = f"q_{uuid.uuid4().hex[:8]}"
    try:
        ids = [str(uuid.uuid4()) for _ in range(3)]
        for job_id in ids:
            store.enqueue(NewJob(job_id, queue, "a", message={}, max_attempts=3))
        claimed = {c.id: c for c in store.claim(queue, 10, "w1", 30)}
        attempts = {i: Attempt(i, "w1", claimed[i].attempts) for i in ids}
        done, failed, taken = ids
        assert store.complete([attempts[done]]) == {done}
        assert store.fail([attempts[failed]], ["ValueError: no"]) == {failed}
        # The second try of each finds nothing to change...
        assert store.complete([attempts[done]]) == set()
        # ...and the check says which were written, with which status, at which attempt.
        everything = list(attempts.values())
        assert store.finished_attempts(everything, "succeeded") == {done}
        assert store.finished_attempts(everything, "failed") == {failed}
        later = Attempt(done, "w1", attempts[done].attempt + 1)
        assert store.finished_attempts([later], "succeeded") == set()
        assert store.finished_attempts([attempts[taken]], "succeeded") == set()  # running
    finally:
        store.pool.close()


def test_a_server_out_of_connection_slots_is_saturation_not_an_outage(
    pg_url, schema, conn, monkeypatch, caplog
):
    """A real refusal for want of slots (a role whose connection limit is reached gets
    libpq's ``too many connections``, SQLSTATE 53300, as a full server's clients get ``too
    many clients``): one warning that says saturated, with the server's words, and no
    "unreachable" nor "reachable again" line, however often the pool tries."""
    import logging

    from dramatiq.errors import BrokerConnectionError
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from dramatiq_pg_broker.db import outage

    role = f"pgb_full_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN CONNECTION LIMIT 0").format(sql.Identifier(role)))
    monkeypatch.setattr(outage, "tracker", outage.Outage())
    url = make_conninfo("", **{**conninfo_to_dict(pg_url), "user": role, "password": None})
    broker = PostgresBroker(url=url, schema=schema, pool_timeout=1.5, enqueue_retries=0)
    try:

        @dramatiq.actor(broker=broker, queue_name=f"q_{uuid.uuid4().hex[:8]}")
        def nothing():
            pass

        with caplog.at_level(logging.DEBUG, logger="dramatiq_pg_broker"):
            with pytest.raises(BrokerConnectionError):
                nothing.send()
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("dramatiq_pg_broker")
        ]
        assert len(warnings) == 1, warnings
        assert "no free connection slot" in warnings[0] and "too many connections" in warnings[0]
        assert not outage.tracker.unreachable
    finally:
        broker.close()
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_waiter_whose_listen_connection_finds_no_slot_polls(pg_url, conn, monkeypatch):
    """A result reader (or rate-limiter waiter) blocks on the process's LISTEN connection;
    when the server refuses that connection a slot, the waiter looks at its table now and
    then instead of failing with a connection error."""
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from dramatiq_pg_broker.db import listener, outage

    role = f"pgb_full_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN CONNECTION LIMIT 0").format(sql.Identifier(role)))
    monkeypatch.setattr(outage, "tracker", outage.Outage())
    monkeypatch.setattr(listener, "SATURATED_POLL_SECONDS", 0.2, raising=False)
    url = make_conninfo("", **{**conninfo_to_dict(pg_url), "user": role, "password": None})
    looks = []

    def check():  # the table, read through the pool (which has its connections)
        looks.append(time.monotonic())
        return "stored" if len(looks) >= 4 else None

    waiting = listener.Listener(url)
    try:
        started = time.monotonic()
        assert waiting.wait_for("s:results", "key", check, timeout=20) == "stored"
        took = time.monotonic() - started
        assert took < 5, f"the waiter took {took:.1f}s: it did not poll"
        assert not outage.tracker.unreachable
    finally:
        waiting.close()
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
