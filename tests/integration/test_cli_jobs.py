"""The operator's CLI against real PostgreSQL: jobs list/show/retry/cancel, stats, prune and
schedules, in both output forms, and one-line errors with exit code 2 for bad arguments."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import pytest

from dramatiq_pg_broker.jobs import Attempt, NewJob

from ..helpers import StatementCounter


@pytest.fixture
def store(store, schema):
    """The module's job store, on an empty jobs table."""
    with store.pool.connection() as conn:
        conn.execute(f"TRUNCATE {schema}.jobs, {schema}.jobs_history, {schema}.job_keys CASCADE")
    return store


def enqueue(store, queue="mail", actor="send", *, delay_ms=0, now=None) -> str:
    job_id = str(uuid.uuid4())
    store.enqueue(
        NewJob(
            job_id,
            queue,
            actor,
            message={"args": [1], "kwargs": {}},
            delay_ms=delay_ms,
            max_attempts=21,
        ),
        now=now,
    )
    return job_id


def failed_job(store, queue="mail", *, now=None) -> str:
    job_id = enqueue(store, queue, now=now)
    (claimed,) = [c for c in store.claim(queue, 100, "w", 30, now=now) if c.id == job_id]
    store.fail([Attempt(job_id, "w", claimed.attempts)], ["ValueError: bad address"], now=now)
    return job_id


def test_jobs_list_filters_and_aligns(store, run):
    failed = failed_job(store, "mail")
    queued = enqueue(store, "mail")
    enqueue(store, "reports", "build")

    code, out, _ = run("jobs", "list", "--queue", "mail")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "ID", "QUEUE", "ACTOR", "STATE", "ATTEMPTS", "CREATED", "UPDATED", "ERROR",
    ]  # fmt: skip
    assert len(lines) == 3 and "reports" not in out
    # Aligned: every row's state column starts where the header's does.
    column = lines[0].index("STATE")
    assert {line[column:].split()[0] for line in lines[1:]} == {"ready", "failed"}
    assert ("ago" in out or " now " in out) and "ValueError: bad address" in out

    code, out, _ = run("jobs", "list", "--status", "failed", "--json")
    assert code == 0
    assert [j["id"] for j in json.loads(out)] == [failed]
    code, out, _ = run("jobs", "list", "--actor", "build", "--limit", "1", "--json")
    assert [j["queue_name"] for j in json.loads(out)] == ["reports"]
    assert queued


def test_jobs_show_prints_the_row_and_its_timeline(store, run):
    job = failed_job(store)
    code, out, _ = run("jobs", "show", job)
    assert code == 0
    assert f"id               {job}" in out or out.splitlines()[0].split() == ["id", job]
    timeline = out.split("timeline\n", 1)[1]
    assert [line.split()[2] for line in timeline.splitlines()[1:]] == [
        "created",
        "claimed",
        "failed",
    ]

    code, out, _ = run("jobs", "show", job, "--json")
    data = json.loads(out)
    assert data["job"]["status"] == "failed"
    assert [e["type"] for e in data["events"]] == ["created", "claimed", "failed"]


def test_names_and_errors_are_printed_escaped(store, run):
    """A bidirectional override in an actor name, an escape sequence in an error: the
    terminal shows what the row holds, in the list and on the job's page."""
    job = enqueue(store, "mail", "invoice\u202egnp.exe")
    (claimed,) = store.claim("mail", 1, "w", 30)
    store.fail([Attempt(job, "w", claimed.attempts)], ["bad\x1b[2Jline\nnext\u200bline"])
    code, out, _ = run("jobs", "list")
    assert code == 0 and "invoice\\u202egnp.exe" in out and "bad\\x1b[2Jline" in out
    assert not any(ch in out for ch in "\u202e\x1b\u200b")
    code, out, _ = run("jobs", "show", job)
    assert code == 0 and "invoice\\u202egnp.exe" in out and "next\\u200bline" in out
    assert not any(ch in out for ch in "\u202e\x1b\u200b")
    # The traceback's lines stay lines, each under the value column.
    error_line = next(line for line in out.splitlines() if line.startswith("last_error"))
    assert error_line.endswith("bad\\x1b[2Jline")


