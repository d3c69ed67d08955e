"""The CLI as an operator meets it: every command fails fast and in one line when the
database cannot be reached, a job is named by its state (the vocabulary the API, the
dashboard and the metrics use), jobs whose worker died are requeued through the reaper's
own transition, every queue name no worker declared is warned about alike, ``stats`` and
``queues list`` are one table, ``queues show`` explains one queue, and every command takes
``--json``."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from dramatiq_pg_broker.cli import build_parser
from dramatiq_pg_broker.cli.main import CONNECT_SECONDS
from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.control import limits, queues
from dramatiq_pg_broker.errors import InvalidTransition
from dramatiq_pg_broker.jobs import Attempt, NewJob, states

from ..e2e.workers import REPO
from ..helpers import server_up_for
from .harness import declared_queue

NOW = dt.datetime.now(dt.timezone.utc)
AN_ID = str(uuid.UUID(int=7))

#: The arguments each command needs besides the database; a command missing here fails
#: the test that walks them all (so a new command is checked too).
COMMAND_ARGS = {
    "migrate": [],
    "status": [],
    "jobs list": [],
    "jobs show": [AN_ID],
    "jobs retry": ["--all-failed"],
    "jobs requeue": ["--all-expired"],
    "jobs cancel": [AN_ID],
    "jobs abort": [AN_ID],
    "prune": ["--dry-run"],
    "schedules": [],
    "stats": [],
    "queues list": [],
    "queues show": ["mail"],
    "queues pause": ["mail"],
    "queues resume": ["mail"],
    "queues limit": ["mail", "3"],
    "workers": [],
    "actors": [],
    "doctor": [],
    "workflows list": [],
    "workflows show": [AN_ID],
    "workflows abort": [AN_ID],
    "workflows retry": [AN_ID],
    "user create": ["--email", "a@example.com", "--role", "viewer", "--password", "x" * 12],
    "user list": [],
    "user deactivate": ["--email", "a@example.com"],
    "user activate": ["--email", "a@example.com"],
    "user set-password": ["--email", "a@example.com", "--password", "x" * 12],
    "token create": ["--email", "a@example.com", "--name", "ci"],
    "token list": ["--email", "a@example.com"],
    "token revoke": ["--id", "1"],
}
#: Commands that never reach the database.
LOCAL = {"embedded"}


def leaf_commands(parser: argparse.ArgumentParser, prefix: str = ""):
    """Every command of the parser that runs something, as ``"jobs list"``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                command = f"{prefix}{name}"
                nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
                if nested:
                    yield from leaf_commands(sub, command + " ")
                else:
                    yield command


def test_every_command_is_listed_here():
    commands = set(leaf_commands(build_parser())) - LOCAL
    assert commands == set(COMMAND_ARGS), "COMMAND_ARGS must name every command"


def cli(*args: str, timeout: float = 30) -> tuple[int, str, str, float]:
    """Run ``python -m dramatiq_pg_broker ARGS`` as an operator would (no database URL in
    the environment); its exit status, stdout, stderr and seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRAMATIQ_PG_", "DJANGO"))}
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_broker", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - began


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def wrong(pg_url):
    """Database URLs that cannot be used, each with what the error must say: a database
    that does not exist, a role the server does not know, a port nothing listens on."""
    given = conninfo_to_dict(pg_url)
    return {
        "database": (make_conninfo(**{**given, "dbname": "no_such_db"}), "does not exist"),
        "role": (make_conninfo(**{**given, "user": "no_such_role"}), "no_such_role"),
        "port": (
            make_conninfo(host="127.0.0.1", port=str(free_port()), dbname="x", user="x"),
            "refused",
        ),
    }


@pytest.mark.parametrize("kind", ["database", "role", "port"])
@pytest.mark.parametrize("command", sorted(COMMAND_ARGS))
def test_a_wrong_database_fails_every_command_in_one_line_within_seconds(wrong, kind, command):
    url, reason = wrong[kind]
    # --url after the command, as well as before it.
    code, out, err, took = cli(*command.split(), *COMMAND_ARGS[command], "--url", url)
    assert code == 2, (code, out, err)
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("error: cannot connect to the database:") and reason in err, err
    # What the failure adds to starting the command (the same command's --help, run now, on
    # the same machine as loaded as it is): a loaded test machine can take seconds to import
    # the package, which is not what this measures. Before: 30 s spent retrying.
    started = cli(*command.split(), "--help")[3]
    assert took - started < 5, f"{command} took {took:.1f} s to fail ({started:.1f} s to start)"


@pytest.mark.parametrize("command", ["stats", "jobs list", "migrate", "user list"])
def test_errors_are_json_with_json(wrong, command):
    url, reason = wrong["database"]
    code, out, err, _ = cli("--url", url, *command.split(), *COMMAND_ARGS[command], "--json")
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert reason in json.loads(err)["error"]
    code, out, err, _ = cli(*command.split(), "--json", "--no-such-option")
    assert code == 2 and "unrecognized arguments" in json.loads(err)["error"]


@pytest.fixture
def silent_server():
    """A TCP port that accepts connections and never says a word (a server that hangs, a
    firewall that drops): only the connect timeout ends the wait."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


