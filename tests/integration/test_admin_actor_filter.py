"""The job list's actor filter matching several names: the same pages, in the same order,
with the same cursors, whether the page is found by one walk of the list kept by actor
or by one index walk per matching name (names too rare for the first)."""

from __future__ import annotations

import uuid

import pytest

from admin_api import queries


@pytest.fixture(scope="module")
def tagged(env):
    """Jobs of five actors sharing a tag, unfinished and finished, interleaved in time with
    jobs of other actors, after (newer than) a job each of two rare actors; returns the tag
    and the ids of the tag's jobs, newest first."""
    tag = f"t{uuid.uuid4().hex[:8]}"
    env.succeeded(actor=f"rare_{tag}.a")
    env.enqueue(actor=f"rare_{tag}.b")
    for n in range(40):
        actor = f"{tag}.Part_{n % 5}" if n % 3 else f"other{n % 2}.job"
        (env.enqueue, env.succeeded, env.failed)[n % 3](actor=actor)
    listed = env.get("/api/jobs?limit=100").json["results"]
    return tag, [job["id"] for job in listed if job["actor_name"].startswith(f"{tag}.")]


def ids_of(env, query: str) -> list[str]:
    return [job["id"] for job in env.get(f"/api/jobs?{query}&limit=100").json["results"]]


@pytest.mark.parametrize("scan_rows", [queries.ACTOR_SCAN_ROWS, 8], ids=["scan", "per-name"])
def test_several_actor_names_page_like_the_full_list(env, tagged, monkeypatch, scan_rows):
    monkeypatch.setattr(queries, "ACTOR_SCAN_ROWS", scan_rows)
    tag, expected = tagged
    forward, backward, first = env.walk(f"/api/jobs?actor={tag.upper()}.PART&limit=3")
    assert forward == expected
    assert backward == expected
    assert first["count"] == len(expected)
    offset = env.get(f"/api/jobs?actor={tag}&limit=4&offset=5").json["results"]
    assert [job["id"] for job in offset] == expected[5:9]


def test_a_scan_that_finds_too_few_falls_back_to_each_name(env, tagged, monkeypatch):
    """Names too rare to fill the page in the rows read: the walk per name answers; a scan
    that found the page does not walk them."""
    tag, expected = tagged
    rare = [job for job in ids_of(env, "") if job not in expected][-2:]
    calls = []
    original = queries.JobQueries._walk_branches

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(queries, "ACTOR_SCAN_ROWS", 12)
    monkeypatch.setattr(queries.JobQueries, "_walk_branches", staticmethod(counted))
    page = env.get(f"/api/jobs?actor=rare_{tag}&limit=2").json
    assert [job["id"] for job in page["results"]] == rare
    assert page["count"] == 2 and page["next"] is None
    assert len(calls) == 1, "the rare names were not walked one by one"
    page = env.get(f"/api/jobs?actor={tag}.part&limit=2").json["results"]
    assert [job["id"] for job in page] == expected[:2]
    assert len(calls) == 1, "a scan that found the page walked each name too"
    # Rare names that match nothing under the other filters: counted, never walked.
    none = env.get(f"/api/jobs?actor=rare_{tag}&status=failed&limit=2").json
    assert (none["results"], none["count"], none["next"]) == ([], 0, None)
    assert len(calls) == 1, "names matching no job were walked"
