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


def test_an_empty_group_is_a_step_that_passes_an_empty_list_on(broker, queue):
    """A group built from a generator may have no member (a fan-out over no items): the
    step after it still waits for the step before it, and gets []."""
    seen: list[tuple] = []

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def first():
        seen.append(("first",))
        return 1

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def after(*args):
        seen.append(("after", *args))

    flow = workflow(first.message(), dramatiq.group([]), after.message()).run(broker=broker)
    nodes = flow.show()["nodes"]
    assert [n["status"] for n in nodes] == ["running", "pending"], "both started at once"
    broker.start_worker(threads=1)
    assert flow.wait(timeout=30) == "succeeded"
    assert seen == [("first",), ("after", [])]


def test_a_workflow_without_a_message_ends_at_once(broker):
    """An empty group or pipeline alone: no job to run, nothing left to wait for."""
    for steps in ((dramatiq.group([]),), (dramatiq.pipeline([]), dramatiq.group([]))):
        flow = workflow(*steps).run(broker=broker)
        assert flow.wait(timeout=1) == "succeeded"


def test_a_group_of_empty_pipelines_hands_the_step_before_it_on_once(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        return 2

    flow = workflow(
        step.message(),
        dramatiq.group([dramatiq.pipeline([]), dramatiq.pipeline([])]),
        step.message(),
    ).run(broker=broker)
    broker.start_worker(threads=1)
    assert flow.wait(timeout=30) == "succeeded"
