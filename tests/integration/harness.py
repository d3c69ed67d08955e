"""In-process workers for the integration tests: brokers on the module's schema, a queue of
the test's own, and a record of what the actors did; declared queues and job timelines; a
store on a database whose default isolation is REPEATABLE READ, and racing threads."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator

import dramatiq
import psycopg

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.jobs import JobStore


def start_worker(
    broker: dramatiq.Broker,
    workers: list[dramatiq.Worker],
    *,
    threads: int = 1,
    prefetch: int | None = None,
    timeout: int = 100,
) -> dramatiq.Worker:
    """Start an in-process worker of ``broker`` and add it to ``workers``.

    Parameters:
      threads(int): its worker threads.
      prefetch(int): its ``queue_prefetch`` (Dramatiq's default: twice the threads).
      timeout(int): its ``worker_timeout`` in milliseconds: how long an idle consumer
        waits before it looks again (short, so that a stop is quick).
    """
    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=timeout)
    if prefetch is not None:
        worker.queue_prefetch = prefetch
    worker.start()
    workers.append(worker)
    return worker


def stop_workers(workers: list[dramatiq.Worker]) -> None:
    """Stop every worker of the list, each within 10 s."""
    for worker in workers:
        worker.stop(timeout=10_000)


class Harness:
    """Brokers on one schema, a unique queue, and in-process workers; :meth:`close` stops
    the workers, closes the brokers and gives Dramatiq its global broker back.

    The actors of a test append what they did to :attr:`runs` with :meth:`record` (from
    any worker thread); :meth:`ran` counts an entry.

    Parameters:
      pg_url(str), schema(str): the test database and the module's schema.
    """

    def __init__(self, pg_url: str, schema: str) -> None:
        self.pg_url = pg_url
        self.schema = schema
        self.queue = f"q_{uuid.uuid4().hex[:8]}"
        self.brokers: list[PostgresBroker] = []
        self.workers: list[dramatiq.Worker] = []
        self.runs: list[tuple] = []
        self.lock = threading.Lock()
        self.global_broker = dramatiq.broker.global_broker

    def broker(self, **options) -> PostgresBroker:
        """A new broker, also made Dramatiq's global one (group and pipeline use that)."""
        options.setdefault("poll_interval", 0.1)
        options.setdefault("url", self.pg_url)
        broker = PostgresBroker(schema=self.schema, **options)
        self.brokers.append(broker)
        dramatiq.set_broker(broker)
        return broker

    def noop(self, broker: PostgresBroker) -> dramatiq.Actor:
        """An actor of the test's queue, declared on ``broker``, that does nothing with its
        one argument."""
        return dramatiq.actor(
            lambda n: None, broker=broker, queue_name=self.queue, actor_name=f"noop_{self.queue}"
        )

    def recorder(self, broker: PostgresBroker, item: str = "ran", **options) -> dramatiq.Actor:
        """An actor of the test's queue, declared on ``broker``, that takes no argument and
        records ``item`` each time it runs. ``options`` are the actor's (``max_age``,
        ``actor_name`` ...); it is named ``item`` unless told otherwise."""
        options.setdefault("actor_name", item)
        return dramatiq.actor(
            lambda: self.record(item), broker=broker, queue_name=self.queue, **options
        )

    def record(self, *item) -> None:
        with self.lock:
            self.runs.append(item)

    def ran(self, *item) -> int:
        """How many times ``item`` was recorded."""
        with self.lock:
            return self.runs.count(item)

    def start(self, broker: PostgresBroker, threads: int = 2, **options) -> dramatiq.Worker:
        """An in-process worker of ``broker`` (see :func:`start_worker`)."""
        return start_worker(broker, self.workers, threads=threads, **options)

    def close(self) -> None:
        stop_workers(self.workers)
        for broker in self.brokers:
            broker.close()
        dramatiq.broker.global_broker = self.global_broker

    def rows(self, broker: PostgresBroker, conn) -> list[tuple]:
        """(id, status, attempts) of every job of the test's queue."""
        return conn.execute(
            f'SELECT id::text, status, attempts FROM "{self.schema}".all_jobs '
            "WHERE queue_name = %s",
            (self.queue,),
        ).fetchall()


def declared_queue(store: JobStore, name: str | None = None) -> str:
    """A queue declared as a worker of it declares it (a new name unless ``name`` is given);
    returns its name."""
    from dramatiq_pg_broker.control import queues

    name = name or f"dq_{uuid.uuid4().hex[:8]}"
    with store.pool.connection() as conn:
        queues.declare(conn, store.schema, [name])
    return name


def of_type(events: list[dict], kind: str) -> list[dict]:
    """The events of a job's timeline (``store.events_of``) of one type."""
    return [e for e in events if e["type"] == kind]


@contextlib.contextmanager
def repeatable_read_store(pg_url: str, schema: str) -> Iterator[JobStore]:
    """A job store on the module's schema whose connections default to REPEATABLE READ, as
    on a database with ``ALTER DATABASE ... SET default_transaction_isolation`` (here the
    connections' ``options``; the store's pool sets its own sessions back to READ
    COMMITTED, as it does on such a database); closed afterwards."""
    url = psycopg.conninfo.make_conninfo(
        pg_url, options="-c default_transaction_isolation=repeatable\\ read"
    )
    with psycopg.connect(url) as conn:
        assert conn.execute("SHOW default_transaction_isolation").fetchone()[0] == (
            "repeatable read"
        ), "the test is void"
    store = JobStore(ProcessPool(Settings(url=url, schema=schema)), schema)
    try:
        yield store
    finally:
        store.pool.close()


def race(threads: int, rounds: int, step: Callable[[int], None]) -> list[BaseException]:
    """``step(i)`` in ``threads`` threads (``i`` the thread's number), ``rounds`` times,
    every round's steps released together (a barrier); the errors they raised (the first
    one ends the race)."""
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        for _ in range(rounds):
            try:
                barrier.wait(timeout=30)
                step(i)
            except BaseException as e:  # noqa: BLE001 - returned to the test
                errors.append(e)
                barrier.abort()
                return

    started = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join(60)
    return errors
