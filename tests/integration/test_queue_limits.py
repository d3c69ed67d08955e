"""Queue limits against real PostgreSQL: the limited claim never lets more of a queue's jobs
run than its limit, however many connections claim at once; operators set and clear
limits (and win over limits set in code); in-process workers hold a limited queue to its
limit, learn a change without restart and give back what they prefetched before it."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import uuid

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.control import limits as queue_limits
from dramatiq_pg_broker.control import queues as queue_control
from dramatiq_pg_broker.errors import InvalidQueueLimit, InvalidQueueName, QueueNotDeclared
from dramatiq_pg_broker.jobs import Attempt, JobStore, NewJob, channel_name
from dramatiq_pg_broker.queue_rules import MAX_LIMIT

from ..helpers import wait_for
from .harness import declared_queue, repeatable_read_store, start_worker, stop_workers

pytestmark = pytest.mark.timeout(120)


def send(store: JobStore, queue: str, n: int = 1) -> list[str]:
    ids = [str(uuid.uuid4()) for _ in range(n)]
    for job_id in ids:
        store.enqueue(
            NewJob(id=job_id, queue_name=queue, actor_name="tests.a", message={}, max_attempts=3)
        )
    return ids


def running(pg_url: str, schema: str, queue: str) -> int:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        return conn.execute(
            sql.SQL(
                "SELECT count(*) FROM {}.jobs WHERE queue_name = %s AND status = 'running'"
            ).format(sql.Identifier(schema)),
            (queue,),
        ).fetchone()[0]


def set_limit(store: JobStore, queue: str, limit: int | None, **kwargs):
    with store.pool.connection() as conn:
        return queue_limits.set_limit(conn, store.schema, queue, limit, by="ops", **kwargs)


# -- the claim ------------------------------------------------------------------------------


def test_the_limited_claim_takes_only_the_room_left_under_the_limit(store):
    queue = declared_queue(store)
    send(store, queue, 10)
    set_limit(store, queue, 3)
    first = store.claim_limited(queue, 2, "w1", 30)
    assert len(first.jobs) == 2 and first.queue_limit == 3 and not first.at_limit
    second = store.claim_limited(queue, 5, "w2", 30)
    assert len(second.jobs) == 1, "3 may run: 2 run, so 1 more"
    full = store.claim_limited(queue, 5, "w3", 30)
    assert full.jobs == [] and full.at_limit and full.queue_limit == 3
    assert store.limited_room(queue, 30) == 0
    # A finished job frees its place.
    store.complete([Attempt(first.jobs[0].id, "w1", first.jobs[0].attempts)])
    assert store.limited_room(queue, 30) == 1
    assert len(store.claim_limited(queue, 5, "w3", 30).jobs) == 1
    # Raised: the room follows at once, without any worker's cache.
    set_limit(store, queue, 6)
    assert len(store.claim_limited(queue, 10, "w4", 30).jobs) == 3
    # Cleared: the claim is bounded only by what was asked.
    set_limit(store, queue, None)
    cleared = store.claim_limited(queue, 10, "w5", 30)
    assert cleared.queue_limit is None and len(cleared.jobs) == 3, "the 3 left, 6 running"


def test_a_running_job_whose_lease_ran_out_holds_no_place(store):
    """A worker died with the queue's one place: once its lease ran out, the place is free
    to the next claim, before any reaper took the job back (which stays running until
    then); a lease that ran out within a lease of the server's start still counts."""
    queue = declared_queue(store)
    send(store, queue, 3)
    set_limit(store, queue, 1)
    dead = store.claim_limited(queue, 1, "dead", 5)
    assert len(dead.jobs) == 1
    assert store.claim_limited(queue, 1, "w2", 5).at_limit
    later = store.server_now() + dt.timedelta(seconds=6)
    assert store.limited_room(queue, 5, now=later) == 1
    # The server must have been up for the whole lease a claim names: a day's lease, no.
    assert store.limited_room(queue, 86_400, now=later) == 0
    taken = store.claim_limited(queue, 1, "w2", 5, now=later)
    assert len(taken.jobs) == 1 and not taken.at_limit
    assert store.get(dead.jobs[0].id)["status"] == "running", "reaped: the test is void"
    assert store.claim_limited(queue, 1, "w3", 5, now=later).at_limit, "one place only"


def test_an_empty_limited_queue_reports_its_next_delayed_job_like_the_plain_claim(store):
    queue = declared_queue(store)
    set_limit(store, queue, 2)
    claim = store.claim_limited(queue, 2, "w1", 30)
    assert claim.jobs == [] and not claim.at_limit
    assert claim.seconds_until_available is None and claim.lease_seconds_left is not None