@pytest.mark.parametrize("command", ["stats", "status", "user list"])
def test_a_server_that_never_answers_fails_within_the_connect_timeout(silent_server, command):
    url = make_conninfo(host="127.0.0.1", port=str(silent_server), dbname="x", user="x")
    code, out, err, took = cli(*command.split(), "--url", url)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "cannot connect to the database" in err and "timeout" in err, err
    assert took < CONNECT_SECONDS + 4, f"{command} took {took:.1f} s to fail"


def test_the_url_after_the_command_wins(pg_url, schema, wrong, store):
    url, _ = wrong["database"]
    code, out, err, _ = cli("--url", url, "--schema", schema, "stats", "--url", pg_url, "--json")
    assert code == 0, err
    assert isinstance(json.loads(out), list)


def test_every_command_takes_json():
    parser = build_parser()

    def leaves(parser, prefix=""):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
                    if nested:
                        yield from leaves(sub, f"{prefix}{name} ")
                    else:
                        yield f"{prefix}{name}", sub

    missing = [
        name
        for name, sub in leaves(parser)
        if "--json" not in {option for a in sub._actions for option in a.option_strings}
    ]
    assert missing == []


def test_status_and_migrate_speak_json(run):
    code, out, _ = run("status", "--json")
    status = json.loads(out)
    assert code == 0 and status["pending"] == 0 and status["changed"] == 0
    assert status["migrations"][0]["migration"].startswith("0001_")
    assert "fits the schema" in status["verdict"]
    code, out, _ = run("migrate", "--check", "--json")
    assert code == 0 and json.loads(out)["pending"] == []
    code, out, _ = run("migrate", "--json")
    assert code == 0 and json.loads(out)["applied"] == []


# -- the states ---------------------------------------------------------------------------


def new_job(store, queue, *, delay_ms=0, now=None) -> str:
    job_id = str(uuid.uuid4())
    store.enqueue(
        NewJob(job_id, queue, "tests.a", message={"args": [], "kwargs": {}}, delay_ms=delay_ms,
               max_attempts=3),
        now=now,
    )  # fmt: skip
    return job_id


@pytest.fixture
def every_state(store):
    """One job in each state of the vocabulary, on queues of the test's own: name -> id
    (and ``_queues``: the live queue, the paused one, the one of the finished jobs)."""
    live, held, done = (declared_queue(store) for _ in range(3))
    an_hour_ago = NOW - dt.timedelta(hours=1)
    # Claimed first (the oldest), one at a time: the one whose lease runs, then the one
    # whose lease was taken an hour ago.
    running = new_job(store, live, now=an_hour_ago - dt.timedelta(minutes=2))
    expired = new_job(store, live, now=an_hour_ago - dt.timedelta(minutes=1))
    (claim,) = store.claim(live, 1, "w", 30)
    assert claim.id == running
    store.start([Attempt(running, "w", claim.attempts)], 30)
    (claim,) = store.claim(live, 1, "w", 30, now=an_hour_ago)
    assert claim.id == expired
    jobs = {
        "ready": new_job(store, live),
        "delayed": new_job(store, live, delay_ms=3_600_000),
        "paused": new_job(store, held),
        "running": running,
        "lease_expired": expired,
    }
    with store.pool.connection() as conn:
        queues.pause(conn, store.schema, held, by="tests")
    for status in ("succeeded", "failed"):
        job_id = new_job(store, done)
        (claim,) = store.claim(done, 1, "w", 30)
        attempt = [Attempt(job_id, "w", claim.attempts)]
        store.complete(attempt) if status == "succeeded" else store.fail(attempt, ["boom"])
        jobs[status] = job_id
    jobs["cancelled"] = new_job(store, done)
    store.cancel(jobs["cancelled"], by="tests")
    jobs["_queues"] = (live, held, done)
    return jobs


