"""One definition of a job row: the columns named once in sql/queries.sql (the block
job_columns) are exactly those of the migrated jobs, jobs_history and all_jobs, and every
move between the two tables carries every column: a job reaches history with each value
its row had, except the ones its transition sets."""

from __future__ import annotations

import datetime as dt
import re
import uuid

import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from dramatiq_pg_broker.db import JOB_COLUMNS, load_fragments, load_queries
from dramatiq_pg_broker.jobs import Attempt, NewJob

#: What every move to history sets (the block finished_row), apart from the status.
FINISHED = {"status", "locked_by", "locked_until", "started", "updated_at", "finished_at"}


def named_columns() -> list[str]:
    return [c.strip() for c in load_fragments()[JOB_COLUMNS].split(",")]


def migrated_columns(conn, schema: str, relation: str) -> list[tuple[str, str, str]]:
    """(name, type, nullable) of a table or view, in column order."""
    return conn.execute(
        "SELECT column_name, format_type(a.atttypid, a.atttypmod), is_nullable"
        " FROM information_schema.columns AS c"
        " JOIN pg_attribute AS a ON a.attrelid = to_regclass(format('%%I.%%I', c.table_schema,"
        "   c.table_name)) AND a.attname = c.column_name"
        " WHERE c.table_schema = %s AND c.table_name = %s ORDER BY c.ordinal_position",
        (schema, relation),
    ).fetchall()


def test_the_named_columns_are_the_migrated_tables_and_view(conn, schema):
    jobs = migrated_columns(conn, schema, "jobs")
    history = migrated_columns(conn, schema, "jobs_history")
    view = migrated_columns(conn, schema, "all_jobs")
    # The last column of jobs is its lane (0028), which no statement moving a row names:
    # its default routes the row.
    assert jobs[-1][0] == "lane"
    jobs = jobs[:-1]
    assert [name for name, _, _ in jobs] == named_columns(), (
        "a column of jobs is missing from (or extra in) the block job_columns of queries.sql"
    )
    # The same types; history also requires finished_at, the view requires nothing.
    assert [(n, t) for n, t, _ in history] == [(n, t) for n, t, _ in jobs]
    assert [(n, t) for n, t, _ in view] == [(n, t) for n, t, _ in jobs]


def test_the_view_names_its_columns(conn, schema):
    """all_jobs is no `SELECT *` frozen when it was made (0016)."""
    definition = conn.execute(
        "SELECT pg_get_viewdef(to_regclass(format('%%I.all_jobs', %s::text)))", (schema,)
    ).fetchone()[0]
    assert "*" not in definition
    assert definition.count("abort_requested_by") == 2


def test_no_statement_writes_the_row_s_columns_by_hand():
    """Every move into jobs_history or back into jobs lists the columns with {job_columns}
    and its values with a row macro; the sends insert new rows and name only theirs."""
    from importlib import resources

    for path in resources.files("dramatiq_pg_broker").joinpath("sql").iterdir():
        if not path.name.endswith(".sql"):
            continue
        lines = path.read_text("utf-8").splitlines()
        text = "\n".join(line for line in lines if not line.lstrip().startswith("--"))
        moves = text.count("INSERT INTO {schema}.jobs_history")
        assert moves == text.count("INSERT INTO {schema}.jobs_history ({job_columns})"), path.name
        assert moves == text.count("{finished_row:"), path.name
        # The column list itself is written once, in the block job_columns.
        assert text.count("abandoned_claims, abort_requested_at, abort_requested_by") <= 1, (
            path.name
        )
        assert "3600000" not in text, path.name
        # The ownership guard that locks the rows in id order too (the block owned_attempts).
        assert len(re.findall(r"ORDER BY j\.id\s+FOR UPDATE OF j", text)) <= 1, path.name
    queries = load_queries()
    assert queries["complete_jobs"].count("INSERT INTO {schema}.jobs_history") == 1
    guarded = [name for name, text in queries.items() if "ORDER BY j.id\nFOR UPDATE OF j" in text]
    assert sorted(guarded) == sorted(
        ["start_jobs", "complete_jobs", "fail_jobs", "release_jobs", "renew_leases"]
        + ["abort_attempts", "cancel_skipped"]
    )
    assert "AND NOT j.started\nORDER BY j.id" in queries["release_jobs"]


# -- every move carries every column ------------------------------------------------------


@pytest.fixture
def queue():
    return f"row_{uuid.uuid4().hex[:8]}"


