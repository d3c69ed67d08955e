"""Workflows at their edges, against real PostgreSQL and in-process workers: a step's
job retried on its own row."""

from __future__ import annotations

import threading
import time

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker, workflow
from dramatiq_pg_broker.errors import InvalidMessage, JobBusy, WorkflowInvalidTransition
from dramatiq_pg_broker.jobs import Attempt
from dramatiq_pg_broker.workflows.runs import store_of


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


def _queued(broker, queue) -> dict[str, str]:
    with broker.pool.connection() as conn:
        rows = conn.execute(
            sql.SQL("SELECT id::text, status FROM {}.jobs WHERE queue_name = %s").format(
                sql.Identifier(broker.settings.schema)
            ),
            (queue,),
        ).fetchall()
    return dict(rows)


def _until_blocked(broker, done: threading.Event, seconds: float = 10.0) -> bool:
    """Look at the server until a session of this database waits for a lock (or ``done``
    is set): True when one does."""
    deadline = time.monotonic() + seconds
    with broker.pool.connection() as conn:
        while time.monotonic() < deadline and not done.is_set():
            waiting = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()[0]
            if waiting:
                return True
            done.wait(0.01)
    return False


@pytest.mark.parametrize("default_isolation", ["read committed", "repeatable read"])
def test_an_abort_that_meets_a_step_s_end_leaves_no_step_running(
    broker, queue, pg_url, schema, default_isolation
):
    """A step's end that starts the next step, not committed yet, and an operator's abort
    of the workflow at that moment: whichever commits first, the next step's job does not
    outlive the abort (cancelled, or never sent). Also where the operator's database
    defaults to REPEATABLE READ (``default_transaction_isolation``; here the abort's
    connections' ``options``): the abort's snapshot is taken after its wait."""

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        pass

    flow = workflow(step.message(1), step.message(2)).run(broker=broker)
    (claimed,) = broker.store.claim(queue, 10, "w", 30)
    first = Attempt(claimed.id, "w", claimed.attempts)
    url = psycopg.conninfo.make_conninfo(
        pg_url, options="-c default_transaction_isolation=" + default_isolation.replace(" ", "\\ ")
    )
    operator = PostgresBroker(url=url, schema=schema)
    store = store_of(operator)
    done = threading.Event()
    errors: list[BaseException] = []

    def abort():
        try:
            store.abort(flow.id, operator.store, by="tests")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            done.set()

    with broker.pool.connection() as conn:
        with conn.transaction():
            broker.store.complete([first], conn=conn)  # sends the second step's job
            thread = threading.Thread(target=abort)
            thread.start()
            _until_blocked(broker, done)
        thread.join(10)
    operator.close()
    assert not thread.is_alive() and not errors, errors
    assert flow.status() == "cancelled"
    assert _queued(broker, queue) == {}, "a step's job was left to run after the abort"
    nodes = flow.show()["nodes"]
    assert nodes[1]["job_status"] in (None, "cancelled"), nodes


def test_a_failure_that_meets_a_step_s_start_leaves_no_running_step_cancelled(broker, queue):
    """A group of a pipeline and a job: the pipeline's first step ends (starting its second,
    not committed yet) while the other member fails. The failure cancels the steps that
    have not started; a step whose job exists is one that started, and runs to its end
    with its node showing it, never as a `cancelled` node whose job runs anyway."""

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        pass

    flow = workflow(
        dramatiq.group([dramatiq.pipeline([step.message(1), step.message(2)]), step.message(3)]),
        step.message(4),
    ).run(broker=broker)
    x1, x2, y, z = (n["job_id"] for n in flow.show()["nodes"])
    claimed = {c.id: Attempt(c.id, "w", c.attempts) for c in broker.store.claim(queue, 10, "w", 30)}
    assert set(claimed) == {x1, y}
    done = threading.Event()
    errors: list[BaseException] = []

    def fail():
        try:
            broker.store.fail([claimed[y]], ["ValueError: no"])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            done.set()

    with broker.pool.connection() as conn:
        with conn.transaction():
            broker.store.complete([claimed[x1]], conn=conn)  # sends x2's job
            thread = threading.Thread(target=fail)
            thread.start()
            _until_blocked(broker, done)
        thread.join(10)
    assert not thread.is_alive() and not errors, errors
    assert flow.status() == "failed"
    by_job = {n["job_id"]: n for n in flow.show()["nodes"]}
    for job_id in _queued(broker, queue):
        assert by_job[job_id]["status"] == "running", (job_id, by_job[job_id])
    assert by_job[z]["status"] == "cancelled"