def test_every_state_filter_lists_its_jobs_and_each_row_names_its_state(every_state, run):
    live, held, _ = every_state["_queues"]
    mine = {v for k, v in every_state.items() if not k.startswith("_")}
    for state in states.STATES:
        code, out, _ = run("jobs", "list", "--status", state, "--limit", "1000", "--json")
        assert code == 0
        found = [row for row in json.loads(out) if row["id"] in mine]
        assert [row["id"] for row in found] == [every_state[state]], state
        assert found[0]["state"] == state
    # `queued`, the stored status: every waiting job, as before the states.
    code, out, _ = run("jobs", "list", "--status", "queued", "--limit", "1000", "--json")
    waiting = {row["id"] for row in json.loads(out)} & mine
    assert waiting == {every_state[s] for s in ("ready", "delayed", "paused")}
    # The table says each job's state, the delayed one with when it runs.
    code, out, _ = run("jobs", "list", "--queue", live, "--limit", "1000")
    by_id = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "delayed (in 59m)" in by_id[every_state["delayed"]]
    assert "lease expired (" in by_id[every_state["lease_expired"]]
    assert " ready " in by_id[every_state["ready"]]


def test_the_counts_agree_with_the_lists(every_state, run):
    live, held, done = every_state["_queues"]
    code, out, _ = run("stats", "--json")
    counts = {row["queue_name"]: row["jobs"] for row in json.loads(out)}
    assert counts[live] == {
        "ready": 1, "delayed": 1, "paused": 0, "running": 1, "lease_expired": 1, "failed": 0,
    }  # fmt: skip
    assert counts[done]["failed"] == 1
    assert counts[held] == {
        "ready": 0, "delayed": 0, "paused": 1, "running": 0, "lease_expired": 0, "failed": 0,
    }  # fmt: skip


def test_jobs_show_says_a_lease_expired_and_what_to_do(every_state, run):
    code, out, _ = run("jobs", "show", every_state["lease_expired"])
    line = next(line for line in out.splitlines() if line.startswith("state "))
    assert "lease expired at " in line and "waiting for a worker to take it back" in line
    assert "jobs requeue" in line
    code, out, _ = run("jobs", "show", every_state["lease_expired"], "--json")
    assert json.loads(out)["job"]["state"] == "lease_expired"


# -- requeue ------------------------------------------------------------------------------


@pytest.fixture
def lease_guard_passed(pg_url):
    """The CLI's requeue takes a lease that ran out only once the server has been up for a
    whole lease (its default, 30 s): the run may have started the server just now."""
    server_up_for(pg_url, Settings().lease_seconds)


def test_jobs_requeue_puts_a_job_whose_worker_died_back_at_once(
    every_state, run, store, lease_guard_passed
):
    job_id = every_state["lease_expired"]
    code, out, _ = run("jobs", "requeue", job_id[:8])
    assert code == 0 and out.startswith("requeued 1 job(s) whose lease expired"), out
    row = store.get(job_id)
    assert row["status"] == "queued" and row["locked_by"] is None
    # An unstarted claim goes back uncharged, at once: the reaper's own transition.
    assert row["attempts"] == 0 and row["available_at"] <= store.server_now()
    event = store.events_of(job_id)[-1]
    assert event["type"] == "released" and event["actor"].startswith("cli:")
    assert event["data"] == {"worker": "w", "requeued_by": event["actor"]}