def test_jobs_retry_and_cancel_use_the_job_store_transitions(store, run):
    job = failed_job(store)
    code, out, _ = run("jobs", "retry", job)
    assert code == 0 and "queued again" in out
    assert store.get(job)["status"] == "queued"
    assert store.get(job)["attempts"] == 0
    manual = [e for e in store.events_of(job) if e["type"] == "manual_retry"]
    assert len(manual) == 1 and manual[0]["actor"].startswith("cli")

    code, out, _ = run("jobs", "cancel", job, "--json")
    assert code == 0 and json.loads(out)["status"] == "cancelled"
    assert store.events_of(job)[-1]["type"] == "cancelled"

    # A transition the job's status does not allow: one line, exit 2, nothing changed.
    code, out, err = run("jobs", "cancel", job)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "is cancelled" in err
    assert store.get(job)["status"] == "cancelled"


def test_retry_all_failed_of_one_queue(store, run):
    mail = [failed_job(store, "mail") for _ in range(3)]
    other = failed_job(store, "reports")
    code, out, _ = run("jobs", "retry", "--all-failed", "--queue", "mail")
    assert code == 0 and "retried 3 failed job(s) of queue 'mail'" in out
    assert {store.get(j)["status"] for j in mail} == {"queued"}
    assert store.get(other)["status"] == "failed"
    code, out, _ = run("jobs", "retry", "--all-failed", "--json")
    assert json.loads(out) == {"retried": [other], "skipped": []}


def test_retrying_every_failed_job_goes_in_bounded_committed_batches(store, monkeypatch):
    jobs = [failed_job(store, "mail") for _ in range(5)]
    with StatementCounter(monkeypatch) as statements:
        batches = store.retry_all_failed(queue_name="mail", by="test", batch=2)
        first = next(batches)
        assert len(first) == 2
        assert {store.get(j)["status"] for j in first} == {"queued"}, "a batch commits at once"
        # Both fail again while the run goes on: they are not retried a second time.
        claimed = store.claim("mail", 10, "w", 30)
        assert sorted(c.id for c in claimed) == sorted(first)
        store.fail([Attempt(c.id, "w", c.attempts) for c in claimed], ["again"] * 2)
        rest = [list(batch) for batch in batches]
        assert [len(batch) for batch in rest] == [2, 1]
        assert sorted(first + [i for batch in rest for i in batch]) == sorted(jobs)
        assert {store.get(j)["status"] for j in first} == {"failed"}
        retries = statements[store.queries["retry_failed"]]
        assert retries == 4, "one statement a batch, and one that is empty"


def test_retry_all_failed_streams_its_batches(store, run, monkeypatch):
    from dramatiq_pg_broker.cli import jobs as cli_jobs

    monkeypatch.setattr(cli_jobs, "RETRY_BATCH", 2)
    jobs = [failed_job(store, q) for q in ("mail", "mail", "reports", "mail", "reports")]
    code, out, _ = run("jobs", "retry", "--all-failed", "--json")
    assert code == 0
    shown = json.loads(out)
    assert sorted(shown["retried"]) == sorted(jobs) and shown["skipped"] == []
    assert {store.get(j)["status"] for j in jobs} == {"queued"}
    code, out, _ = run("jobs", "retry", "--all-failed")
    assert (code, out.strip()) == (0, "retried 0 failed job(s)")