def test_a_result_that_cannot_be_encoded_fails_the_step_that_passes_it_on(broker, queue):
    """As in Dramatiq's pipeline, whose send of the next message fails: the next step does
    not run with None in place of a result it was promised. A step whose result nothing
    takes (the last one here) keeps succeeding."""
    seen: list[tuple] = []

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def produce(*args):
        return {1, 2}  # a set: the JSON encoder cannot write it

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def consume(*args):
        seen.append(args)

    broker.start_worker(threads=1)
    last = workflow(consume.message(), produce.message()).run(broker=broker)
    assert last.wait(timeout=30) == "succeeded"
    flow = workflow(produce.message(), consume.message()).run(broker=broker)
    assert flow.wait(timeout=30) == "failed"
    assert seen == [()], f"the next step ran with {seen[1:]}"
    assert "cannot be encoded" in flow.show()["error"]


def _workflow_rows(broker, workflow_id: str) -> int:
    with broker.pool.connection() as conn:
        return conn.execute(
            sql.SQL("SELECT count(*) FROM {}.workflows WHERE id = %s").format(
                sql.Identifier(broker.settings.schema)
            ),
            (workflow_id,),
        ).fetchone()[0]


def test_a_workflow_run_in_an_application_transaction_goes_with_it(broker, queue, pg_url):
    """Inside ``broker.transaction(conn)`` a workflow is written on the application's
    connection, as a send is: a rollback leaves no workflow and no job, a commit both."""

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        pass

    class Rollback(Exception):
        pass

    with psycopg.connect(pg_url) as conn:
        with pytest.raises(Rollback), broker.transaction(conn):
            flow = workflow(step.message(1), step.message(2)).run(broker=broker)
            raise Rollback
    assert _workflow_rows(broker, flow.id) == 0
    assert _queued(broker, queue) == {}, "the first step's job outlived the rollback"

    with psycopg.connect(pg_url) as conn:
        with broker.transaction(conn):
            flow = workflow(step.message(1), step.message(2)).run(broker=broker)
            assert _workflow_rows(broker, flow.id) == 0, "written before the commit"
    assert flow.status() == "running"
    assert list(_queued(broker, queue)) == [flow.show()["nodes"][0]["job_id"]]


def test_a_retry_waits_for_the_aborted_jobs_to_end(broker, queue):
    """An abort interrupts a running step's job, which ends `cancelled` once its worker has
    stopped it, and that end cancels its workflow. A retry accepted before then would be
    undone by it (the workflow cancelled again, the steps the retry started left running
    in it): refused until the job has ended, then accepted."""

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        pass

    flow = workflow(step.message(1), step.message(2)).run(broker=broker)
    (claimed,) = broker.store.claim(queue, 10, "w", 30)
    store = store_of(broker)
    store.abort(flow.id, broker.store, by="tests")
    assert _queued(broker, queue) == {claimed.id: "running"}  # asked to stop
    with pytest.raises(WorkflowInvalidTransition, match="still stopping"):
        store.retry(flow.id)
    broker.store.abort_attempts([Attempt(claimed.id, "w", claimed.attempts)])
    assert flow.status() == "cancelled"
    retried = store.retry(flow.id)
    assert retried["status"] == "running"
    assert [n["status"] for n in retried["nodes"]] == ["running", "pending"]