def test_a_paused_queue_at_its_limit_claims_nothing_as_paused_not_at_its_limit(store):
    """At its limit, a paused queue's claim says paused: its consumers then wait for the
    resume's announcement, where "at its limit" has them look again every 25 ms for as
    long as the running jobs last."""
    queue = declared_queue(store)
    send(store, queue, 3)
    set_limit(store, queue, 1)
    assert len(store.claim_limited(queue, 1, "w1", 30).jobs) == 1
    with store.pool.connection() as conn:
        queue_control.pause(conn, store.schema, queue, by="ops")
    paused = store.claim_limited(queue, 1, "w2", 30)
    assert paused.jobs == [] and paused.paused and not paused.at_limit
    assert paused.queue_limit == 1
    with store.pool.connection() as conn:
        queue_control.resume(conn, store.schema, queue, by="ops")
    resumed = store.claim_limited(queue, 1, "w2", 30)
    assert resumed.jobs == [] and resumed.at_limit and not resumed.paused


@pytest.mark.parametrize("limit", [1, 4])
def test_concurrent_claimers_on_their_own_connections_never_exceed_the_limit(store, pg_url, limit):
    """Twelve threads, each with its own connection, released together by a barrier, claim
    the same limited queue in rounds; after every round the running jobs are counted."""
    queue = declared_queue(store)
    send(store, queue, 200)
    set_limit(store, queue, limit)
    claimers = 12
    barrier = threading.Barrier(claimers)
    claimed: list[list[str]] = [[] for _ in range(claimers)]
    errors: list[BaseException] = []
    maxima: list[int] = []

    def claim(i: int) -> None:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            for _ in range(5):
                try:
                    barrier.wait(timeout=30)
                    got = store.claim_limited(queue, 3, f"w{i}", 30, conn=conn)
                    claimed[i].extend(job.id for job in got.jobs)
                    barrier.wait(timeout=30)
                    if i == 0:
                        maxima.append(running(pg_url, store.schema, queue))
                    barrier.wait(timeout=30)
                    # Each claimer finishes what it claimed; the next round claims again.
                    mine = [j for j in got.jobs]
                    store.complete([Attempt(j.id, f"w{i}", j.attempts) for j in mine], conn=conn)
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    barrier.abort()
                    return

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(claimers)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert time.monotonic() - started < 60, "the claims took too long"
    ids = [job_id for got in claimed for job_id in got]
    assert len(ids) == len(set(ids)), "a job was claimed twice"
    assert maxima == [limit] * 5, (
        f"after each round of 12 simultaneous claims, the running jobs were {maxima}: the "
        f"limit is {limit}"
    )
    assert len(ids) == 5 * limit


def test_limited_claims_hold_the_limit_without_errors_on_a_repeatable_read_database(pg_url, schema):
    """A database whose default isolation is REPEATABLE READ (``ALTER DATABASE ... SET
    default_transaction_isolation``; here the connections' ``options``): the limited
    claim's room is still read with a snapshot taken once the queue's lock is granted.
    It was taken by the lock's own statement, before the wait: every claim that waited
    for another saw the queue as before it, and its claim statement then met the rows
    that one took, a serialization failure (55 of 60 claims in this test), or counted
    too few running jobs."""
    with repeatable_read_store(pg_url, schema) as store:
        queue = declared_queue(store)
        send(store, queue, 100)
        set_limit(store, queue, 1)
        claimers = 12
        barrier = threading.Barrier(claimers)
        errors: list[BaseException] = []
        maxima: list[int] = []

        def claim(i: int) -> None:
            for _ in range(5):
                try:
                    barrier.wait(timeout=30)
                    got = store.claim_limited(queue, 3, f"w{i}", 30)
                    barrier.wait(timeout=30)
                    if i == 0:
                        maxima.append(running(pg_url, store.schema, queue))
                    barrier.wait(timeout=30)
                    store.complete([Attempt(j.id, f"w{i}", j.attempts) for j in got.jobs])
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    barrier.abort()
                    return

        threads = [threading.Thread(target=claim, args=(i,)) for i in range(claimers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, f"{len(errors)} claims failed: {errors[:3]}"
        assert maxima == [1] * 5, f"running after each round: {maxima}, the limit is 1"


def test_the_plain_claim_statement_is_unchanged_for_an_unlimited_queue(store):
    """An unlimited queue's consumer never reads the limits table in its claim: the plain
    statement does not name it."""
    assert "queue_limits" not in store.queries["claim_jobs"]


# -- setting and clearing -------------------------------------------------------------------


def test_setting_a_limit_is_recorded_announced_and_refused_when_malformed(store, pg_url):
    queue = declared_queue(store)
    with psycopg.connect(pg_url, autocommit=True) as listener:
        listener.execute(
            sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(store.schema, queue)))
        )
        limit = set_limit(store, queue, 5)
        assert [n.payload for n in listener.notifies(timeout=2, stop_after=1)] == ["limit"]
        assert set_limit(store, queue, None) is None
        assert [n.payload for n in listener.notifies(timeout=2, stop_after=1)] == ["limit"]
    assert (limit.limit, limit.source, limit.set_by) == (5, "operator", "ops")
    for bad in (0, -1, 2.5, "3", True, MAX_LIMIT + 1):
        with pytest.raises(InvalidQueueLimit, match="whole number from 1"):
            set_limit(store, queue, bad)
    with pytest.raises(InvalidQueueName):
        set_limit(store, "9lives", 3)
    ahead = f"ahead_{uuid.uuid4().hex[:8]}"
    with pytest.raises(QueueNotDeclared, match="no worker has declared queue"):
        set_limit(store, ahead, 3)
    assert set_limit(store, ahead, 3, force=True).limit == 3


