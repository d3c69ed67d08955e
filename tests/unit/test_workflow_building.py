"""A workflow's steps as nodes (no database): what each node waits for, how its piped
input is made, and the steps refused."""

from __future__ import annotations

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from dramatiq_pg_broker import workflow
from dramatiq_pg_broker.errors import InvalidMessage
from dramatiq_pg_broker.workflows.building import (
    INPUT_OPTION,
    NODE_OPTION,
    build_input,
    compile_steps,
    input_sources,
)


@pytest.fixture
def step():
    broker = StubBroker()

    @dramatiq.actor(broker=broker)
    def step(*args):
        return None

    return step


def test_steps_wait_for_the_step_before_and_take_its_result(step):
    flow = workflow(
        step.message("a"),
        dramatiq.group(
            [step.message("b"), dramatiq.pipeline([step.message("p"), step.message("q")])]
        ),
        step.message("c"),
        step.message_with_options(args=("d",), pipe_ignore=True),
    )
    nodes, remaining = compile_steps(flow)
    a, b, p, q, c, d = nodes
    assert [n.message.args[0] for n in nodes] == ["a", "b", "p", "q", "c", "d"]
    assert [n.step for n in nodes] == [0, 1, 1, 1, 2, 3]
    assert a.waits_for == [] and b.waits_for == [a.id] and p.waits_for == [a.id]
    assert q.waits_for == [p.id] and sorted(c.waits_for) == sorted([b.id, q.id])
    assert d.waits_for == [c.id] and remaining == 1 and d.dependents == []
    assert a.input is None and b.input == {"one": a.id} and q.input == {"one": p.id}
    assert c.input == {"list": [{"one": b.id}, {"one": q.id}]}
    assert d.input is None
    # The node's id travels in the message; pipeline options do not.
    assert all(n.message.options[NODE_OPTION] == n.id for n in nodes)
    assert "pipe_target" not in p.message.options
    assert c.message.options[INPUT_OPTION] is True and INPUT_OPTION not in d.message.options
    assert input_sources(c.input) == [b.id, q.id]
    assert build_input(c.input, {b.id: 1, q.id: 2}) == [1, 2]


def test_a_workflow_inside_a_workflow_is_its_steps_in_place(step):
    inner = workflow(step.message("x"), step.message("y"))
    nodes, remaining = compile_steps(workflow(step.message("a"), inner, step.message("b")))
    assert [n.message.args[0] for n in nodes] == ["a", "x", "y", "b"]
    assert [n.waits_for for n in nodes[1:]] == [[nodes[0].id], [nodes[1].id], [nodes[2].id]]
    assert remaining == 1


def test_a_last_group_counts_each_member_as_an_end(step):
    _, remaining = compile_steps(workflow(dramatiq.group([step.message(i) for i in range(3)])))
    assert remaining == 3


@pytest.mark.parametrize(
    "bad, message",
    [
        ((), "at least one step"),
        (("text",), "not str"),
        ((lambda: None,), "not function"),
    ],
)
def test_what_is_not_a_step_is_refused(bad, message):
    with pytest.raises(InvalidMessage, match=message):
        workflow(*bad)


def test_a_group_inside_a_group_is_refused(step):
    with pytest.raises(InvalidMessage, match="a group inside a group"):
        workflow(dramatiq.group([dramatiq.group([step.message(1)])]))