def test_a_requeue_never_takes_a_job_whose_worker_holds_its_lease(every_state, run, store):
    job_id = every_state["running"]
    code, _, err = run("jobs", "requeue", job_id)
    assert code == 2 and err.count("\n") == 1
    assert "its worker holds its lease" in err and "only lease-expired jobs" in err
    code, out, _ = run("jobs", "requeue", "--all-expired")
    assert code == 0
    row = store.get(job_id)
    assert row["status"] == "running" and row["locked_by"] == "w"
    with pytest.raises(InvalidTransition):
        store.requeue_expired(every_state["ready"], settings=Settings(), by="tests")


def test_requeue_all_expired_of_one_queue_counts_an_interrupted_attempt(
    store, run, lease_guard_passed
):
    queue = declared_queue(store)
    other = declared_queue(store)
    an_hour_ago = NOW - dt.timedelta(hours=1)
    started = new_job(store, queue, now=an_hour_ago)
    elsewhere = new_job(store, other, now=an_hour_ago)
    for job_id, name in ((started, queue), (elsewhere, other)):
        (claim,) = store.claim(name, 1, "w", 30, now=an_hour_ago)
        store.start([Attempt(job_id, "w", claim.attempts)], 30, now=an_hour_ago)
    code, out, _ = run("jobs", "requeue", "--all-expired", "--queue", queue, "--json")
    assert code == 0 and json.loads(out) == {"requeued": [started], "failed": [], "cancelled": []}
    row = store.get(started)
    assert row["status"] == "queued" and row["attempts"] == 1 and row["interruptions"] == 1
    assert store.events_of(started)[-1]["type"] == "timeout_requeued"
    assert store.get(elsewhere)["status"] == "running"
    code, out, _ = run("jobs", "requeue", "--all-expired", "--queue", queue)
    assert out.strip() == f"no job of queue {queue} has an expired lease: nothing to requeue"


# -- names, columns, one queue ------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["jobs", "list", "--queue", "reprts"],
        ["jobs", "retry", "--all-failed", "--queue", "reprts"],
        ["jobs", "requeue", "--all-expired", "--queue", "reprts"],
    ],
)
def test_a_queue_name_no_worker_declared_is_warned_about(store, run, args):
    code, _, err = run(*args)
    assert code == 0
    assert err == "warning: no worker has declared queue 'reprts': check the name\n"
    code, _, err = run(*args, "--json")
    assert json.loads(err) == {"warning": "no worker has declared queue 'reprts': check the name"}


def test_a_state_change_of_such_a_queue_is_refused_with_the_same_sentence(store, run):
    for args in (["queues", "pause", "reprts"], ["queues", "limit", "reprts", "2"]):
        code, _, err = run(*args)
        assert code == 2
        assert err.startswith("error: no worker has declared queue 'reprts': check the name, or")
        assert "--force" in err


def test_stats_and_queues_list_are_one_table(store, run):
    queue = declared_queue(store)
    new_job(store, queue)

    def table(*args):
        # Each line but its last column: the oldest job's wait moves between two calls.
        return [line.rsplit(None, 1)[0] for line in run(*args)[1].splitlines()]

    assert table("stats") == table("queues", "list")

    def listed(*args):
        rows = json.loads(run(*args, "--json")[1])
        return [{k: v for k, v in row.items() if k != "oldest_waiting_seconds"} for row in rows]

    assert listed("stats") == listed("queues", "list")


def test_a_limit_set_before_any_worker_declared_its_queue_is_listed(store, run):
    name = f"ahead_{uuid.uuid4().hex[:6]}"
    code, _, _ = run("queues", "limit", name, "4", "--force")
    assert code == 0
    code, out, _ = run("queues", "list")
    row = next(line.split() for line in out.splitlines() if line.startswith(name))
    assert row[1:3] == ["undeclared", "4"]