def test_a_limit_in_code_is_written_at_boot_and_an_operators_limit_wins(store):
    queue = declared_queue(store)
    other = declared_queue(store)
    with store.pool.connection() as conn:
        assert queue_limits.apply_declared(conn, store.schema, {queue: 4}, by="worker a") == [queue]
        got = queue_limits.get(conn, store.schema, queue)
        assert (got.limit, got.source) == (4, "code")
        # Another deploy's code changes it; the same value again changes nothing.
        assert queue_limits.apply_declared(conn, store.schema, {queue: 6}, by="b") == [queue]
        assert queue_limits.apply_declared(conn, store.schema, {queue: 6}, by="c") == []
    # The operator's limit stands against every later boot's setting...
    set_limit(store, queue, 2)
    set_limit(store, other, 9)
    with store.pool.connection() as conn:
        assert queue_limits.apply_declared(conn, store.schema, {queue: 6, other: 1}, by="d") == []
        assert queue_limits.get(conn, store.schema, queue).limit == 2
        assert queue_limits.get(conn, store.schema, other).limit == 9
    # ...until it is cleared: the next boot sets the code's limit again.
    set_limit(store, queue, None)
    with store.pool.connection() as conn:
        assert queue_limits.apply_declared(conn, store.schema, {queue: 6}, by="e") == [queue]
        assert queue_limits.get(conn, store.schema, queue).source == "code"


def test_a_worker_booted_with_queue_limits_writes_them(pg_url, schema):
    queue = f"ql_{uuid.uuid4().hex[:8]}"
    previous = dramatiq.broker.global_broker
    broker = PostgresBroker(url=pg_url, schema=schema, queue_limits={queue: 3})
    workers: list[dramatiq.Worker] = []
    try:
        dramatiq.actor(lambda: None, actor_name=f"noop_{queue}", queue_name=queue, broker=broker)
        start_worker(broker, workers, threads=2)

        def written():
            with broker.pool.connection() as conn:
                return queue_limits.get(conn, schema, queue)

        limit = wait_for(written, 10, "the worker to write its queue limit")
        assert (limit.limit, limit.source) == (3, "code")
        assert limit.set_by.startswith("worker ")
    finally:
        stop_workers(workers)
        broker.close()
        dramatiq.broker.global_broker = previous


# -- workers --------------------------------------------------------------------------------


class Sampler:
    """Counts a queue's running jobs from the database every 20 ms, in its own thread."""

    def __init__(self, pg_url: str, schema: str, queue: str) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._args = (pg_url, schema, queue)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pg_url, schema, queue = self._args
        query = sql.SQL(
            "SELECT count(*) FROM {}.jobs WHERE queue_name = %s AND status = 'running'"
        ).format(sql.Identifier(schema))
        with psycopg.connect(pg_url, autocommit=True) as conn:
            while not self._stop.is_set():
                n = conn.execute(query, (queue,)).fetchone()[0]
                self.samples.append((time.monotonic(), n))
                self._stop.wait(0.02)

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join(5)
        return self.samples

    def max_between(self, start: float, end: float) -> int:
        return max((n for t, n in self.samples if start <= t < end), default=0)


