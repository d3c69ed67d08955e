"""The event feed: newest first, cursor pages that stay put while events are appended."""

from __future__ import annotations

import uuid

import pytest


def path_of(link: str) -> str:
    assert link.startswith("/api/"), link
    return link


def ids(page) -> list[int]:
    return [event["id"] for event in page["results"]]


def test_feed_pages_newest_first_and_back(env):
    for _ in range(7):
        env.enqueue()  # one "created" event each
    first = env.get("/api/job-events?type=created&limit=3").json
    assert len(first["results"]) == 3 and first["previous"] is None
    assert ids(first) == sorted(ids(first), reverse=True)
    # New events while paging do not shift the next page.
    newcomer = env.enqueue()
    second = env.get(path_of(first["next"])).json
    assert ids(second) == sorted(ids(second), reverse=True)
    assert max(ids(second)) < min(ids(first))
    assert second["previous"] is not None
    back = env.get(path_of(second["previous"])).json
    assert ids(back) == ids(first)
    # Going back past the first page reaches the newcomer.
    newest = env.get(path_of(back["previous"])).json
    newcomer_events = [e for e in newest["results"] if e["job_id"] == newcomer]
    assert newcomer_events and newest["previous"] is None
    assert newest["next"] is not None


def test_feed_walks_every_event_exactly_once(env):
    job = env.failed()
    everything = env.get("/api/job-events?limit=200").json
    assert everything["next"] is None or len(everything["results"]) == 200
    seen: list[int] = []
    page = env.get("/api/job-events?limit=2").json
    while True:
        seen.extend(ids(page))
        if page["next"] is None:
            break
        page = env.get(path_of(page["next"])).json
    assert seen == sorted(seen, reverse=True)
    assert len(seen) == len(set(seen))
    assert set(ids(everything)) <= set(seen)
    assert any(e["job_id"] == job for e in everything["results"])


def test_feed_filters(env):
    job = env.failed()
    mine = env.get(f"/api/job-events?job_id={job}").json
    assert [e["type"] for e in mine["results"]] == ["failed", "claimed", "created"]
    failed = env.get("/api/job-events?type=failed&limit=200").json
    assert failed["results"] and {e["type"] for e in failed["results"]} == {"failed"}
    both = env.get(f"/api/job-events?type=claimed&job_id={job}").json
    assert [e["type"] for e in both["results"]] == ["claimed"]
    assert env.get(f"/api/job-events?job_id={uuid.uuid4()}").json["results"] == []


def test_feed_default_and_maximum_page_size(env):
    for _ in range(3):
        env.enqueue()
    assert len(env.get("/api/job-events").json["results"]) <= 50
    assert env.get("/api/job-events?limit=200").status_code == 200


def test_an_empty_page_still_links_back(env):
    oldest = env.get("/api/job-events?limit=200").json["results"][-1]["id"]
    from admin_api.pagination import encode_cursor
    from admin_api.queries import Cursor

    cursor = encode_cursor(Cursor(older=True, event_id=oldest))
    empty = env.get(f"/api/job-events?cursor={cursor}").json
    assert empty["results"] == [] and empty["next"] is None
    back = env.get(path_of(empty["previous"])).json
    assert oldest in ids(back)


@pytest.mark.parametrize(("older", "event_id"), [(True, 0), (False, 2**63 - 1), (True, 2**63 - 1)])
def test_links_from_a_cursor_at_either_end_are_accepted(env, older, event_id):
    from admin_api.pagination import encode_cursor
    from admin_api.queries import Cursor

    page = env.get(f"/api/job-events?cursor={encode_cursor(Cursor(older, event_id))}")
    assert page.status_code == 200, page.text
    for link in (page.json["next"], page.json["previous"]):
        if link is not None:
            result = env.get(path_of(link))
            assert result.status_code == 200, (link, result.text)


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("cursor=garbage", "cursor is not one this API made"),
        ("cursor=bzo5OTk5OTk5OTk5OTk5OTk5OTk5OTk5", "cursor is not one this API made"),
        ("cursor=%00", "NUL"),
        ("limit=0", "limit must be an integer from 1 to 200"),
        ("limit=201", "limit must be an integer from 1 to 200"),
        ("type=exploded", "type must be one of created"),
        ("job_id=42", "job_id must be a UUID"),
        ("page=2", "unknown query parameter(s) 'page'"),
    ],
)
def test_feed_rejects_bad_parameters(env, query, words):
    result = env.get(f"/api/job-events?{query}")
    assert result.status_code == 400, result.text
    assert words in result.json["message"]
