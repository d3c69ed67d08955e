"""Workflows run by real ``dramatiq`` worker processes: the order of the steps and the
results they pass on, a group's join, children spawned at run time, a failing member, an
operator's abort and retry, and SIGKILL of the worker in the middle of a workflow."""

from __future__ import annotations

import random
import time

import dramatiq
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker, workflow
from dramatiq_pg_broker.workflows.runs import store_of

from .workers import wait_for
from .workflow_actors import create_tables, declare

pytestmark = [pytest.mark.timeout(180)]

APP = "tests.e2e.workflow_app"


@pytest.fixture
def wf(pg_url, schema, conn):
    """``(broker, actors)`` on the module's schema, with empty run tables and no jobs."""
    create_tables(conn, schema)
    conn.execute(
        sql.SQL("TRUNCATE {0}.jobs, {0}.jobs_history, {0}.job_keys, {0}.workflows CASCADE").format(
            sql.Identifier(schema)
        )
    )
    broker = PostgresBroker(url=pg_url, schema=schema)
    yield broker, declare(broker)
    broker.close()


def runs(conn, schema) -> list[dict]:
    rows = conn.execute(
        sql.SQL(
            "SELECT tag, args, job_id::text, attempt, pid, phase, at FROM {}.wf_runs ORDER BY id"
        ).format(sql.Identifier(schema))
    ).fetchall()
    keys = ("tag", "args", "job_id", "attempt", "pid", "phase", "at")
    return [dict(zip(keys, row)) for row in rows]