def test_stats_per_queue(store, run):
    enqueue(store, "mail")
    enqueue(store, "mail", now=dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5))
    enqueue(store, "mail", delay_ms=3_600_000)
    failed_job(store, "reports")
    code, out, _ = run("stats", "--json")
    assert code == 0
    stats = {row["queue_name"]: row for row in json.loads(out)}
    assert stats["mail"]["jobs"] == {
        "ready": 2, "delayed": 1, "paused": 0, "running": 0, "lease_expired": 0, "failed": 0,
    }  # fmt: skip
    # The counts of earlier releases stay for their readers.
    assert stats["mail"]["queued"] == 2 and stats["mail"]["delayed"] == 1
    assert stats["mail"]["oldest_waiting_seconds"] >= 299
    assert stats["reports"]["failed"] == 1 and stats["reports"]["oldest_waiting_seconds"] is None
    code, out, _ = run("stats")
    lines = out.splitlines()
    assert lines[0].split() == [
        "QUEUE", "STATE", "LIMIT", "READY", "DELAYED", "PAUSED", "RUNNING", "LEASE", "EXPIRED",
        "FAILED", "OLDEST", "WAITING",
    ]  # fmt: skip
    assert lines[1].split() == ["mail", "undeclared", "-", "2", "1", "0", "0", "0", "0", "5m"]


def test_stats_when_every_job_succeeded_does_not_say_there_are_no_jobs(store, run):
    job_id = enqueue(store, "mail")
    (claimed,) = store.claim("mail", 10, "w", 30)
    assert store.complete([Attempt(job_id, "w", claimed.attempts)]) == {job_id}
    code, out, _ = run("stats")
    assert code == 0
    assert "no jobs" not in out
    assert "no job is unfinished or failed" in out, out
    assert "jobs list --status succeeded" in out
    code, out, _ = run("stats", "--json")
    assert json.loads(out) == []


def test_prune_dry_run_then_for_real(store, run):
    old = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=40)
    failed = failed_job(store, now=old)
    recent = failed_job(store)
    code, out, _ = run("prune", "--dry-run")
    assert code == 0 and "would delete 1 finished job(s) (dry run)" in out
    assert store.get(failed)["status"] == "failed"
    code, out, _ = run("prune", "--json")
    report = json.loads(out)
    assert report["jobs"]["failed"] == 1 and report["events"]["failed"] == 3
    assert store.get(recent)["status"] == "failed"
    with pytest.raises(Exception, match="no job"):
        store.get(failed)