def test_workers_hold_a_limited_queue_to_its_limit_and_learn_a_change_at_once(h, store):
    """Two in-process workers of 4 threads each drain a queue limited to 2; the limit goes
    to 1 mid-drain; the running jobs never exceed the limit in force (the jobs running
    when it dropped finish: within their 0.1 s, plus the claims' turn, of the change)."""
    queue = declared_queue(store, h.queue)
    set_limit(store, queue, 2)
    brokers = [h.broker(), h.broker()]
    for broker in brokers:

        @dramatiq.actor(broker=broker, queue_name=queue, actor_name="limited_sleep")
        def limited_sleep(n):
            time.sleep(0.1)

    jobs = [limited_sleep.send(n).message_id for n in range(40)]
    sampler = Sampler(store.pool.url, store.schema, queue)
    for broker in brokers:
        h.start(broker, threads=4)
    wait_for(lambda: store.count_unfinished(queue) <= 30, 30, "the workers to start draining")
    changed = time.monotonic()
    set_limit(store, queue, 1)
    wait_for(lambda: store.count_unfinished(queue) == 0, 60, "the queue to drain")
    samples = sampler.stop()
    assert max(n for _, n in samples) >= 2, "the queue never ran at its limit: the test is void"
    assert sampler.max_between(0, changed) <= 2, samples
    assert sampler.max_between(changed + 0.5, time.monotonic()) <= 1, samples
    assert all(store.get(j)["status"] == "succeeded" for j in jobs)


def test_a_worker_gives_back_its_prefetch_when_its_queue_becomes_limited(h, store):
    """A worker with 2 threads prefetched a busy unlimited queue; a limit of 1 makes it
    give back, uncharged, what it claimed and had not started."""
    queue = declared_queue(store, h.queue)
    broker = h.broker()
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=queue, actor_name="blocked")
    def blocked(n):
        release.wait(10)

    for n in range(12):
        blocked.send(n)
    h.start(broker, threads=2)
    wait_for(lambda: running(store.pool.url, store.schema, queue) > 2, 10, "a prefetch")
    set_limit(store, queue, 1)
    try:
        # The two started jobs keep running; the prefetched ones go back.
        wait_for(
            lambda: running(store.pool.url, store.schema, queue) == 2,
            5,
            "the prefetched messages to go back",
        )
    finally:
        release.set()
    wait_for(lambda: store.count_unfinished(queue) == 0, 30, "the queue to drain")


def test_a_worker_of_a_paused_queue_at_its_limit_waits_for_the_resume(h, store):
    """A queue limited to 1 runs its one job on a worker of 2 threads when an operator
    pauses it: the worker's consumer stops claiming until the resume, instead of trying
    the limited claim every LIMIT_RETRY_SECONDS while the job runs (40 statements a
    second before). Polled every 5 s: an idle consumer's one look in the span observed."""
    queue = declared_queue(store, h.queue)
    set_limit(store, queue, 1)
    broker = h.broker(poll_interval=5.0)
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=queue, actor_name="held_paused")
    def held_paused(n):
        release.wait(20)

    claims = []
    claim_limited = broker.store.claim_limited

    def counted(*args, **kwargs):
        claim = claim_limited(*args, **kwargs)
        claims.append((time.monotonic(), claim))
        return claim

    broker.store.claim_limited = counted
    for n in range(2):
        held_paused.send(n)
    h.start(broker, threads=2)
    try:
        wait_for(lambda: running(store.pool.url, store.schema, queue) == 1, 10, "a job to run")
        wait_for(lambda: any(c.at_limit for _, c in claims), 5, "a claim at the limit")
        with store.pool.connection() as conn:
            queue_control.pause(conn, store.schema, queue, by="ops")
        wait_for(lambda: any(c.paused for _, c in claims), 5, "a claim to find the pause")
        since = time.monotonic()
        time.sleep(1.0)  # the span observed: 40 claims in it before
        during = [c for t, c in claims if t >= since]
        assert len(during) <= 1, f"{len(during)} claims of a paused queue in 1 s"
        with store.pool.connection() as conn:
            queue_control.resume(conn, store.schema, queue, by="ops")
        wait_for(lambda: claims[-1][1].at_limit, 5, "a claim after the resume")
    finally:
        release.set()
    wait_for(lambda: store.count_unfinished(queue) == 0, 30, "the queue to drain")


