"""Sending with no reachable server fails with Dramatiq's ConnectionError, within bounds."""

from __future__ import annotations

import time

import dramatiq
import psycopg
import pytest
from dramatiq.errors import BrokerConnectionError
from psycopg_pool import ConnectionPool

from dramatiq_pg_broker import PostgresBroker

#: Nothing listens on port 1: connections are refused at once.
UNREACHABLE = "postgresql://nobody@127.0.0.1:1/nowhere?connect_timeout=1"
POOL_TIMEOUT = 0.5


@pytest.fixture
def unreachable_broker():
    pool = ConnectionPool(
        UNREACHABLE, kwargs={"autocommit": True}, timeout=POOL_TIMEOUT, open=False
    )
    pool.open(wait=False)
    broker = PostgresBroker(pool=pool, schema="nowhere", enqueue_retries=3)
    yield broker
    pool.close()


def test_send_raises_dramatiq_connection_error_without_multiplying_the_pool_wait(
    unreachable_broker,
):
    @dramatiq.actor(broker=unreachable_broker, queue_name="q")
    def task():
        pass

    started = time.monotonic()
    with pytest.raises(BrokerConnectionError) as info:
        task.send()
    elapsed = time.monotonic() - started
    assert not isinstance(info.value, psycopg.Error), "a raw driver error escaped"
    assert isinstance(info.value.__cause__, psycopg.Error), "the driver's error was not kept"
    # The pool already waited its timeout for a connection; retrying would wait it again
    # for every retry (four times over with the default three retries).
    assert elapsed < 2 * POOL_TIMEOUT + 0.5, f"send took {elapsed:.2f}s to give up"