def test_an_abort_ends_every_other_job_when_one_job_s_row_is_busy(broker, queue):
    """A step's row held past the abort's wait (a complete_in() block's transaction):
    that job is reported busy, and the workflow's other jobs are aborted all the same."""

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        pass

    flow = workflow(dramatiq.group([step.message(1), step.message(2)]), step.message(3)).run(
        broker=broker
    )
    first, second = (n["job_id"] for n in flow.show()["nodes"][:2])
    broker.store.claim(queue, 10, "w", 30)
    table = sql.SQL("{}.jobs").format(sql.Identifier(broker.settings.schema))
    with broker.pool.connection() as holder, holder.transaction():
        holder.execute(sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR UPDATE").format(table), (first,))
        with pytest.raises(JobBusy):
            store_of(broker).abort(flow.id, broker.store, by="tests")
    assert flow.status() == "cancelled"
    with broker.pool.connection() as conn:
        asked = conn.execute(
            sql.SQL("SELECT abort_requested_at IS NOT NULL FROM {} WHERE id = %s").format(table),
            (second,),
        ).fetchone()[0]
    assert asked, "the other running job was never asked to stop"


@pytest.mark.parametrize("ending", ["abort", "failure"])
def test_an_end_of_the_workflow_and_a_child_s_end_that_starts_the_next_step_do_not_deadlock(
    broker, queue, ending
):
    """A spawned child's end counts its parent down (the parent's row) and starts the
    step after it (the workflow's row, FOR KEY SHARE), while an abort, or a member's
    failure, holds the workflow's row and cancels the nodes that have not started, the
    waiting parent among them: it passes over the parent the child's end holds, instead
    of waiting for it in a cycle."""
    from dramatiq_pg_broker.workflows.building import NODE_OPTION
    from dramatiq_pg_broker.workflows.steps import spawn

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        pass

    flow = workflow(
        dramatiq.group([dramatiq.pipeline([step.message(1), step.message(2)]), step.message(9)]),
        step.message(3),
    ).run(broker=broker)
    parent = flow.show()["nodes"][0]
    store = store_of(broker)

    class Current:
        id = parent["job_id"]
        message = dramatiq.Message(queue, "step", (), {}, {NODE_OPTION: parent["id"]})
        _spawned = 0

    claimed = {c.id: c for c in broker.store.claim(queue, 10, "w", 30)}
    spawn(Current(), store, broker.sender, (step.message(3),))
    (child,) = broker.store.claim(queue, 10, "w", 30)
    mine = claimed.pop(parent["job_id"])
    (failing,) = claimed.values()
    broker.store.complete([Attempt(mine.id, "w", mine.attempts)])  # the child is left
    done = threading.Event()
    errors: list[BaseException] = []

    def end_child():
        try:
            broker.store.complete([Attempt(child.id, "w", child.attempts)])
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            done.set()

    with broker.pool.connection() as conn:
        with conn.transaction():
            conn.execute(store.queries["lock_workflow"], {"id": flow.id})
            thread = threading.Thread(target=end_child)
            thread.start()
            assert _until_blocked(broker, done), "the child's end did not wait for the abort"
            try:
                if ending == "abort":
                    conn.execute(store.queries["cancel_workflow"], {"id": flow.id, "by": "tests"})
                else:
                    broker.store.fail(
                        [Attempt(failing.id, "w", failing.attempts)], ["no"], conn=conn
                    )
            except psycopg.errors.DeadlockDetected as e:
                errors.append(e)
                raise
        thread.join(10)
    assert not errors, errors
    assert flow.status() == ("cancelled" if ending == "abort" else "failed")
    # The other member's job (running; the abort's own transaction asks it to stop
    # after this) and nothing else: the pipeline's next step never started.
    assert set(_queued(broker, queue)) <= {failing.id}, "a step started in an ended workflow"


def test_a_message_given_twice_is_refused_when_the_workflow_is_run(broker, queue):
    """Two steps of one message (``[m] * 3``, or the same message in two steps) would be
    two jobs of one id: the end of the step before them could never be written (its
    transaction's INSERT of their jobs fails), and that step would run again and again.
    run() refuses it, before anything is written."""

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        pass

    same = step.message(2)
    with pytest.raises(InvalidMessage, match="more than once"):
        workflow(step.message(1), dramatiq.group([same, same])).run(broker=broker)
    with pytest.raises(InvalidMessage, match="more than once"):
        workflow(same, step.message(1), same).run(broker=broker)
    assert _queued(broker, queue) == {}


def _workflows(broker) -> int:
    with broker.pool.connection() as conn:
        return conn.execute(
            sql.SQL("SELECT count(*) FROM {}.workflows").format(
                sql.Identifier(broker.settings.schema)
            )
        ).fetchone()[0]


def test_a_workflow_run_a_second_time_is_refused_and_stores_nothing(broker, queue):
    """The same Workflow object run again: its messages are jobs already, so its first
    step's job was never sent a second time and the second run waited for ever (or, once
    the first run's jobs had finished, ran its messages again under ids history already
    holds). Refused with a sentence, nothing stored, the first run untouched."""

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        return len(args)

    flow = workflow(step.message(1), step.message(2))
    first = flow.run(broker=broker)
    before = _workflows(broker)
    with pytest.raises(InvalidMessage, match="sent already .* build the steps' messages again"):
        flow.run(broker=broker)
    assert _workflows(broker) == before
    broker.start_worker(threads=2)
    assert first.wait(timeout=30) == "succeeded"
    # Finished: the messages are in history now, and still refused.
    with pytest.raises(InvalidMessage, match="sent already"):
        flow.run(broker=broker)
    assert _workflows(broker) == before


def test_a_workflow_whose_run_was_rolled_back_may_run_again(broker, queue, pg_url):
    """A run inside the application's transaction that rolled back stored nothing: the
    same object runs again (a transaction retried by its framework), once."""

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        pass

    class Rollback(Exception):
        pass

    flow = workflow(step.message(1), step.message(2))
    with psycopg.connect(pg_url) as conn:
        with pytest.raises(Rollback), broker.transaction(conn):
            flow.run(broker=broker)
            raise Rollback
    again = flow.run(broker=broker)
    assert again.status() == "running"
    with pytest.raises(InvalidMessage, match="sent already"):
        flow.run(broker=broker)


def test_the_same_messages_in_another_workflow_object_are_refused_while_their_step_runs(
    broker, queue
):
    """Two Workflow objects of the same messages: the second's start finds the first
    step's job stored (queued: no worker runs) and refuses, storing nothing."""

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        pass

    first, second = step.message(1), step.message(2)
    workflow(first, second).run(broker=broker)
    before = _workflows(broker)
    with pytest.raises(InvalidMessage, match="sent already"):
        workflow(first, second).run(broker=broker)
    assert _workflows(broker) == before


def test_one_workflow_run_twice_at_once_runs_once_and_refuses_the_other(broker, queue):
    """Two threads run the same Workflow object at once: one run stores it, the other is
    refused (it waits for the first's commit at most), and neither hangs."""

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def step(*args):
        return None

    flow = workflow(step.message(1), dramatiq.group([step.message(2), step.message(3)]))
    gate = threading.Barrier(2)
    runs, refusals = [], []

    def run():
        gate.wait(5)
        try:
            runs.append(flow.run(broker=broker))
        except InvalidMessage as e:
            refusals.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(thread.is_alive() for thread in threads), "a run hangs"
    assert (len(runs), len(refusals)) == (1, 1), (runs, refusals)
    broker.start_worker(threads=2)
    assert runs[0].wait(timeout=30) == "succeeded"
