"""Workflows against real PostgreSQL, their jobs moved by the job store's own transitions
(no worker): each step starts in the transaction that ends the one before it, a group's
join starts the next step once when its members end at the same moment, a failure or a
cancel ends the workflow, the operator's abort and retry, the CLI, and a plain job that
the trigger leaves alone."""

from __future__ import annotations

import json
import threading

import dramatiq
import pytest
from psycopg import sql

from dramatiq_pg_broker import workflow
from dramatiq_pg_broker.errors import (
    InvalidMessage,
    NotAWorkflowStep,
    WorkflowInvalidTransition,
    WorkflowNotFound,
    WorkflowTimeout,
)
from dramatiq_pg_broker.jobs import Attempt
from dramatiq_pg_broker.workflows.runs import WorkflowRun, store_of


@pytest.fixture
def actors(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def wf_a(*args):
        return None

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def wf_b(*args):
        return None

    return wf_a, wf_b


def queued(broker, queue) -> dict[str, str]:
    """The queue's unfinished jobs: id -> status."""
    with broker.pool.connection() as conn:
        rows = conn.execute(
            sql.SQL("SELECT id::text, status FROM {}.jobs WHERE queue_name = %s").format(
                sql.Identifier(broker.settings.schema)
            ),
            (queue,),
        ).fetchall()
    return dict(rows)


def claim_all(broker, queue) -> list[Attempt]:
    return [Attempt(c.id, "w", c.attempts) for c in broker.store.claim(queue, 100, "w", 30)]


def test_each_step_starts_in_the_transaction_that_ends_the_one_before(broker, queue, actors):
    a, b = actors
    run = workflow(a.message(1), dramatiq.group([b.message(2), b.message(3)]), a.message(4)).run(
        broker=broker
    )
    nodes = run.show()["nodes"]
    assert [n["status"] for n in nodes] == ["running", "pending", "pending", "pending"]
    assert list(queued(broker, queue)) == [nodes[0]["job_id"]]

    (first,) = claim_all(broker, queue)
    with broker.pool.connection() as conn, conn.transaction():
        broker.store.complete([first], conn=conn)
        # Inside the transaction that ended a: b and c are queued in it.
        seen = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.jobs WHERE workflow_node IS NOT NULL").format(
                sql.Identifier(broker.settings.schema)
            )
        ).fetchone()[0]
        assert seen == 2
    assert set(queued(broker, queue)) == {nodes[1]["job_id"], nodes[2]["job_id"]}
    one, two = claim_all(broker, queue)
    broker.store.complete([one])
    assert queued(broker, queue) == {two.id: "running"}
    broker.store.complete([two])
    assert list(queued(broker, queue)) == [nodes[3]["job_id"]]
    (last,) = claim_all(broker, queue)
    assert run.status() == "running"
    broker.store.complete([last])
    assert run.wait(timeout=1) == "succeeded"
    assert [n["job_status"] for n in run.show()["nodes"]] == ["succeeded"] * 4


def test_a_rolled_back_end_starts_nothing(broker, queue, actors):
    a, _ = actors
    run = workflow(a.message(1), a.message(2)).run(broker=broker)
    (first,) = claim_all(broker, queue)
    with broker.pool.connection() as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            broker.store.complete([first], conn=conn)
            raise RuntimeError("the transaction that ended the step rolls back")
    assert queued(broker, queue) == {first.id: "running"}
    assert [n["status"] for n in run.show()["nodes"]] == ["running", "pending"]


@pytest.mark.parametrize("width", [8])
def test_a_join_starts_the_next_step_once_when_its_members_end_together(
    broker, queue, actors, width
):
    a, b = actors
    run = workflow(dramatiq.group([b.message(i) for i in range(width)]), a.message()).run(
        broker=broker
    )
    attempts = claim_all(broker, queue)
    assert len(attempts) == width
    barrier = threading.Barrier(width)
    errors = []

    def end(attempt):
        try:
            barrier.wait(5)
            broker.store.complete([attempt])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=end, args=(att,)) for att in attempts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == []
    last = run.show()["nodes"][-1]
    assert queued(broker, queue) == {last["job_id"]: "queued"}, "the join started it once"
    assert last["status"] == "running" and last["waiting_for"] == 0