def times(conn, schema, phase: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for run in runs(conn, schema):
        if run["phase"] == phase:
            out.setdefault(run["tag"], []).append(run["at"])
    return out


def finished_once(conn, schema) -> dict[str, int]:
    counts: dict[str, int] = {}
    for run in runs(conn, schema):
        if run["phase"] == "finish":
            counts[run["tag"]] = counts.get(run["tag"], 0) + 1
    return counts


def args_of(conn, schema, tag: str) -> list:
    return [r["args"] for r in runs(conn, schema) if r["tag"] == tag and r["phase"] == "start"]


def test_steps_run_in_order_and_pass_their_results_on(wf, conn, schema, start_worker):
    broker, actors = wf
    step = actors["wf_step"]
    run = workflow(
        step.message("a"),
        dramatiq.group(
            [
                step.message("b1", ms=300),
                dramatiq.pipeline([step.message("p1"), step.message("p2")]),
                step.message("b3"),
            ]
        ),
        step.message("c"),
        step.message_with_options(args=("d",), pipe_ignore=True),
        name="ordered",
    ).run(broker=broker)
    assert len(run.id) == 36 and run.status() == "running"
    worker = start_worker(app=APP, threads=4)
    assert run.wait(timeout=60) == "succeeded", worker.log_tail()

    started, finished = times(conn, schema, "start"), times(conn, schema, "finish")
    assert finished_once(conn, schema) == dict.fromkeys(["a", "b1", "p1", "p2", "b3", "c", "d"], 1)
    # A group's members start once the step before it is done; the next step once every
    # member is (a pipeline member: its last message).
    for member in ("b1", "p1", "b3"):
        assert started[member][0] > finished["a"][0]
    assert started["p2"][0] > finished["p1"][0]
    assert started["c"][0] > max(finished[t][0] for t in ("b1", "p2", "b3"))
    assert started["d"][0] > finished["c"][0]
    # Side by side: b1 (300 ms) was still running when p1, p2 and b3 ran.
    assert started["b3"][0] < finished["b1"][0]
    # Results as a pipeline passes them: a group's as a list in member order.
    assert args_of(conn, schema, "b1") == [["a"]]
    assert args_of(conn, schema, "p1") == [["a"]]
    assert args_of(conn, schema, "p2") == [["p1"]]
    assert args_of(conn, schema, "c") == [[["b1", "p2", "b3"]]]
    assert args_of(conn, schema, "d") == [[]]
    shown = run.show()
    assert shown["name"] == "ordered"
    assert [n["status"] for n in shown["nodes"]] == ["succeeded"] * 7
    assert all(n["job_status"] == "succeeded" for n in shown["nodes"])


def test_a_step_s_spawned_children_hold_the_next_step(wf, conn, schema, start_worker):
    broker, actors = wf
    run = workflow(
        actors["wf_fan"].message("fan", 4),
        actors["wf_step"].message("after"),
    ).run(broker=broker)
    worker = start_worker(app=APP, threads=4)
    assert run.wait(timeout=60) == "succeeded", worker.log_tail()
    started, finished = times(conn, schema, "start"), times(conn, schema, "finish")
    children = [f"fan.{i}" for i in range(4)]
    assert finished_once(conn, schema) == dict.fromkeys(["fan", "after", *children], 1)
    assert started["after"][0] > max(finished[c][0] for c in children)
    # The next step gets the spawning step's own result.
    assert args_of(conn, schema, "after") == [["fan"]]
    nodes = run.show()["nodes"]
    assert len(nodes) == 6
    fan = next(n for n in nodes if n["actor_name"] == "wf_fan")
    assert sorted(n["parent"] for n in nodes if n["parent"]) == [fan["id"]] * 4


def test_a_failing_member_fails_the_workflow_and_cancels_what_has_not_started(
    wf, conn, schema, start_worker
):
    broker, actors = wf
    step, flaky = actors["wf_step"], actors["wf_flaky"]
    run = workflow(
        step.message("a"),
        dramatiq.group([step.message("b"), flaky.message("bad")]),
        step.message("c"),
    ).run(broker=broker)
    worker = start_worker(app=APP, threads=2)
    assert run.wait(timeout=60) == "failed", worker.log_tail()
    # Its two attempts (max_retries=1) failed; the workflow failed with its job's error.
    assert len(args_of(conn, schema, "bad")) == 2
    shown = run.show()
    by_tag = {n["position"]: n for n in shown["nodes"]}
    assert shown["error"] and "bad is not flagged" in shown["error"]
    assert by_tag[2]["status"] == "failed" and by_tag[2]["job_status"] == "failed"
    assert by_tag[3]["status"] == "cancelled" and by_tag[3]["job_status"] is None
    assert "c" not in finished_once(conn, schema)

    # Retry: the failed step runs again (a new job), what succeeded is kept.
    conn.execute(sql.SQL("INSERT INTO {}.wf_flags VALUES ('bad')").format(sql.Identifier(schema)))
    retried = store_of(broker).retry(run.id)
    assert retried["status"] == "running"
    assert run.wait(timeout=60) == "succeeded", worker.log_tail()
    assert finished_once(conn, schema) == {"a": 1, "b": 1, "bad": 1, "c": 1}
    assert args_of(conn, schema, "c") == [[["b", "bad"]]]
    nodes = run.show()["nodes"]
    assert nodes[2]["job_id"] != by_tag[2]["job_id"]


def test_abort_cancels_the_workflow_and_aborts_its_running_steps(wf, conn, schema, start_worker):
    broker, actors = wf
    step = actors["wf_step"]
    run = workflow(
        dramatiq.group([step.message("long", ms=30_000), step.message("short", ms=30_000)]),
        step.message("never"),
    ).run(broker=broker)
    worker = start_worker(app=APP, threads=1)  # one thread: "short" stays queued
    wait_for(
        lambda: "long" in times(conn, schema, "start") or "short" in times(conn, schema, "start"),
        30,
        "a member to start",
        on_timeout=worker.log_tail,
    )
    store = store_of(broker)
    aborted = store.abort(run.id, broker.store, by="tests")
    assert aborted["status"] == "cancelled" and aborted["cancelled_by"] == "tests"
    assert run.wait(timeout=5) == "cancelled"
    # The running member is interrupted and ends cancelled; the queued one is cancelled.
    wait_for(
        lambda: all(n["job_status"] == "cancelled" for n in store.get(run.id)["nodes"][:2]),
        30,
        "both members' jobs to end cancelled",
        on_timeout=worker.log_tail,
    )
    nodes = store.get(run.id)["nodes"]
    assert nodes[2]["status"] == "cancelled" and nodes[2]["job_status"] is None
    assert finished_once(conn, schema) == {}
    with pytest.raises(Exception, match="only running workflows"):
        store.abort(run.id, broker.store)


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_workflow_runs_every_step_to_its_end_once(
    wf, conn, schema, start_worker
):
    """Workers are killed with SIGKILL at random moments while a workflow of groups runs;
    every step's job runs to its end once (a killed attempt runs again, its step is never
    started twice), and the workflow ends succeeded. Each step records its end in a
    complete_in() block: the end, the job's success and the start of the next step commit
    together, so that a kill anywhere leaves each of them done once or not at all."""
    broker, actors = wf
    step = actors["wf_step"]
    steps = []
    tags = []
    for level in range(6):
        members = [f"s{level}.{i}" for i in range(3)]
        tags.extend(members)
        steps.append(
            dramatiq.group(
                [
                    step.message_with_options(
                        args=(t,), kwargs={"ms": 150, "exact": True}, pipe_ignore=True
                    )
                    for t in members
                ]
            )
        )
    run = workflow(*steps).run(broker=broker)
    rng = random.Random()
    kills = 0
    worker = start_worker(app=APP, threads=3)
    deadline = time.monotonic() + 120
    while run.status() == "running" and kills < 4 and time.monotonic() < deadline:
        time.sleep(rng.uniform(0.2, 0.9))
        worker.kill_group()
        kills += 1
        worker = start_worker(app=APP, threads=3)
    assert run.wait(timeout=90) == "succeeded", worker.log_tail()
    assert kills >= 2, "the workflow ended before the workers were killed twice"
    assert finished_once(conn, schema) == dict.fromkeys(tags, 1)
    started, finished = times(conn, schema, "start"), times(conn, schema, "finish")
    for level in range(1, 6):
        before = max(finished[f"s{level - 1}.{i}"][0] for i in range(3))
        for i in range(3):
            assert min(started[f"s{level}.{i}"]) > before
    # One job per step: no step was started twice.
    nodes = run.show()["nodes"]
    assert len({n["job_id"] for n in nodes}) == len(tags)
    assert all(n["job_status"] == "succeeded" for n in nodes)
