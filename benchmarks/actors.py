"""The benchmark actors, on the broker named by ``BENCH_BROKER``.

Both the worker (``python -m dramatiq benchmarks.actors --processes 1 --threads 8``) and the
client processes import this module, so every broker runs the very same actors:

- ``BENCH_BROKER``: ``postgres`` (configured by the ``DRAMATIQ_PG_*`` variables),
  ``redis`` or ``rabbitmq`` (the local servers, under names only the benchmark uses);
- ``BENCH_QUEUES``: how many queues the worker consumes (default 1: the benchmark queue;
  more adds idle queues ``dramatiq_bench_2``, ..., for the idle-cost workload);
- ``BENCH_STATE_DIR``: where the worker reports to the harness (a ready file when it has
  booted, ``drain.json`` once ``BENCH_EXPECT`` messages are done, latency samples);
- ``BENCH_COUNT_STATEMENTS``: when set, each worker process counts the SQL statements it
  sends (every psycopg ``Cursor.execute``: the statements a server's statement log would
  show) and writes the count, with the time, to ``statements-<pid>.json`` five times a
  second once it has booted.
"""

from __future__ import annotations

import json
import os
import threading
import time

import dramatiq
from dramatiq.middleware import Middleware

QUEUE = "dramatiq_bench"
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_NAMESPACE = "dramatiq_bench"
RABBITMQ_URL = os.environ.get("BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")

KIND = os.environ.get("BENCH_BROKER", "postgres")
STATE_DIR = os.environ.get("BENCH_STATE_DIR")
EXPECT = int(os.environ.get("BENCH_EXPECT", "0"))
QUEUES = int(os.environ.get("BENCH_QUEUES", "1"))
COUNT_STATEMENTS = bool(os.environ.get("BENCH_COUNT_STATEMENTS"))
_statements = 0
_statements_lock = threading.Lock()


def _count_statements() -> None:
    """Count every statement this process sends through psycopg (see the module docstring)."""
    import psycopg

    original = psycopg.Cursor.execute

    def execute(self, *args, **kwargs):
        global _statements
        with _statements_lock:
            _statements += 1
        return original(self, *args, **kwargs)

    psycopg.Cursor.execute = execute


def _report_statements() -> None:
    while True:
        _write_json(
            f"statements-{os.getpid()}.json", {"statements": _statements, "at": time.time()}
        )
        time.sleep(0.2)


def make_broker(kind: str) -> dramatiq.Broker:
    if kind == "postgres":
        from dramatiq_pg_broker import PostgresBroker

        return PostgresBroker()
    if kind == "redis":
        from dramatiq.brokers.redis import RedisBroker

        return RedisBroker(url=REDIS_URL, namespace=REDIS_NAMESPACE)
    if kind == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=RABBITMQ_URL)
    raise SystemExit(f"BENCH_BROKER={kind!r}: expected postgres, redis or rabbitmq")


def _state_path(name: str) -> str | None:
    return os.path.join(STATE_DIR, name) if STATE_DIR else None


def _write_json(name: str, data: dict) -> None:
    path = _state_path(name)
    if path is None:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


class BenchReporter(Middleware):
    """Tells the harness when the worker is up and when ``BENCH_EXPECT`` messages are done.

    The drain clock runs from the first message starting to the ``BENCH_EXPECT``-th
    outcome being settled; for this broker, "settled" means written to the database
    (the pending outcomes are flushed before the time is taken), the strictest reading.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first_start: float | None = None
        self.done = 0

    def after_worker_boot(self, broker, worker) -> None:
        _write_json(f"ready-{os.getpid()}.json", {"pid": os.getpid(), "at": time.time()})
        if COUNT_STATEMENTS:
            threading.Thread(target=_report_statements, daemon=True).start()

    def before_process_message(self, broker, message) -> None:
        if self.first_start is None:
            with self.lock:
                if self.first_start is None:
                    self.first_start = time.time()

    def _settled(self, broker) -> None:
        with self.lock:
            self.done += 1
            finished = EXPECT and self.done == EXPECT
        if finished:
            outcomes = getattr(broker, "outcomes", None)
            if outcomes is not None:
                outcomes.flush(timeout=60)
            _write_json("drain.json", {"first_start": self.first_start, "done": time.time()})

    def after_ack(self, broker, message) -> None:
        self._settled(broker)

    def after_nack(self, broker, message) -> None:
        self._settled(broker)


if COUNT_STATEMENTS:
    _count_statements()
broker = make_broker(KIND)
broker.add_middleware(BenchReporter())
dramatiq.set_broker(broker)

_latency_fd: int | None = None
_latency_lock = threading.Lock()


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def noop(i: int = 0) -> None:
    """Does nothing: the benchmark measures the broker, not the work."""


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def sink(*args) -> None:
    """Takes whatever a workflow's step passes on, and does nothing (the workflow
    workload)."""


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def stamp(sent_at: float) -> None:
    """Records how long ago ``sent_at`` (taken right before ``send()``) was."""
    global _latency_fd
    started = time.time()
    path = _state_path("latency.txt")
    if path is None:
        return
    with _latency_lock:
        if _latency_fd is None:
            _latency_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(_latency_fd, f"{started - sent_at:.6f}\n".encode())


def _idle_actor(n: int) -> dramatiq.Actor:
    def idle() -> None:
        """Never sent: its queue only makes the worker consume one more queue."""

    return dramatiq.actor(idle, actor_name=f"idle_{n}", queue_name=f"{QUEUE}_{n}")


IDLE_ACTORS = [_idle_actor(n) for n in range(2, QUEUES + 1)]