def test_an_idle_worker_that_missed_a_limit_s_announcement_learns_it_at_its_listen_s_return(
    h, store
):
    """A limit set while a worker's LISTEN connection was away (its NOTIFY unheard; here
    written without one) is read at the first claim the connection's return prompts, as
    the guide promises ("a lost notification costs at most that second"). An idle worker
    read the limits only while its last claim had found work: it claimed the next jobs by
    the plain statement, 3 running at once under a limit of 1."""
    queue = declared_queue(store, h.queue)
    broker = h.broker()
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=queue, actor_name="held")
    def held(n):
        release.wait(10)

    h.start(broker, threads=3)
    limits = broker.queue_limits
    listening = (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE %s"
    )
    with psycopg.connect(store.pool.url, autocommit=True) as conn:
        pattern = f"LISTEN%{channel_name(store.schema, queue)}%"
        wait_for(lambda: conn.execute(listening, (pattern,)).fetchall(), 10, "the worker to listen")
        # Idle, with limits read more than REFRESH_SECONDS ago.
        wait_for(
            lambda: (
                limits._read_at is not None
                and time.monotonic() - limits._read_at > queue_limits.REFRESH_SECONDS
            ),
            10,
            "the worker's last read of the limits to age",
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.queue_limits (queue_name, max_running, source, set_by, set_at) "
                "VALUES (%s, 1, 'operator', 'ops', now())"
            ).format(sql.Identifier(store.schema)),
            (queue,),
        )
        # The LISTEN connection breaks and comes back (its announcement was lost).
        [(pid,)] = conn.execute(listening, (pattern,)).fetchall()
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(
            lambda: [r for r in conn.execute(listening, (pattern,)).fetchall() if r[0] != pid],
            10,
            "the worker to listen again",
        )
        wait_for(lambda: limits._limits.get(queue) == 1, 5, "the worker to read the limit")
    for n in range(3):
        held.send(n)
    try:
        wait_for(lambda: running(store.pool.url, store.schema, queue) >= 1, 10, "a job to run")
        # A second claim would come within LIMIT_RETRY_SECONDS: give it ten times that.
        deadline = time.monotonic() + 0.25
        while time.monotonic() < deadline:
            assert running(store.pool.url, store.schema, queue) == 1, "over the limit of 1"
    finally:
        release.set()
    wait_for(lambda: store.count_unfinished(queue) == 0, 30, "the queue to drain")


# -- the command line -----------------------------------------------------------------------


def test_queues_limit_sets_lists_and_clears_a_limit(store, run):
    queue = declared_queue(store)
    send(store, queue)
    code, out, _ = run("queues", "limit", queue, "3")
    assert code == 0 and out.startswith(f"queue {queue} is limited to 3 running job(s)")
    code, out, _ = run("queues", "list")
    header = out.splitlines()[0].split()
    row = next(line.split() for line in out.splitlines() if line.startswith(queue))
    # The queue has no live worker: "no worker", its job ready.
    assert header[2] == "LIMIT" and row[1:5] == ["no", "worker", "3", "1"]
    code, out, _ = run("queues", "list", "--json")
    listed = {q["queue_name"]: q for q in json.loads(out)}
    assert listed[queue]["limit"] == 3 and listed[queue]["limit_source"] == "operator"
    assert listed[queue]["limit_set_by"].startswith("cli")
    code, out, _ = run("queues", "limit", queue, "5", "--json")
    assert code == 0 and json.loads(out)["limit"] == 5
    code, out, _ = run("queues", "limit", queue, "--clear")
    assert code == 0 and out.startswith(f"queue {queue} has no limit")
    code, out, _ = run("queues", "list", "--json")
    assert {q["queue_name"]: q for q in json.loads(out)}[queue]["limit"] is None
    code, out, _ = run("queues", "list")
    row = next(line.split() for line in out.splitlines() if line.startswith(queue))
    assert row[3] == "-"


def test_queues_limit_refuses_what_is_not_a_limit_in_one_line(store, run):
    queue = declared_queue(store)
    for args in ([queue, "0"], [queue, "-2"], [queue, "three"], [queue, "2.5"]):
        code, _, err = run("queues", "limit", *args)
        assert code == 2 and "is not a limit: give a whole number from 1" in err, err
    code, _, err = run("queues", "limit", queue)
    assert code == 2 and "give either a limit" in err
    code, _, err = run("queues", "limit", queue, "3", "--clear")
    assert code == 2 and "give either a limit" in err
    name = f"later_{uuid.uuid4().hex[:6]}"
    code, _, err = run("queues", "limit", name, "2")
    assert code == 2 and "no worker has declared queue" in err and err.count("\n") == 1
    code, out, _ = run("queues", "limit", name, "2", "--force")
    assert code == 0 and "is limited to 2" in out
