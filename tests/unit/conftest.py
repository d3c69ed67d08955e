"""Fixtures of the unit tests (no database): a broker whose job store lives in memory."""

from __future__ import annotations

import uuid

import dramatiq
import pytest

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.jobs import Attempt

from .memory_store import InMemoryJobStore

#: A URL nothing listens on: a test that reaches for the database fails at once.
NO_DATABASE = "postgresql://nobody@127.0.0.1:9/none?connect_timeout=1"


@pytest.fixture
def memory_store() -> InMemoryJobStore:
    return InMemoryJobStore()


@pytest.fixture
def memory_broker(memory_store):
    """A broker whose job store is ``memory_store``: its ledger, consumers and outcome
    writer are the real ones. Its claim window stays at the prefetch (no growth: claims
    here take microseconds, which would make growth depend on the test's own speed), and
    it polls every 10 ms without LISTEN."""
    broker = PostgresBroker(
        url=NO_DATABASE,
        schema="memory",
        store=memory_store,
        listen=False,
        poll_interval=0.01,
        prefetch_growth=1,
    )
    yield broker
    broker.close()


@pytest.fixture
def queue() -> str:
    return f"q_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def actor(memory_broker, queue):
    """An actor of the test's queue that does nothing (its messages are sent through the
    broker's real send path, into the memory store)."""

    @dramatiq.actor(broker=memory_broker, queue_name=queue, actor_name=f"noop_{queue}")
    def noop(n=0):
        pass

    return noop


#: The lease owner of the attempts :func:`claim` makes.
OWNER = "worker-1"


@pytest.fixture
def claim(memory_broker, memory_store, actor, queue):
    """``claim(slots=None, **options)``: send a message, claim it as a consumer would, and
    hand the attempt to the broker's ledger (``options``: ``leased_until``,
    ``start_first``); returns the :class:`~dramatiq_pg_broker.jobs.Attempt`. Attempts
    share a consumer's slots (prefetch 4) unless ``slots`` is given."""
    shared = memory_broker.ledger.slots(4)

    def claim(slots=None, **options) -> Attempt:
        actor.send()
        (job,) = memory_store.claim(queue, 1, OWNER, memory_broker.settings.lease_seconds)
        attempt = Attempt(job.id, OWNER, job.attempts)
        memory_broker.ledger.claimed(shared if slots is None else slots, attempt, **options)
        return attempt

    return claim