def _enqueue(store, conn, schema, queue: str) -> str:
    """A queued job whose every column that no transition sets holds a value of its own."""
    job_id = str(uuid.uuid4())
    store.enqueue(
        NewJob(
            job_id,
            queue,
            "an_actor",
            message={"args": [1]},
            message_bytes=b'{"args": [1]}',
            priority=3,
            max_attempts=5,
            idempotency_key=f"key-{job_id}",
            idempotency_scope="scope",
        )
    )
    conn.execute(
        sql.SQL("UPDATE {}.jobs SET result = %s, last_error = 'earlier' WHERE id = %s").format(
            sql.Identifier(schema)
        ),
        (Jsonb({"kept": True}), job_id),
    )
    return job_id


def _running(store, queue: str, job_id: str, *, started: bool = True) -> Attempt:
    claimed = [c for c in store.claim(queue, 10, "worker-1", 60) if c.id == job_id]
    attempt = Attempt(job_id, "worker-1", claimed[0].attempts)
    if started:
        assert store.start([attempt], 60) == {job_id}
    return attempt


def _changed(before: dict, after: dict) -> set[str]:
    assert set(before) == set(after)
    return {column for column in before if before[column] != after[column]}


def _in_history(conn, schema, job_id) -> bool:
    query = sql.SQL("SELECT count(*) FROM {}.jobs_history WHERE id = %s").format(
        sql.Identifier(schema)
    )
    return conn.execute(query, (job_id,)).fetchone()[0] == 1


def _complete(store, queue, job_id):
    before = store.get(job_id)
    assert store.complete([Attempt(job_id, "worker-1", before["attempts"])]) == {job_id}
    return before, set()


def _fail(store, queue, job_id):
    before = store.get(job_id)
    assert store.fail([Attempt(job_id, "worker-1", before["attempts"])], ["boom"]) == {job_id}
    return before, {"last_error", "failures"}


def _abort_running(store, queue, job_id):
    store.abort(job_id, by="ops")
    before = store.get(job_id)
    assert store.abort_attempts([Attempt(job_id, "worker-1", before["attempts"])]) == {job_id}
    return before, set()


def _skip(store, queue, job_id):
    before = store.get(job_id)
    skip = {"reason": "skipped", "skipped_by": "mw", "message": "m"}
    done = store.cancel_skipped([Attempt(job_id, "worker-1", before["attempts"])], [skip])
    assert done == {job_id}
    return before, set()


def _retry_after_abort(store, queue, job_id):
    store.abort(job_id, by="ops")
    before = store.get(job_id)
    attempt = Attempt(job_id, "worker-1", before["attempts"])
    assert store.reschedule(attempt, queue, 0, "boom")
    return before, {"last_error", "failures"}


def _reap_exhausted(store, queue, job_id):
    before = store.get(job_id)
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)
    store.reap(batch=100, backoff_ms=[1], max_interruptions=1, lease_seconds=1, now=later)
    return before, {"last_error", "interruptions"}


@pytest.mark.parametrize(
    "finish",
    [_complete, _fail, _abort_running, _skip, _retry_after_abort, _reap_exhausted],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_running_job_moves_to_history_with_every_column(store, conn, schema, queue, finish):
    job_id = _enqueue(store, conn, schema, queue)
    _running(store, queue, job_id)
    before, sets = finish(store, queue, job_id)
    after = store.get(job_id)
    assert _in_history(conn, schema, job_id), "the job did not move"
    changed = _changed(before, after)
    assert changed <= FINISHED | sets, f"columns lost or changed on the move: {changed}"
    assert after["result"] == {"kept": True} and after["idempotency_key"] == f"key-{job_id}"


@pytest.mark.parametrize("how", ["cancel", "abort"])
def test_a_queued_job_moves_to_history_with_every_column(store, conn, schema, queue, how):
    job_id = _enqueue(store, conn, schema, queue)
    before = store.get(job_id)
    getattr(store, how)(job_id, by="ops")
    after = store.get(job_id)
    assert _in_history(conn, schema, job_id)
    sets = {"abort_requested_at", "abort_requested_by"} if how == "abort" else set()
    changed = _changed(before, after)
    assert changed <= FINISHED | sets, f"columns lost or changed on the move: {changed}"


def test_a_manual_retry_moves_the_job_back_with_every_column(store, conn, schema, queue):
    job_id = _enqueue(store, conn, schema, queue)
    _running(store, queue, job_id)
    _fail(store, queue, job_id)
    before = store.get(job_id)
    store.retry_failed(job_id, by="ops")
    after = store.get(job_id)
    resets = {
        "available_at", "attempts", "failures", "interruptions", "abandoned_claims",
        "abort_requested_at", "abort_requested_by",
    }  # fmt: skip
    changed = _changed(before, after)
    assert changed <= FINISHED | resets, f"columns lost or changed on the move: {changed}"
    assert after["result"] == {"kept": True} and after["last_error"] == "boom"
