"""Workflows at their edges, against real PostgreSQL and in-process workers: a step's
job retried on its own row."""

from __future__ import annotations

import dramatiq

from dramatiq_pg_broker import workflow


def test_a_retried_step_gets_its_piped_input_once(broker, queue):
    """Dramatiq's Retries stores the message the actor ran (its piped input appended) on
    the row it reschedules: the next attempt must not get the input a second time."""
    seen: list[tuple] = []

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def produce():
        return 5

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=2, min_backoff=1, max_backoff=1)
    def consume(*args):
        seen.append(args)
        if len(seen) < 3:
            raise ValueError("not yet")
        return args

    flow = workflow(produce.message(), consume.message("x")).run(broker=broker)
    broker.start_worker(threads=1)
    assert flow.wait(timeout=30) == "succeeded"
    assert seen == [("x", 5)] * 3, f"the attempts got {seen}"
