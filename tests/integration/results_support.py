"""Brokers for the backend tests: this package's PostgresBroker and Dramatiq's Redis and
RabbitMQ brokers (the shared servers on 6379 and 5672), each with an in-process worker.

Redis and RabbitMQ are shared with other test runs: every broker here uses its own
namespace or queue names and removes them afterwards; nothing is flushed globally.
"""

from __future__ import annotations

import os
import uuid

import dramatiq
import pytest

from dramatiq_pg_broker import PostgresBroker

from .harness import start_worker, stop_workers

REDIS_URL = os.environ.get("DRAMATIQ_PG_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get(
    "DRAMATIQ_PG_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"
)

BROKER_KINDS = ["postgres", "redis", "rabbitmq"]


class BrokerHarness:
    """One broker of a kind, made Dramatiq's global broker (group and pipeline use it), a
    unique queue name, and in-process workers; :meth:`close` undoes all of it."""

    def __init__(self, kind: str, pg_url: str, schema: str) -> None:
        self.kind = kind
        self.queue = f"q_{uuid.uuid4().hex[:10]}"
        self._previous = dramatiq.broker.global_broker
        self.workers: list[dramatiq.Worker] = []
        if kind == "postgres":
            self.broker = PostgresBroker(url=pg_url, schema=schema, poll_interval=0.1)
        elif kind == "redis":
            redis = pytest.importorskip("redis")
            from dramatiq.brokers.redis import RedisBroker

            try:
                redis.Redis.from_url(REDIS_URL).ping()
            except redis.RedisError as e:
                pytest.skip(f"no Redis at {REDIS_URL}: {e}")
            self.broker = RedisBroker(url=REDIS_URL, namespace=f"pgtest-{uuid.uuid4().hex}")
        elif kind == "rabbitmq":
            pika = pytest.importorskip("pika")
            from dramatiq.brokers.rabbitmq import RabbitmqBroker

            try:
                pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL)).close()
            except pika.exceptions.AMQPError as e:
                pytest.skip(f"no RabbitMQ at {RABBITMQ_URL}: {e}")
            self.broker = RabbitmqBroker(url=RABBITMQ_URL)
        else:  # pragma: no cover
            raise ValueError(kind)
        dramatiq.set_broker(self.broker)

    def start(self, threads: int = 4) -> dramatiq.Worker:
        return start_worker(self.broker, self.workers, threads=threads)

    def close(self) -> None:
        stop_workers(self.workers)
        if self.kind == "redis":
            client = self.broker.client
            keys = list(client.scan_iter(f"{self.broker.namespace}:*"))
            if keys:
                client.delete(*keys)
        elif self.kind == "rabbitmq":
            for queue_name in list(self.broker.queues):
                for name in (queue_name, f"{queue_name}.DQ", f"{queue_name}.XQ"):
                    try:
                        self.broker.channel.queue_delete(name)
                    except Exception:  # already gone, or the channel closed
                        pass
        self.broker.close()
        dramatiq.broker.global_broker = self._previous