def test_a_failed_step_fails_the_workflow_and_retry_keeps_what_succeeded(
    broker, queue, actors, run
):
    a, b = actors
    flow = workflow(
        a.message(1), dramatiq.group([b.message(2), b.message(3)]), a.message(4), name="nightly"
    ).run(broker=broker)
    (first,) = claim_all(broker, queue)
    broker.store.complete([first])
    one, two = sorted(claim_all(broker, queue), key=lambda x: x.id)
    broker.store.fail([one], ["ValueError: no"])
    assert flow.status() == "failed"
    shown = flow.show()
    assert shown["error"] == "ValueError: no" and shown["ended_by_job"] == one.id
    assert shown["nodes"][3]["status"] == "cancelled"
    # The sibling that was running goes on and ends; nothing starts after it.
    broker.store.complete([two])
    assert queued(broker, queue) == {}

    code, out, err = run("workflows", "list", "--json")
    assert code == 0, err
    (listed,) = [w for w in json.loads(out) if w["id"] == flow.id]
    assert listed["status"] == "failed" and listed["name"] == "nightly"
    assert listed["steps"] == {
        "pending": 0, "running": 0, "succeeded": 2, "failed": 1, "cancelled": 1
    }  # fmt: skip
    code, out, err = run("workflows", "show", flow.id[:8])
    assert code == 0, err
    assert "failed" in out and "ValueError: no" in out and one.id in out
    code, out, err = run("workflows", "abort", flow.id)
    assert code == 2 and "only running workflows can be aborted" in err

    code, out, err = run("workflows", "retry", flow.id, "--json")
    assert code == 0, err
    retried = json.loads(out)
    assert retried["status"] == "running"
    renewed = next(
        n for n in retried["nodes"] if n["position"] in (1, 2) and n["status"] == "running"
    )
    assert renewed["job_id"] != one.id
    assert list(queued(broker, queue)) == [renewed["job_id"]]
    code, out, err = run("workflows", "retry", flow.id)
    assert code == 2 and "only failed or cancelled workflows can be retried" in err
    broker.store.complete(claim_all(broker, queue))
    broker.store.complete(claim_all(broker, queue))
    assert flow.wait(timeout=1) == "succeeded"


def test_abort_cancels_what_has_not_started_and_ends_the_queued_jobs(broker, queue, actors, run):
    a, b = actors
    flow = workflow(dramatiq.group([b.message(1), b.message(2)]), a.message(3)).run(broker=broker)
    code, out, err = run("workflows", "abort", flow.id)
    assert code == 0, err
    assert f"workflow {flow.id} is cancelled" in out
    assert flow.status() == "cancelled"
    nodes = flow.show()
    assert nodes["cancelled_by"].startswith("cli:")
    assert [n["status"] for n in nodes["nodes"]] == ["cancelled"] * 3
    assert [n["job_status"] for n in nodes["nodes"]] == ["cancelled", "cancelled", None]
    assert queued(broker, queue) == {}


def test_an_operator_s_cancel_of_a_step_s_job_cancels_the_workflow(broker, queue, actors):
    a, _ = actors
    flow = workflow(a.message(1), a.message(2)).run(broker=broker)
    (job_id,) = queued(broker, queue)
    broker.store.cancel(job_id, by="tests")
    assert flow.status() == "cancelled"
    assert [n["status"] for n in flow.show()["nodes"]] == ["cancelled", "cancelled"]


def test_unknown_and_bad_ids(broker, run):
    store = store_of(broker)
    with pytest.raises(WorkflowNotFound):
        store.status("00000000-0000-0000-0000-000000000000")
    code, _, err = run("workflows", "show", "not-an-id")
    assert code == 2 and "not a workflow id" in err
    code, _, err = run("workflows", "show", "00000000")
    assert code == 2 and "no workflow" in err
    with pytest.raises(WorkflowNotFound):
        WorkflowRun("00000000-0000-0000-0000-000000000000", broker=broker).wait(0)
    with pytest.raises(InvalidMessage, match="a workflow's step"):
        workflow("not a message")
    with pytest.raises(InvalidMessage, match="at least one step"):
        workflow()


def test_wait_raises_on_timeout(broker, actors):
    a, _ = actors
    flow = workflow(a.message()).run(broker=broker)
    with pytest.raises(WorkflowTimeout, match="still running after 0.1s"):
        flow.wait(timeout=0.1)
    with pytest.raises(WorkflowInvalidTransition):
        store_of(broker).retry(flow.id)


def test_a_plain_job_is_left_alone(broker, queue, actors):
    a, _ = actors
    message = a.send(1)
    (attempt,) = claim_all(broker, queue)
    assert broker.store.complete([attempt]) == {message.message_id}
    with broker.pool.connection() as conn:
        node = conn.execute(
            sql.SQL("SELECT workflow_node FROM {}.jobs_history WHERE id = %s").format(
                sql.Identifier(broker.settings.schema)
            ),
            (message.message_id,),
        ).fetchone()[0]
    assert node is None


def test_spawn_outside_a_workflow_says_so(broker, queue):
    from dramatiq_pg_broker.workflows.steps import spawn

    class Current:
        id = "x"
        message = dramatiq.Message(queue, "a", (), {}, {})

    with pytest.raises(NotAWorkflowStep):
        spawn(Current(), store_of(broker), broker.sender, ())