def test_schedules_lists_what_workers_registered(pg_url, schema, run):
    import dramatiq

    from dramatiq_pg_broker import PostgresBroker, periodic

    broker = PostgresBroker(url=pg_url, schema=schema, retention=False)

    @periodic("*/5 * * * *", timezone="Europe/Paris", missed="skip")
    @dramatiq.actor(broker=broker, queue_name="reports", actor_name="report")
    def report():
        pass

    broker.periodic.new_scheduler().register(broker.schedules[0], dt.datetime.now(dt.timezone.utc))
    broker.close()
    code, out, _ = run("schedules")
    assert code == 0
    (line,) = [line for line in out.splitlines() if line.startswith("report ")]
    assert line.split()[:8] == ["report", "actor", "reports", "cron", "*/5", "*", "*", "*"]
    assert "Europe/Paris" in line and "skip" in line and "never" in line and "in " in line
    code, out, _ = run("schedules", "--json")
    (row,) = [r for r in json.loads(out) if r["name"] == "report"]
    assert row["trigger"] == "cron */5 * * * *" and row["last_tick"] is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["jobs", "show", "not-a-uuid"], "is not a job id"),
        (["jobs", "show", "3dd0ad2"], "too short: give at least 8 hex characters"),
        (["jobs", "cancel", "3dd0ad2g"], "is not a job id"),
        (["jobs", "retry", "00000000"], "no job id starts with '00000000'"),
        (["jobs", "show", str(uuid.UUID(int=1))], "no job with id"),
        (["jobs", "list", "--status", "lost"], "invalid choice"),
        (["jobs", "list", "--limit", "0"], "not a positive whole number"),
        (["jobs", "retry"], "one of the arguments"),
        (
            ["jobs", "retry", str(uuid.UUID(int=1)), "--queue", "q"],
            "--queue goes with --all-failed",
        ),
        (["jobs", "frobnicate"], "invalid choice"),
        (["prune", "--now"], "unrecognized arguments"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(run, store, args, message):
    code, out, err = run(*args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1, err
    assert message in err


def with_prefix(prefix: str, n: int) -> str:
    """A job id that starts with ``prefix`` (8 hex characters)."""
    return str(uuid.UUID(prefix + f"{n:024x}"))


def test_every_job_id_argument_takes_a_unique_prefix(store, run):
    shown = enqueue(store, "mail")
    code, out, err = run("jobs", "show", shown[:8])
    assert code == 0, err
    assert out.splitlines()[0].split() == ["id", shown]

    cancelled = enqueue(store, "mail")
    code, out, err = run("jobs", "cancel", cancelled[:13])  # hyphens are fine too
    assert (code, out.strip()) == (0, f"job {cancelled} is cancelled"), err

    failed = failed_job(store, "mail")
    code, out, err = run("jobs", "retry", failed[:8].upper())
    assert (code, out.strip()) == (0, f"job {failed} is queued again"), err


def test_an_ambiguous_prefix_lists_its_candidates_and_changes_nothing(store, run):
    prefix = uuid.uuid4().hex[:8]
    ids = [with_prefix(prefix, n) for n in (1, 2, 3)]
    for job_id, queue in zip(ids, ("mail", "reports", "mail")):
        store.enqueue(
            NewJob(job_id, queue, "send", message={"args": [], "kwargs": {}}, max_attempts=21)
        )
    code, out, err = run("jobs", "cancel", prefix)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0] == (
        f"error: job id prefix '{prefix}' is ambiguous: 3 jobs start with it; give more of "
        "its characters"
    )
    assert lines[1].split() == ["ID", "QUEUE", "ACTOR", "STATUS", "CREATED"]
    assert [line.split()[0] for line in lines[2:]] == ids
    assert all(store.get(job_id)["status"] == "queued" for job_id in ids), "nothing changes"
    # Enough characters to tell them apart (here: the whole id) pick one.
    code, out, err = run("jobs", "cancel", ids[1].replace("-", ""))
    assert (code, out.strip()) == (0, f"job {ids[1]} is cancelled"), err


def test_a_prefix_matching_many_jobs_lists_the_first_ten(store, run):
    prefix = uuid.uuid4().hex[:8]
    for n in range(12):
        store.enqueue(
            NewJob(with_prefix(prefix, n), "mail", "send", message={"args": []}, max_attempts=21)
        )
    code, _, err = run("jobs", "show", prefix)
    assert code == 2
    lines = err.splitlines()
    assert "more than 10 jobs start with it" in lines[0]
    assert len(lines) == 1 + 1 + 10 + 1 and lines[-1].strip() == "..."


def test_a_prefix_is_resolved_through_the_primary_key(store, schema):
    """The look-up is a range of the primary key's index, not a scan of every id as text."""
    low, high = ("3dd0ad24-0000-0000-0000-000000000000", "3dd0ad24-ffff-ffff-ffff-ffffffffffff")
    with store.pool.connection() as conn, conn.transaction():
        conn.execute("SET LOCAL enable_seqscan = off")
        plan = conn.execute(
            "EXPLAIN (FORMAT JSON) " + store.queries["find_job_ids"],
            {"low": low, "high": high, "limit": 11},
        ).fetchone()[0]
    text = json.dumps(plan)
    # The unfinished jobs' lanes (0028) each have theirs: jobs_lane_0_pkey ...
    assert '"Index Name": "jobs_lane_0_pkey"' in text, text
    assert '"Index Name": "jobs_lane_long_pkey"' in text, text
    assert "Index Cond" in text and "Filter" not in text, text
