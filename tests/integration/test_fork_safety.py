"""The dramatiq CLI forks worker processes: a child must not act on its parent's state."""

from __future__ import annotations

import multiprocessing
import uuid

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.jobs import Attempt


def test_a_forked_child_renews_none_of_its_parents_attempts(pg_url, schema):
    broker = PostgresBroker(url=pg_url, schema=schema)
    attempt = Attempt(str(uuid.uuid4()), "parent-owner", 1)
    broker.ledger.claimed(broker.ledger.slots(1), attempt)
    context = multiprocessing.get_context("fork")
    results = context.Queue()

    def child() -> None:
        broker.leases.start()
        results.put(broker.ledger.renewable())

    process = context.Process(target=child)
    process.start()
    try:
        seen_by_child = results.get(timeout=20)
    finally:
        process.join(20)

    assert seen_by_child == [], "the child took over its parent's attempts"
    assert broker.ledger.renewable() == [attempt], "the parent lost its own attempts"
    broker.close()
