"""The operator's control commands against real PostgreSQL: jobs abort, queues
list/pause/resume, workers and actors, in both output forms, names printed with control
characters escaped, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import uuid

from psycopg import sql

from dramatiq_pg_broker.cli.jobs import printable
from dramatiq_pg_broker.jobs import JobStore, NewJob

from .harness import declared_queue


def enqueue(store: JobStore, queue: str) -> str:
    job_id = str(uuid.uuid4())
    store.enqueue(
        NewJob(job_id, queue, "tests.a", message={"args": [], "kwargs": {}}, max_attempts=21)
    )
    return job_id


def test_jobs_abort_cancels_a_waiting_job_and_marks_a_running_one(store, run):
    queue = declared_queue(store)
    waiting = enqueue(store, queue)
    code, out, _ = run("jobs", "abort", waiting)
    assert code == 0 and out.strip() == f"job {waiting} is cancelled"
    assert store.get(waiting)["abort_requested_by"].startswith("cli")

    busy = enqueue(store, queue)
    store.claim(queue, 1, "worker-1", 60)
    code, out, _ = run("jobs", "abort", busy, "--wait", "0.3")
    assert code == 0
    assert "still running after 0.3s: its worker was asked to stop it" in out
    code, out, _ = run("jobs", "abort", busy, "--json")
    assert json.loads(out)["abort_requested_at"] is not None

    code, _, err = run("jobs", "abort", waiting)
    assert code == 2 and err.startswith("error: job") and "only queued or running" in err
    code, _, err = run("jobs", "abort", "not-a-uuid")
    assert code == 2 and err.count("\n") == 1 and "is not a job id" in err
    code, _, err = run("jobs", "abort", busy, "--wait", "-1")
    assert code == 2 and "is not a number of seconds" in err


def test_queues_pause_list_and_resume(store, run):
    queue = declared_queue(store)
    enqueue(store, queue)
    code, out, _ = run("queues", "pause", queue)
    assert code == 0 and out.startswith(f"queue {queue} is paused by cli")
    code, out, _ = run("queues", "pause", queue)
    assert code == 0 and "was already paused" in out
    code, out, _ = run("queues", "list")
    row = next(line.split() for line in out.splitlines() if line.startswith(queue))
    # Its waiting job is counted as paused, not as ready.
    assert row[1] == "paused" and row[2:9] == ["-", "0", "0", "1", "0", "0", "0"]
    code, out, _ = run("queues", "list", "--json")
    listed = {q["queue_name"]: q for q in json.loads(out)}
    assert listed[queue]["paused"] and listed[queue]["jobs"]["paused"] == 1
    assert listed[queue]["jobs"]["ready"] == 0 and listed[queue]["queued"] == 1
    code, out, _ = run("queues", "resume", queue, "--json")
    assert code == 0 and json.loads(out)["paused"] is False


def test_pausing_an_unknown_queue_needs_force(store, run):
    name = f"later_{uuid.uuid4().hex[:6]}"
    code, _, err = run("queues", "pause", name)
    assert code == 2 and "no worker has declared queue" in err and err.count("\n") == 1
    code, out, _ = run("queues", "pause", name, "--force")
    assert code == 0 and "is paused" in out
    code, _, err = run("queues", "pause", "bad name", "--force")
    assert code == 2 and "is not a queue name" in err


def test_workers_and_actors_are_listed_with_names_escaped(store, run, schema):
    with store.pool.connection() as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.workers (id, host, pid, queues, actors, version, expires_at)"
                " VALUES ('h:7:x', 'host\u202eevil', 7, '{{mail}}', '{{send}}', '0.2.0',"
                " now() + interval '1 minute')"
            ).format(sql.Identifier(schema))
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.actors (actor_name, queue_name) VALUES ('invoice\u202egnp.exe',"
                " 'mail') ON CONFLICT DO NOTHING"
            ).format(sql.Identifier(schema))
        )
    code, out, _ = run("workers")
    assert code == 0 and "host\\u202eevil" in out and "\u202e" not in out
    code, out, _ = run("actors")
    assert code == 0 and "invoice\\u202egnp.exe" in out and "\u202e" not in out
    code, out, _ = run("workers", "--json")
    assert any(w["id"] == "h:7:x" for w in json.loads(out))


def test_printable_escapes_what_a_terminal_would_hide():
    assert printable("a\u202eb\u200bc\x1bd\ne") == "a\\u202eb\\u200bc\\x1bd\\x0ae"
    assert printable("plain é 名") == "plain é 名"