def test_queues_show_explains_one_queue(store, run):
    queue = declared_queue(store)
    failed = new_job(store, queue)
    (claim,) = store.claim(queue, 10, "w", 30)
    store.fail([Attempt(failed, "w", claim.attempts)], ["boom"])
    for _ in range(2):
        new_job(store, queue)
    with store.pool.connection() as conn:
        limits.set_limit(conn, store.schema, queue, 1, by="ops@example.com")
        queues.pause(conn, store.schema, queue, by="ops@example.com")
    code, out, _ = run("queues", "show", queue)
    assert code == 0
    fields = {line[:12].strip(): line[14:] for line in out.splitlines() if line[:1] != " "}
    assert fields["state"] == "paused"
    assert fields["paused"].startswith("by ops@example.com at ")
    assert fields["limit"].startswith("1 running at once, set by operator (ops@example.com) at ")
    assert fields["jobs"] == "0 ready, 0 delayed, 2 paused, 0 running, 0 lease expired, 1 failed"
    assert fields["last hour"] == "0 succeeded, 1 failed"
    assert fields["workers"] == "0 live worker process(es) consume it"
    why = out.split("why jobs wait\n", 1)[1]
    assert "paused by ops@example.com since" in why
    assert "no live worker process consumes this queue" in why
    code, out, _ = run("queues", "show", queue, "--json")
    shown = json.loads(out)
    assert shown["limit_source"] == "operator" and shown["limit_set_by"] == "ops@example.com"
    assert shown["jobs"]["paused"] == 2 and shown["throughput"]["failed"] == 1
    assert [r["reason"] for r in shown["waiting_because"]] == ["paused", "no_worker"]
    code, _, err = run("queues", "show", "nosuch")
    assert code == 2 and "no worker has declared queue 'nosuch'" in err


def test_the_account_commands_speak_json(run):
    email = f"json-{uuid.uuid4().hex[:6]}@example.com"
    code, out, _ = run("user", "create", "--email", email, "--role", "viewer",
                       "--password", "x" * 12, "--json")  # fmt: skip
    created = json.loads(out)
    assert code == 0 and created["email"] == email and created["created"] is True
    assert "password" not in json.dumps(created)
    code, out, _ = run("user", "list", "--json")
    assert email in {user["email"] for user in json.loads(out)}
    code, out, _ = run("token", "create", "--email", email, "--name", "ci", "--json")
    token = json.loads(out)
    assert token["name"] == "ci" and token["secret"].startswith("dpb_")
    code, out, _ = run("token", "list", "--email", email, "--json")
    assert [t["id"] for t in json.loads(out)] == [token["id"]]
    assert "secret" not in json.loads(out)[0]
    code, out, _ = run("token", "revoke", "--id", str(token["id"]), "--json")
    assert json.loads(out)["revoked"] is True
    code, out, _ = run("user", "deactivate", "--email", email, "--json")
    assert json.loads(out)["active"] is False


def test_a_worker_says_when_an_operators_limit_overrides_its_code(store, caplog):
    queue = declared_queue(store)
    with store.pool.connection() as conn:
        limits.set_limit(conn, store.schema, queue, 4, by="ops@example.com")
        with caplog.at_level("WARNING", logger="dramatiq_pg_broker.limits"):
            assert limits.apply_declared(conn, store.schema, {queue: 2}, by="worker w") == []
    (record,) = [r for r in caplog.records if queue in r.getMessage()]
    said = record.getMessage()
    assert f"Queue {queue} keeps the limit 4 an operator set (ops@example.com, " in said
    assert "not this worker's queue_limits 2" in said
    with store.pool.connection() as conn:
        assert limits.get(conn, store.schema, queue).limit == 4


def test_a_command_leaves_the_callers_logging_as_it_was(run):
    """A command quiets the outage lines while it runs (it says itself why the database
    cannot be reached), and gives the logger back as it found it: a program or a test that
    calls ``main()`` still hears of the next outage."""
    log = logging.getLogger("dramatiq_pg_broker.outage")
    log.setLevel(logging.NOTSET)
    code, _, _ = run("stats")
    assert code == 0
    assert log.level == logging.NOTSET and log.getEffectiveLevel() <= logging.WARNING
