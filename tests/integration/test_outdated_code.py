"""Code older than the schema admits cannot claim or send (migration 0022, issue 44 item
11): the statements of release 0.1.0 itself, read from its commit in this repository, run
against this code's schema and fail before they change anything, saying to upgrade; this
code's own sends and claims beside them go on. The same with real 0.1.0 worker and sender
processes: tests/e2e/test_upgrade_from_previous_release.py."""

from __future__ import annotations

import re
import subprocess
import time
import uuid

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from dramatiq_pg_broker.jobs import NewJob
from dramatiq_pg_broker.migrate import migrate

from ..e2e.previous_release import PREVIOUS_COMMIT, PREVIOUS_VERSION
from ..e2e.workers import REPO
from ..rows import emptied_store, status_of

#: An owner as every release before 0022 wrote it: host:pid:thread:<8 hex digits>.
OLD_OWNER = "old-host:4242:Thread-1:0badcafe"


def previous_queries(schema: str) -> dict[str, str]:
    """The named statements of the previous release's queries.sql, with ``schema`` filled
    in (its own format: ``-- name --``, comment lines, the statement)."""
    shown = subprocess.run(
        ["git", "show", f"{PREVIOUS_COMMIT}:dramatiq_pg_broker/sql/queries.sql"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        pytest.fail(
            f"commit {PREVIOUS_COMMIT[:12]} (release {PREVIOUS_VERSION}) is not in this clone: "
            "fetch the full history (git fetch --unshallow)"
        )
    parts = re.split(r"^-- (\w+) --\s*$", shown.stdout, flags=re.M)
    schema_id = sql.Identifier(schema).as_string(None)
    return {
        name: "\n".join(line for line in body.strip().splitlines() if not line.startswith("--"))
        .strip()
        .replace("{schema}", schema_id)
        for name, body in zip(parts[1::2], parts[2::2])
    }


@pytest.fixture
def store(pg_url, schema):
    with emptied_store(pg_url, schema) as store:
        yield store


def old_send(conn: psycopg.Connection, old: dict[str, str], schema: str, **fields) -> None:
    conn.execute(
        old["insert_job"],
        {
            "id": str(uuid.uuid4()),
            "queue_name": "q",
            "actor_name": "act",
            "message": Jsonb({"args": []}),
            "view_from_bytes": False,
            "message_bytes": b'{"args": []}',
            "priority": 0,
            "now": None,
            "delay_ms": 0,
            "max_attempts": 3,
            "idempotency_key": None,
            "idempotency_scope": "",
            "events": True,
            "channel": f"{schema}.q",
            "durable": True,
            **fields,
        },
    )


def test_a_send_of_the_previous_release_is_refused_saying_to_upgrade(store, conn, schema):
    """0.1.0's send (its insert_job, unkeyed and keyed) and its bulk COPY leave out the
    status: the column's default refuses them before anything is written."""
    old = previous_queries(schema)
    jobs = f"{sql.Identifier(schema).as_string(None)}.jobs"
    before = conn.execute(f"SELECT count(*) FROM {jobs}").fetchone()[0]
    for key in (None, "key-1"):
        with pytest.raises(psycopg.errors.FeatureNotSupported) as info:
            old_send(conn, old, schema, idempotency_key=key)
        error = info.value
        assert f"schema {schema} refuses this send" in error.diag.message_primary
        assert "cannot honour idempotency keys" in error.diag.message_primary
        assert "Upgrade dramatiq-pg-broker" in error.diag.message_hint
    with pytest.raises(psycopg.errors.FeatureNotSupported, match="refuses this send"):
        with conn.cursor().copy(old["copy_jobs"].replace("(FORMAT BINARY)", "")) as copy:
            copy.write_row(
                (
                    str(uuid.uuid4()),
                    "q",
                    "act",
                    "{}",
                    None,
                    0,
                    "2030-01-01",
                    3,
                    None,
                    "",
                    "2030-01-01",
                    "2030-01-01",
                )
            )
    assert conn.execute(f"SELECT count(*) FROM {jobs}").fetchone()[0] == before
    # This release's send beside it: one job.
    job_id = str(uuid.uuid4())
    assert store.enqueue(NewJob(job_id, "q", "act", message={}, max_attempts=3)).created
    assert status_of(store, job_id) == "queued"


def test_a_claim_of_the_previous_release_is_refused_and_claims_nothing(store, conn, schema):
    """0.1.0's claim statement on a queued job fails whole, naming the worker and saying
    to upgrade: the job stays queued, uncharged, and this release's claim takes it."""
    old = previous_queries(schema)
    job_id = str(uuid.uuid4())
    store.enqueue(NewJob(job_id, "q", "act", message={}, max_attempts=3))
    params = {
        "queue_name": "q",
        "now": None,
        "limit": 10,
        "owner": OLD_OWNER,
        "lease_ms": 30_000,
        "events": True,
    }
    with pytest.raises(psycopg.errors.FeatureNotSupported) as info:
        conn.execute(old["claim_jobs"], params).fetchall()
    error = info.value
    assert f"schema {schema} refuses the claim of worker old-host:4242" in (
        error.diag.message_primary
    )
    assert "could not record the outcome" in error.diag.message_primary
    assert "upgrade dramatiq-pg-broker on its host" in error.diag.message_hint
    job = store.get(job_id)
    assert (job["status"], job["attempts"], job["locked_by"]) == ("queued", 0, None)
    # An idle poll of the old worker (nothing to claim) is not refused: it writes nothing.
    assert conn.execute(old["claim_jobs"], {**params, "queue_name": "empty"}).fetchall()

    from dramatiq_pg_broker.attempt.claiming import new_owner_id

    owner = new_owner_id()
    assert re.fullmatch(r"[^:]+:\d+:[0-9a-f]{8}:L\d{4}", owner), owner
    (claimed,) = store.claim("q", 10, owner, 30)
    assert claimed.id == job_id and claimed.attempts == 1


def test_0012_and_0022_commit_together_so_no_process_sees_the_schema_between(pg_url, empty_schema):
    """Upgrading from 0.1.0's schema, the breaking 0012 and 0022 (which refuses 0.1.0's
    claims) commit in one transaction: a session watching the applied migrations throughout
    sees 0009 or the latest, never one in between (a 0.1.0 worker still connected would
    claim there, and run jobs it cannot finish)."""
    import threading

    from dramatiq_pg_broker.migrate import discover

    from ..helpers import RELEASED

    migrate(pg_url, empty_schema, target=RELEASED)
    seen: set[int] = set()
    stop = threading.Event()

    def watch():
        with psycopg.connect(pg_url, autocommit=True) as watcher:
            query = sql.SQL("SELECT max(version) FROM {}.schema_migrations").format(
                sql.Identifier(empty_schema)
            )
            while not stop.is_set():
                seen.add(watcher.execute(query).fetchone()[0])
                time.sleep(0.001)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        migrate(pg_url, empty_schema)
    finally:
        time.sleep(0.05)
        stop.set()
        thread.join(10)
    latest = discover()[-1].version
    # The batch ends with the latest breaking migration; compatible ones after it commit
    # on their own, as every migration does.
    batch_end = max(m.version for m in discover() if m.breaking)
    between = {v for v in seen if 11 < v < batch_end}
    assert not between, f"a session saw the schema at {sorted(between)}"
    assert latest in seen and RELEASED in seen, seen