def test_a_retry_of_a_chain_starts_the_failed_step_and_the_next_after_it(broker, queue, actors):
    a, b = actors
    flow = workflow(a.message(1), b.message(2), a.message(3)).run(broker=broker)
    broker.store.complete(claim_all(broker, queue))
    (second,) = claim_all(broker, queue)
    broker.store.fail([second], ["ValueError: no"])
    assert [n["status"] for n in flow.show()["nodes"]] == ["succeeded", "failed", "cancelled"]
    store_of(broker).retry(flow.id)
    nodes = flow.show()["nodes"]
    # Only the failed step is queued again: the last one waits for it.
    assert [n["status"] for n in nodes] == ["succeeded", "running", "pending"]
    assert nodes[2]["waiting_for"] == 1
    assert list(queued(broker, queue)) == [nodes[1]["job_id"]]
    broker.store.complete(claim_all(broker, queue))
    assert list(queued(broker, queue)) == [nodes[2]["job_id"]]
    broker.store.complete(claim_all(broker, queue))
    assert flow.wait(timeout=1) == "succeeded"


def test_a_group_after_a_group_joins_each_member_of_the_second_on_every_member_of_the_first(
    broker, queue, actors
):
    a, b = actors
    flow = workflow(
        dramatiq.group([a.message(1), a.message(2)]),
        dramatiq.group([b.message(3), b.message(4), b.message(5)]),
        a.message(6),
    ).run(broker=broker)
    first = claim_all(broker, queue)
    assert len(first) == 2
    broker.store.complete(first[:1])
    # Every member of the second group waits for both of the first: none started.
    assert set(queued(broker, queue)) == {first[1].id}
    nodes = flow.show()["nodes"]
    assert [n["waiting_for"] for n in nodes[2:5]] == [1, 1, 1]
    broker.store.complete(first[1:])
    second = claim_all(broker, queue)
    assert {s.id for s in second} == {n["job_id"] for n in flow.show()["nodes"][2:5]}
    broker.store.complete(second)
    broker.store.complete(claim_all(broker, queue))
    assert flow.wait(timeout=1) == "succeeded"


def test_the_inputs_of_a_claim_s_steps_are_read_in_one_statement(broker, queue, actors):
    from dramatiq_pg_broker.attempt.claiming import PgMessageProxy
    from dramatiq_pg_broker.workflows.steps import WorkflowSteps
    from dramatiq_pg_broker.workflows.store import encode_result

    a, b = actors
    flow = workflow(
        a.message(1), dramatiq.group([b.message(2), b.message(3), b.message(4)]), a.message()
    ).run(broker=broker)
    store = store_of(broker)
    nodes = flow.show()["nodes"]
    (first,) = claim_all(broker, queue)
    store.store_result(nodes[0]["id"], first.id, encode_result(7))
    broker.store.complete([first])
    a.send(5)  # a plain job in the same claim

    claimed = broker.store.claim(queue, 100, "w", 30)
    proxies = [
        PgMessageProxy(broker.decode_message(c.message, c.message_bytes), Attempt(c.id, "w", 1))
        for c in claimed
    ]
    assert len(proxies) == 4
    statements = []
    fetch = store._fetch

    def counted(name, params, conn):
        statements.append(name)
        return fetch(name, params, conn)

    store._fetch = counted
    try:
        steps = WorkflowSteps(store)
        steps.prepare(proxies)
        assert statements == ["node_inputs"], "one statement for the claim's three steps"
        for proxy in proxies:
            steps.before_process_message(broker, proxy)
        assert statements == ["node_inputs"], "no statement of their own when they run"
        plain = [p for p in proxies if "workflow_node" not in p.options]
        assert len(plain) == 1 and plain[0].prepared is None and plain[0].args == (5,)
        members = sorted((p for p in proxies if p not in plain), key=lambda p: p.args)
        assert [p.args for p in members] == [(2, 7), (3, 7), (4, 7)]
        steps.prepare(plain)
        assert statements == ["node_inputs"], "a claim of plain jobs runs no statement"
    finally:
        store._fetch = fetch
    for p in members:
        assert p.prepared == store.node_input(p.options["workflow_node"])


def test_a_claim_whose_inputs_cannot_be_read_hands_its_steps_over_all_the_same(
    broker, queue, actors, monkeypatch
):
    a, b = actors
    flow = workflow(a.message(1), b.message(2)).run(broker=broker)
    broker.store.complete(claim_all(broker, queue))
    second = flow.show()["nodes"][1]

    def fail(node_ids):
        raise RuntimeError("the database is away")

    monkeypatch.setattr(store_of(broker), "node_inputs", fail)
    consumer = broker.consume(queue, prefetch=2, timeout=1000)
    try:
        message = None
        for _ in range(20):
            message = next(consumer)
            if message is not None:
                break
        assert message is not None, "the step's job was not handed over"
        assert message.options["workflow_node"] == second["id"]
        assert message.prepared is None, "read where it runs instead"
    finally:
        consumer.close()
