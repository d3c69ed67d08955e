"""A member's job list on partitioned history: the same pages, order, cursors, filters and
counts as the full list restricted to the member's jobs, and a plan that reads only the
history partitions the member's jobs can be in (days they were created on, or later)."""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from urllib.parse import quote

import pytest
from sqlalchemy import event

from dramatiq_pg_broker.retention import create_partitions

DAYS = 6
PARTITION_DAY = re.compile(r"^jobs_history_(?:succeeded|failed|cancelled)_(\d{8})$")


@pytest.fixture(scope="module")
def history(env, schema):
    """Finished jobs over the last six days in their daily partitions: the member owns
    those of the last three days (two of them created at the same instant), another member
    some older ones, nobody the rest; the member also owns two queued jobs, and owned one
    more whose queue was flushed (gone, with its owner row)."""
    member = env.users["member"].id
    other = env.accounts.create_user(f"{uuid.uuid4().hex}@example.com", "a password", "member")
    with env.pool.connection() as conn:
        (now,) = conn.execute("SELECT now()").fetchone()
        create_partitions(conn, schema, now - dt.timedelta(days=DAYS + 1), DAYS + 3)
        rows = []
        for n in range(48):
            day = n % DAYS
            created = now - dt.timedelta(days=day, minutes=30 + n)
            if n == 1:
                created = rows[0][5]  # the same instant as the job before: ordered by id
            status = ("succeeded", "failed", "cancelled")[n % 3]
            owner = member if day < 3 else (other.id if n % 2 else None)
            rows.append(
                (str(uuid.uuid4()), f"mq{n % 2}", f"tests.member_{n % 4}", status, owner, created)
            )
        for job_id, queue, actor, status, _owner, created in rows:
            conn.execute(
                f"""INSERT INTO "{schema}".jobs_history (
                        id, queue_name, actor_name, message, status, priority, available_at,
                        attempts, max_attempts, created_at, updated_at, started_at, finished_at)
                    VALUES (%s, %s, %s, %s, %s, 0, %s, 1, 1, %s, %s, %s, %s)""",
                (job_id, queue, actor, json.dumps({"args": [1]}), status)
                + (created,) * 4
                + (created + dt.timedelta(minutes=1),),
            )
        conn.execute(
            f'INSERT INTO "{schema}".job_owners (job_id, user_id, created_at) '
            "SELECT * FROM unnest(%s::uuid[], %s::bigint[], %s::timestamptz[])",
            (
                [r[0] for r in rows if r[4]],
                [r[4] for r in rows if r[4]],
                [r[5] for r in rows if r[4]],
            ),
        )
        conn.execute(f'ANALYZE "{schema}".job_owners')
    live = [
        env.create_job("member", actor_name=f"tests.member_{n}", queue_name="mq0") for n in (0, 1)
    ]
    env.create_job("member", actor_name="tests.member_0", queue_name="mq_flushed")
    assert env.store.flush("mq_flushed") == 1
    owned = {r[0] for r in rows if r[4] == member} | {job["id"] for job in live}
    oldest = min(r[5] for r in rows if r[4] == member)
    return owned, oldest


def walk(env, role, query, limit):
    """Every job of the list (following next links), the same walked back, the first page."""
    return env.walk(f"/api/jobs?{query}&limit={limit}", role)


QUERIES = [
    "",
    "status=failed",
    "status=succeeded",
    "status=queued",
    "queue=mq1",
    "actor=member_1",
    "actor=MEMBER",
    "status=cancelled&queue=mq0",
    "created_after=CUT",
    "created_before=CUT",
    "queue=mq0&created_before=CUT&actor=member_0",
]


@pytest.mark.parametrize("query", QUERIES)
def test_the_member_list_is_the_full_list_restricted_to_owned_jobs(env, history, query):
    owned, _oldest = history
    cut = quote((dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1, hours=1)).isoformat())
    query = query.replace("CUT", cut)
    everyone, _back, _first = walk(env, "viewer", query, 100)
    expected = [job_id for job_id in everyone if job_id in owned]
    assert len(set(everyone)) == len(everyone)

    mine, back, first = walk(env, "member", query, 2)
    assert mine == expected
    assert (first["count"], first["count_exact"]) == (len(expected), True)
    # Back from the last page by the previous links, and pages by offset.
    assert back == expected
    by_offset = env.get(f"/api/jobs?{query}&limit=3&offset=2", "member").json
    assert [job["id"] for job in by_offset["results"]] == expected[2:5]
    assert by_offset["count"] == len(expected)


def test_the_full_list_of_a_member_holds_its_jobs_and_nothing_else(env, history):
    owned, _oldest = history
    mine, _back, first = walk(env, "member", "", 5)
    # Every owned job (the flushed one is gone with its owner row), each once.
    assert sorted(mine) == sorted(owned) and first["count"] == len(owned)


def _executed_partitions(plan) -> tuple[set[str], int]:
    """The relations a plan read (at least one loop), and how many partitions it left out
    while running: subplans removed, or planned and never executed (pruned for every outer
    row of a parameterized nested loop)."""
    read: set[str] = set()
    removed = 0
    stack = [plan]
    while stack:
        node = stack.pop()
        removed += node.get("Subplans Removed", 0)
        if "Relation Name" in node:
            if node.get("Actual Loops", 0) > 0:
                read.add(node["Relation Name"])
            elif PARTITION_DAY.match(node["Relation Name"]):
                removed += 1
        stack.extend(node.get("Plans", []))
    return read, removed


@pytest.mark.parametrize("query", ["", "status=failed", "queue=mq0"])
def test_a_member_page_reads_only_partitions_its_jobs_can_be_in(env, history, query):
    _owned, oldest = history
    statements = []

    def capture(conn, cursor, statement, parameters, context, executemany):
        if "job_owners" in statement and "jobs_history" in statement.replace("all_jobs", ""):
            statements.append((statement, parameters))

    event.listen(env.engine, "before_cursor_execute", capture)
    try:
        response = env.get(f"/api/jobs?{query}&limit=2", "member")
    finally:
        event.remove(env.engine, "before_cursor_execute", capture)
    assert response.status_code == 200 and response.json["results"]
    assert statements, "the member's page and count read history through job_owners"
    oldest_day = oldest.astimezone(dt.timezone.utc).strftime("%Y%m%d")
    removed_total = 0
    for statement, parameters in statements:
        with env.engine.connect() as conn:
            (plan,) = conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + statement, parameters
            ).one()
        read, removed = _executed_partitions(plan[0]["Plan"])
        removed_total += removed
        days = {m.group(1) for name in read if (m := PARTITION_DAY.match(name))}
        # No partition of a day before the member's oldest job was ever read.
        assert days and min(days) >= oldest_day, (statement, sorted(read))
    assert removed_total > 0, "partitions are pruned while the query runs"
