"""Helpers for the operator-control tests: brokers on the module's schema, in-process
workers, a record of what the actors did, and bounded waits."""

from __future__ import annotations

import threading
import time
import uuid

import dramatiq

from dramatiq_pg_broker import PostgresBroker


def wait_until(predicate, timeout: float, what: str):
    """Poll ``predicate`` until it returns something true; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class Harness:
    """Brokers on one schema, each test with its own queue; in-process workers; ``runs``
    records (what, job id) pairs the actors append."""

    def __init__(self, pg_url: str, schema: str) -> None:
        self.pg_url = pg_url
        self.schema = schema
        self.queue = f"q_{uuid.uuid4().hex[:8]}"
        self.brokers: list[PostgresBroker] = []
        self.workers: list[dramatiq.Worker] = []
        self.runs: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._global_broker = dramatiq.broker.global_broker

    def broker(self, **options) -> PostgresBroker:
        options.setdefault("poll_interval", 0.1)
        options.setdefault("url", self.pg_url)
        broker = PostgresBroker(schema=self.schema, **options)
        self.brokers.append(broker)
        dramatiq.set_broker(broker)
        return broker

    def record(self, what: str, job_id: str) -> None:
        with self._lock:
            self.runs.append((what, job_id))

    def ran(self, what: str, job_id: str) -> int:
        with self._lock:
            return self.runs.count((what, job_id))

    def start(self, broker: PostgresBroker, threads: int = 2) -> dramatiq.Worker:
        worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=100)
        worker.start()
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            worker.stop(timeout=10_000)
        for broker in self.brokers:
            broker.close()
        dramatiq.broker.global_broker = self._global_broker
