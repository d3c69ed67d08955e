"""A member's event feed on partitioned events: the same pages, in the same order, with the
same cursors and type filters, as the full feed restricted to the member's jobs, whether
it is read job by job (a member with few jobs) or walked newest first and filtered."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from admin_api import queries
from dramatiq_pg_broker.retention import create_partitions

DAYS = 6


@pytest.fixture(scope="module")
def events(env, schema):
    """Events over the last six days in their daily partitions, written in time order:
    jobs of the member, of another member and of nobody, each with a created, a claimed
    and an outcome event; some of the member's old jobs have an event today (retried days
    later), and one an event stamped half an hour before its job (a sender's clock ahead
    of the server's). Returns the member's job ids."""
    member = env.users["member"].id
    other = env.accounts.create_user(f"{uuid.uuid4().hex}@example.com", "a password", "member")
    with env.pool.connection() as conn:
        (now,) = conn.execute("SELECT now()").fetchone()
        create_partitions(conn, schema, now - dt.timedelta(days=DAYS + 1), DAYS + 3)
        jobs, rows = [], []
        for n in range(30):
            created = now - dt.timedelta(days=n % DAYS, hours=1, minutes=n)
            owner = (member, other.id, None)[n % 3]
            job_id = str(uuid.uuid4())
            jobs.append((job_id, owner, created))
            rows.append((created, job_id, "created"))
            rows.append((created + dt.timedelta(seconds=1), job_id, "claimed"))
            outcome = ("succeeded", "failed", "cancelled")[(n // 3) % 3]
            rows.append((created + dt.timedelta(seconds=2), job_id, outcome))
            if n % 5 == 0:
                rows.append((now - dt.timedelta(minutes=n), job_id, "manual_retry"))
        early = next(job for job in jobs if job[1] == member)
        rows.append((early[2] - dt.timedelta(minutes=30), early[0], "progress"))
        rows.sort()
        conn.execute(
            f'INSERT INTO "{schema}".job_events (job_id, type, attempt, created_at) '
            "SELECT job_id, type, 1, at FROM unnest(%s::uuid[], %s::text[], %s::timestamptz[]) "
            "AS e (job_id, type, at)",
            ([r[1] for r in rows], [r[2] for r in rows], [r[0] for r in rows]),
        )
        owned = [job for job in jobs if job[1] is not None]
        conn.execute(
            f'INSERT INTO "{schema}".job_owners (job_id, user_id, created_at) '
            "SELECT * FROM unnest(%s::uuid[], %s::bigint[], %s::timestamptz[])",
            ([j[0] for j in owned], [j[1] for j in owned], [j[2] for j in owned]),
        )
        conn.execute(f'ANALYZE "{schema}".job_owners')
    return {job[0] for job in jobs if job[1] == member}


def expected_feed(env, owned: set[str], query: str) -> list[int]:
    everything = env.get(f"/api/job-events?{query}&limit=200", "viewer").json
    assert everything["next"] is None, "the fixture's events should fit on one page"
    return [event["id"] for event in everything["results"] if event["job_id"] in owned]


@pytest.mark.parametrize("query", ["", "type=created", "type=manual_retry", "type=failed"])
@pytest.mark.parametrize("by_job", [True, False], ids=["by-job", "walked"])
def test_the_member_feed_is_the_full_feed_restricted_to_owned_jobs(
    env, events, monkeypatch, query, by_job
):
    chosen = []
    monkeypatch.setattr(
        queries.JobQueries, "_feed_by_job", lambda *args: chosen.append(by_job) or by_job
    )
    expected = expected_feed(env, events, query)
    assert expected, "the member should have events of this type"
    forward, backward, _first = env.walk(f"/api/job-events?{query}&limit=3", "member")
    assert forward == expected
    assert backward == expected
    assert chosen, "the member's feed did not choose how to read"


def test_the_feed_is_read_job_by_job_when_probes_cost_less_than_the_walk(
    env, events, schema, monkeypatch
):
    """The choice itself, on the fixture's statistics (about a hundred events, a third of
    them the member's): a walk finds a page of the member's events in a few rows, cheaper
    than probing each of their jobs in each partition; were a probe nearly free, asking
    each job would win. A member who owns nothing is never read job by job."""
    member = env.users["member"].id
    reads = queries.JobQueries(env.engine, schema)
    with reads.engine.connect() as conn:
        conn.exec_driver_sql(f'ANALYZE "{schema}".job_events')
        assert not reads._feed_by_job(conn, member, 50)
        monkeypatch.setattr(queries, "FEED_PROBE_COST", 0.01)
        assert reads._feed_by_job(conn, member, 50)
        nobody = env.accounts.create_user(f"{uuid.uuid4().hex}@example.com", "a password", "member")
        assert not reads._feed_by_job(conn, nobody.id, 50)
