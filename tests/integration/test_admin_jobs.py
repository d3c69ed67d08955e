"""The job endpoints of the admin API: list, filters, pages, create, detail, timeline,
retry, cancel, member scoping and bad input."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest
from psycopg import sql

from admin_api.operations import MAX_BODY_BYTES
from dramatiq_pg_broker.jobs import NewJob

from .admin_support import AdminEnv


def unique(prefix: str = "q") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


def query_of(link: str) -> dict[str, list[str]]:
    return parse_qs(urlsplit(link).query)


# -- list ------------------------------------------------------------------------------


def test_list_is_newest_first_with_default_page_size(env):
    queue = unique()
    ids = [env.enqueue(queue=queue) for _ in range(30)]
    page = env.get(f"/api/jobs?queue={queue}").json
    assert page["count"] == 30 and page["count_exact"] is True
    assert [job["id"] for job in page["results"]] == list(reversed(ids))[:25]
    assert page["previous"] is None
    assert set(query_of(page["next"])) == {"queue", "limit", "cursor"}
    last = env.get(page["next"]).json
    assert [job["id"] for job in last["results"]] == list(reversed(ids))[25:]
    assert last["next"] is None
    back = env.get(last["previous"]).json
    assert [job["id"] for job in back["results"]] == list(reversed(ids))[:25]
    assert back["previous"] is None


def test_list_pagination_edges(env):
    queue = unique()
    ids = list(reversed([env.enqueue(queue=queue) for _ in range(5)]))

    def page(query):
        result = env.get(f"/api/jobs?queue={queue}&{query}")
        assert result.status_code == 200, result.text
        return result.json

    exact = page("limit=5")
    assert [j["id"] for j in exact["results"]] == ids and exact["next"] is None
    middle = page("limit=2&offset=2")
    assert [j["id"] for j in middle["results"]] == ids[2:4]
    following = env.get(middle["next"]).json
    assert [j["id"] for j in following["results"]] == ids[4:] and following["next"] is None
    preceding = env.get(middle["previous"]).json
    assert [j["id"] for j in preceding["results"]] == ids[:2] and preceding["previous"] is None
    assert [j["id"] for j in env.get(preceding["next"]).json["results"]] == ids[2:4]
    tail = page("limit=2&offset=4")
    assert [j["id"] for j in tail["results"]] == ids[4:] and tail["next"] is None
    beyond = page("limit=2&offset=50")
    assert beyond["results"] == [] and beyond["count"] == 5 and beyond["next"] is None
    assert len(page("limit=100")["results"]) == 5
    assert len(page("limit=1")["results"]) == 1
    assert page("offset=")["count"] == 5  # an empty value means the default
    # Walking the whole list by cursor, one job a page, visits every job once.
    seen, link = [], f"/api/jobs?queue={queue}&limit=1"
    while link:
        step = env.get(link).json
        seen += [j["id"] for j in step["results"]]
        link = step["next"]
    assert seen == ids


def test_deep_pages_are_cursor_pages_and_counts_are_capped(env, monkeypatch):
    from admin_api import queries

    monkeypatch.setattr(queries, "COUNT_CAP", 3)
    queue = unique()
    ids = list(reversed([env.enqueue(queue=queue) for _ in range(5)]))
    page = env.get(f"/api/jobs?queue={queue}&limit=2").json
    assert page["count"] == 3 and page["count_exact"] is False
    assert env.get(f"/api/jobs?queue={queue}&offset=10001").status_code == 400
    bad = env.get(f"/api/jobs?queue={queue}&cursor=bm9wZQ")
    assert bad.status_code == 400 and "cursor" in bad.json["message"]
    both = env.get(page["next"] + "&offset=1")
    assert both.status_code == 400
    assert [j["id"] for j in env.get(page["next"]).json["results"]] == ids[2:4]
    too_long = env.get("/api/jobs?actor=" + "a" * 256)
    assert too_long.status_code == 400 and "at most 255" in too_long.json["message"]
    monkeypatch.setattr(queries, "MAX_ACTOR_MATCHES", 1)
    env.enqueue(actor="tests.one_of_two")
    env.enqueue(actor="tests.two_of_two")
    many = env.get("/api/jobs?actor=of_two")
    assert many.status_code == 400 and "matches 2 actor names" in many.json["message"]


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("limit=0", "limit must be an integer from 1 to 100"),
        ("limit=101", "limit must be an integer from 1 to 100"),
        ("limit=ten", "limit must be an integer"),
        ("offset=-1", "offset must be an integer from 0"),
        ("offset=99999999999999999999999", "offset must be an integer"),
        ("status=stopped", "status must be one of ready, delayed, paused, running"),
        ("created_after=yesterday", "created_after must be an ISO 8601 date-time"),
        ("stauts=failed", "unknown query parameter(s) 'stauts'"),
        ("status=failed&status=queued", "give the query parameter status once"),
        ("actor=%00", "NUL character"),
        # ASCII digits only: int() alone would take these.
        ("limit=%D9%A3", "limit must be an integer"),
        ("limit=%EF%BC%91", "limit must be an integer"),
        ("offset=1_000", "offset must be an integer"),
        ("limit=%2B5", "limit must be an integer"),
    ],
)
def test_list_rejects_bad_parameters(env, query, words):
    result = env.get(f"/api/jobs?{query}")
    assert result.status_code == 400, result.text
    assert result.json["error"] == "bad_request"
    assert words in result.json["message"]


def test_list_filters(env):
    tag = unique("z")
    now = dt.datetime.now(dt.timezone.utc)
    queue = unique()
    report = env.enqueue(actor=f"{tag}.Reports.Build_Daily", queue=queue)
    failed = env.failed(actor=f"{tag}.mail.send")
    done = env.succeeded(actor=f"{tag}.mail.sendx100%")

    def ids(query):
        result = env.get(f"/api/jobs?actor={tag}&limit=100&{query}")
        assert result.status_code == 200, result.text
        return {job["id"] for job in result.json["results"]}

    assert ids("") == {report, failed, done}
    assert ids("status=failed") == {failed}
    assert ids("status=succeeded") == {done}
    assert ids("status=queued") == {report}
    assert ids("status=cancelled") == set()
    assert ids(f"queue={queue}") == {report}
    assert ids(f"queue={queue}&status=failed") == set()
    assert ids("queue=nonexistent") == set()
    result = env.get("/api/jobs?actor=BUILD_DAILY&limit=100")  # case-insensitive substring
    assert report in {job["id"] for job in result.json["results"]}
    assert ids("status=failed") == {failed}
    # % and _ are characters, not wildcards.
    assert env.get(f"/api/jobs?actor={tag}.mail.send_").json["count"] == 0
    assert env.get("/api/jobs?actor=x100%25").json["count"] == 1
    after = (now - dt.timedelta(minutes=5)).isoformat().replace("+", "%2B")
    assert ids(f"created_after={after}") == {report, failed, done}
    assert ids("created_after=2999-01-01T00:00:00Z") == set()
    assert ids("created_before=2000-01-01T00:00:00") == set()
    assert ids("created_before=2999-01-01") == {report, failed, done}


def test_created_range_is_inclusive_after_and_exclusive_before(env, pg_url, schema):
    queue = unique()
    job = env.enqueue(queue=queue)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {}.jobs SET created_at = '2024-05-01T12:00:00Z' WHERE id = %s").format(
                sql.Identifier(schema)
            ),
            (job,),
        )
    at = "2024-05-01T12:00:00Z"
    assert env.get(f"/api/jobs?queue={queue}&created_after={at}").json["count"] == 1
    assert env.get(f"/api/jobs?queue={queue}&created_before={at}").json["count"] == 0


# -- create ----------------------------------------------------------------------------


def test_create_stores_the_message_a_worker_can_run(env):
    result = env.post(
        "/api/jobs",
        "operator",
        json={
            "actor_name": "reports.build",
            "queue_name": "reports",
            "args": [1, "two", {"three": 3}],
            "kwargs": {"dry_run": True},
            "priority": -5,
            "max_retries": 2,
        },
    )
    assert result.status_code == 201, result.text
    job = result.json
    assert result.headers["location"].endswith(f"/api/jobs/{job['id']}")
    assert job["status"] == "queued"
    assert job["actor_name"] == "reports.build"
    assert job["queue_name"] == "reports"
    assert job["priority"] == -5
    assert job["max_attempts"] == 3
    assert job["attempts"] == 0
    assert job["owner"] == "operator@example.com"
    assert job["message_encoding"] == "json"
    message = job["message"]
    assert message["message_id"] == job["id"]
    assert message["args"] == [1, "two", {"three": 3}]
    assert message["kwargs"] == {"dry_run": True}
    assert message["options"]["max_retries"] == 2
    # The broker can rebuild the message exactly as it rebuilds any stored one.
    from dramatiq_pg_broker import PostgresBroker

    rebuilt = PostgresBroker(url="postgresql://unused", schema="x").decode_message(message, None)
    assert rebuilt.actor_name == "reports.build" and rebuilt.args == (1, "two", {"three": 3})
    events = env.get(f"/api/jobs/{job['id']}/events").json["results"]
    assert [e["type"] for e in events] == ["created"]


def test_create_defaults(env):
    job = env.create_job(actor_name="tests.defaults")
    assert job["queue_name"] == "default"
    assert job["priority"] == 0
    assert job["max_attempts"] == env.settings.max_attempts
    assert job["message"]["args"] == [] and job["message"]["kwargs"] == {}
    # The worker then applies the actor's own max_retries.
    assert job["message"]["options"] == {}
    assert job["idempotency_key"] is None


def test_the_max_attempts_setting_gives_sends_and_created_jobs_one_default(
    pg_url, schema, monkeypatch
):
    """DRAMATIQ_PG_MAX_ATTEMPTS sets the limit of an actor that sets no max_retries alike
    for sends under the default middleware (its Retries retries that often) and for jobs
    the admin API creates."""
    import dramatiq

    from dramatiq_pg_broker import PostgresBroker, Retries, Settings

    monkeypatch.setenv("DRAMATIQ_PG_MAX_ATTEMPTS", "7")
    broker = PostgresBroker(url=pg_url, schema=schema)
    api = AdminEnv(pg_url, schema, max_attempts=Settings.load().max_attempts)
    try:
        queue = unique()

        @dramatiq.actor(broker=broker, queue_name=queue, actor_name="tests.limit")
        def limit():
            pass

        [retries] = [m for m in broker.middleware if isinstance(m, Retries)]
        assert retries.max_retries == 6
        sent = broker.store.get(limit.send().message_id)
        created = api.create_job(actor_name="tests.limit", queue_name=queue)
        assert sent["max_attempts"] == created["max_attempts"] == 7
        bulk = broker.enqueue_many([limit.message() for _ in range(3)])
        assert {broker.store.get(m.message_id)["max_attempts"] for m in bulk} == {7}
    finally:
        broker.close()
        api.close()


def test_a_retries_middleware_given_its_own_max_retries_keeps_it(pg_url, schema, monkeypatch):
    import dramatiq

    from dramatiq_pg_broker import PostgresBroker, Retries

    monkeypatch.setenv("DRAMATIQ_PG_MAX_ATTEMPTS", "7")
    middleware = [
        Retries(max_retries=3) if m is dramatiq.middleware.Retries else m()
        for m in dramatiq.middleware.default_middleware
    ]
    broker = PostgresBroker(url=pg_url, schema=schema, middleware=middleware)
    try:

        @dramatiq.actor(broker=broker, queue_name=unique(), actor_name="tests.own_limit")
        def own_limit():
            pass

        assert broker.store.get(own_limit.send().message_id)["max_attempts"] == 4
    finally:
        broker.close()


def test_create_with_a_delay_or_a_time(env):
    before = dt.datetime.now(dt.timezone.utc)
    delayed = env.create_job(delay=60_000)
    available = dt.datetime.fromisoformat(delayed["available_at"])
    assert dt.timedelta(seconds=59) < available - before < dt.timedelta(seconds=70)
    at = (before + dt.timedelta(hours=2)).replace(microsecond=0)
    scheduled = env.create_job(available_at=at.isoformat())
    delta = dt.datetime.fromisoformat(scheduled["available_at"]) - at
    assert abs(delta) < dt.timedelta(seconds=5)
    past = env.create_job(available_at="2001-01-01T00:00:00")
    assert dt.datetime.fromisoformat(past["available_at"]) >= before


def test_create_is_idempotent_with_a_key(env):
    key = unique("key-")
    first = env.post(
        "/api/jobs", "operator", json={"actor_name": "tests.once", "idempotency_key": key}
    )
    second = env.post(
        "/api/jobs", "admin", json={"actor_name": "tests.once", "idempotency_key": key}
    )
    assert first.status_code == 201 and second.status_code == 200
    assert second.json["id"] == first.json["id"]
    assert second.json["owner"] == "operator@example.com"
    count = env.get("/api/jobs?actor=tests.once&limit=100").json["count"]
    assert count == 1
    # Keys are scoped by actor: the same key for another actor is another job.
    other = env.post(
        "/api/jobs", "admin", json={"actor_name": "tests.other", "idempotency_key": key}
    )
    assert other.status_code == 201 and other.json["id"] != first.json["id"]


def test_a_failed_create_writes_nothing(env, pg_url, schema):
    def counts():
        with psycopg.connect(pg_url, autocommit=True) as conn:
            return conn.execute(
                sql.SQL(
                    "SELECT (SELECT count(*) FROM {s}.jobs), (SELECT count(*) FROM {s}.job_owners)"
                ).format(s=sql.Identifier(schema))
            ).fetchone()

    before = counts()
    result = env.post("/api/jobs", json={"actor_name": "x", "args": "not a list"})
    assert result.status_code == 400
    assert counts() == before


def test_job_and_owner_are_written_in_one_transaction(env, monkeypatch, pg_url, schema):
    """If recording the owner fails, the job is rolled back too."""

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(env.accounts, "record_owner", broken)
    actor = unique("tests.atomic.")
    result = env.post("/api/jobs", json={"actor_name": actor})
    assert result.status_code == 500
    assert result.json["error"] == "internal_error"
    monkeypatch.undo()
    assert env.get(f"/api/jobs?actor={actor}").json["count"] == 0


BAD_BODIES = [
    ("{not json", "not valid JSON"),
    ('{"actor_name": NaN}', "not valid JSON"),
    ("", "body is empty"),
    ("[]", "must be a JSON object, not an array"),
    ('"text"', "must be a JSON object, not a string"),
    ("{}", "lacks the required field(s) actor_name"),
    ('{"actor_name": ""}', "actor_name must not be empty or only whitespace"),
    ('{"actor_name": "   "}', "actor_name must not be empty or only whitespace"),
    ('{"actor_name": 5}', "actor_name must be a string, not a number"),
    ('{"actor_name": null}', "actor_name must not be null"),
    ('{"actor_name": "a", "args": {"x": 1}}', "args must be a JSON array, not an object"),
    ('{"actor_name": "a", "args": "1,2"}', "args must be a JSON array, not a string"),
    ('{"actor_name": "a", "kwargs": [1]}', "kwargs must be a JSON object, not an array"),
    ('{"actor_name": "a", "priority": "high"}', "priority must be an integer, not a string"),
    ('{"actor_name": "a", "priority": 1.5}', "priority must be an integer, not a number"),
    ('{"actor_name": "a", "priority": true}', "priority must be an integer, not a boolean"),
    ('{"actor_name": "a", "priority": 2147483648}', "priority must be at most 2147483647"),
    ('{"actor_name": "a", "delay": -1}', "delay must be at least 0"),
    ('{"actor_name": "a", "delay": 1, "available_at": "2030-01-01"}', "not both"),
    ('{"actor_name": "a", "available_at": "soon"}', "available_at must be an ISO 8601"),
    ('{"actor_name": "a", "available_at": "9999-12-31T23:59:59"}', "ten years"),
    ('{"actor_name": "a", "max_retries": -1}', "max_retries must be at least 0"),
    ('{"actor_name": "a", "queue_name": "no spaces"}', "queue_name must match the pattern"),
    ('{"actor_name": "a", "queue_name": "9lives"}', "queue_name must match the pattern"),
    ('{"actor_name": "a", "idempotency_key": ""}', "idempotency_key must not be empty"),
    ('{"actor_name": "a", "options": {}}', "unknown field(s) 'options'"),
    ('{"actor_name": "a\\u0000b"}', "NUL character"),
    ('{"actor_name": "a", "args": ["\\ud800"]}', "unpaired surrogate"),
    ('{"actor_name": "a", "args": [1e999]}', "too large"),
    ('{"actor_name": "a", "args": ' + "[" * 40 + "]" * 40 + "}", "nested more than"),
    ('{"actor_name": "a", "args": ' + "[" * 100_000 + "]" * 100_000 + "}", "not valid JSON"),
    ('{"actor_name": "' + "a" * 256 + '"}', "at most 255 characters"),
]


@pytest.mark.parametrize(("body", "words"), BAD_BODIES)
def test_create_rejects_bad_input_with_a_message(env, body, words):
    result = env.post("/api/jobs", body=body, headers={"Content-Type": "application/json"})
    assert result.status_code == 400, result.text
    assert result.json["error"] == "bad_request"
    assert words in result.json["message"], result.json["message"]


def test_create_refuses_a_body_over_the_size_limit(env):
    args = ["x" * 1000] * (MAX_BODY_BYTES // 1000)
    body = json.dumps({"actor_name": "tests.too_big", "args": args})
    result = env.post("/api/jobs", body=body, headers={"Content-Type": "application/json"})
    assert result.status_code == 413, result.text
    assert result.json["error"] == "payload_too_large"
    assert f"at most {MAX_BODY_BYTES} bytes" in result.json["message"]
    assert env.get("/api/jobs?actor=tests.too_big").json["count"] == 0
    fits = json.dumps({"actor_name": "tests.big", "args": ["x" * (MAX_BODY_BYTES - 100)]})
    result = env.post("/api/jobs", body=fits, headers={"Content-Type": "application/json"})
    assert result.status_code == 201, result.text[:200]


def test_create_asks_for_a_content_length_instead_of_a_chunked_body(env):
    headers = {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    result = env.post("/api/jobs", headers=headers)
    assert result.status_code == 411, result.text
    assert "Content-Length" in result.json["message"]


def test_create_refuses_other_content_types(env):
    result = env.post("/api/jobs", body="actor_name=a", headers={"Content-Type": "text/plain"})
    assert result.status_code == 415
    assert "must be JSON" in result.json["message"]


# -- detail, timeline ------------------------------------------------------------------


def test_detail_and_timeline(env):
    job_id = env.failed(actor="tests.detail")
    job = env.get(f"/api/jobs/{job_id}").json
    assert job["id"] == job_id
    assert job["status"] == "failed"
    assert job["last_error"] == "boom"
    assert job["attempts"] == 1
    assert job["finished_at"] is not None
    assert job["owner"] is None  # not created through the API
    timeline = env.get(f"/api/jobs/{job_id}/events").json
    assert timeline["job_id"] == job_id
    assert [e["type"] for e in timeline["results"]] == ["created", "claimed", "failed"]
    assert [e["attempt"] for e in timeline["results"]] == [0, 1, 1]
    assert timeline["results"][2]["data"] == {"error": "boom"}
    ids = [e["id"] for e in timeline["results"]]
    assert ids == sorted(ids)


def test_detail_accepts_any_uuid_spelling(env):
    job_id = env.enqueue()
    assert env.get(f"/api/jobs/{job_id.upper()}").json["id"] == job_id
    assert env.get(f"/api/jobs/{job_id.replace('-', '')}").json["id"] == job_id


def test_binary_messages_are_opaque(env):
    job_id = str(uuid.uuid4())
    env.store.enqueue(
        NewJob(
            id=job_id,
            queue_name="pickled",
            actor_name="a",
            message_bytes=b"\x80\x04pickle",
            max_attempts=21,
        )
    )
    job = env.get(f"/api/jobs/{job_id}").json
    assert job["message"] is None and job["message_encoding"] == "binary"


def test_a_message_jsonb_cannot_hold_is_shown_with_a_safe_view(env, pg_url, schema):
    """The broker stores the encoder's bytes; the API shows the display view of a message
    jsonb cannot hold as it is (NaN, Infinity, NUL), never a 500."""
    import dramatiq

    from dramatiq_pg_broker import PostgresBroker

    broker = PostgresBroker(url=pg_url, schema=schema)
    try:
        actor = dramatiq.actor(lambda *a: None, actor_name="tests.odd", broker=broker)
        message = actor.send(float("nan"), float("inf"), "a\u0000b", 1e20)
    finally:
        broker.close()
    job = env.get(f"/api/jobs/{message.message_id}").json
    assert job["message_encoding"] == "json"
    assert job["message"]["args"] == ["NaN", "Infinity", "a\ufffdb", 1e20]
    listed = env.get("/api/jobs?actor=tests.odd").json["results"]
    assert [j["id"] for j in listed] == [message.message_id]


@pytest.mark.parametrize("suffix", ["", "/events", "/retry", "/cancel"])
def test_unknown_and_malformed_ids(env, suffix):
    method = "POST" if suffix in ("/retry", "/cancel") else "GET"
    missing = env.request(method, f"/api/jobs/{uuid.uuid4()}{suffix}")
    assert missing.status_code == 404, missing.text
    assert missing.json["error"] == "not_found"
    assert "check the job id" in missing.json["message"]
    malformed = env.request(method, f"/api/jobs/not-a-uuid{suffix}")
    assert malformed.status_code == 400
    assert "job id must be a UUID" in malformed.json["message"]


# -- retry, cancel ---------------------------------------------------------------------


def test_retry_moves_a_failed_job_back_to_the_queue(env):
    job_id = env.failed()
    result = env.post(f"/api/jobs/{job_id}/retry", "operator")
    assert result.status_code == 200, result.text
    assert result.json["status"] == "queued"
    assert result.json["attempts"] == 0
    assert result.json["finished_at"] is None
    events = env.get(f"/api/jobs/{job_id}/events").json["results"]
    assert events[-1]["type"] == "manual_retry"
    assert events[-1]["actor"] == "operator@example.com"
    # The job runs again: a worker can claim it.
    env.claim(job_id)


@pytest.mark.parametrize("state", ["enqueue", "running", "succeeded"])
def test_retry_of_a_job_that_is_not_failed_is_409(env, state):
    job_id = getattr(env, state)()
    result = env.post(f"/api/jobs/{job_id}/retry")
    assert result.status_code == 409
    assert result.json["error"] == "conflict"
    assert "only failed jobs can be retried" in result.json["message"]


def test_cancel_a_queued_job(env):
    job_id = env.enqueue()
    result = env.post(f"/api/jobs/{job_id}/cancel", "admin")
    assert result.status_code == 200
    assert result.json["status"] == "cancelled"
    assert result.json["finished_at"] is not None
    events = env.get(f"/api/jobs/{job_id}/events").json["results"]
    assert [e["type"] for e in events] == ["created", "cancelled"]
    again = env.post(f"/api/jobs/{job_id}/cancel")
    assert again.status_code == 409


@pytest.mark.parametrize("state", ["running", "succeeded", "failed"])
def test_cancel_of_a_job_that_is_not_queued_is_409(env, state):
    job_id = getattr(env, state)()
    result = env.post(f"/api/jobs/{job_id}/cancel")
    assert result.status_code == 409
    assert "only queued jobs can be cancelled" in result.json["message"]
    assert env.get(f"/api/jobs/{job_id}").json["status"] == state


# -- members ---------------------------------------------------------------------------


def test_members_see_only_their_own_jobs(env):
    other = env.accounts.create_user(f"{unique('m')}@example.com", "member password", "member")
    other_token = env.accounts.create_token(other.id, "t").secret
    other_headers = {"Authorization": f"Bearer {other_token}"}
    actor = unique("tests.member.")
    mine = env.create_job("member", actor_name=actor)
    theirs = env.client.simulate_post(
        "/api/jobs", json={"actor_name": actor}, headers=other_headers
    ).json
    operators = env.create_job("operator", actor_name=actor)

    listed = env.get(f"/api/jobs?actor={actor}", "member").json
    assert [job["id"] for job in listed["results"]] == [mine["id"]]
    assert listed["count"] == 1
    everyone = env.get(f"/api/jobs?actor={actor}", "viewer").json
    assert everyone["count"] == 3
    assert env.get(f"/api/jobs/{mine['id']}", "member").status_code == 200
    for job in (theirs, operators):
        assert env.get(f"/api/jobs/{job['id']}", "member").status_code == 404
        assert env.get(f"/api/jobs/{job['id']}/events", "member").status_code == 404
    feed = env.get(f"/api/job-events?job_id={theirs['id']}", "member").json
    assert feed["results"] == []
    mine_feed = env.get(f"/api/job-events?job_id={mine['id']}", "member").json
    assert [e["type"] for e in mine_feed["results"]] == ["created"]
    assert env.post(f"/api/jobs/{mine['id']}/cancel", "member").status_code == 403
    assert env.get("/api/jobs/stats", "member").status_code == 403


def test_member_keys_live_in_the_members_namespace(env):
    """A member can neither probe an application key (no 409 tells it exists) nor squat on
    one: the application's later send with that key creates its own job."""
    taken = unique("key-")
    env.create_job("operator", actor_name="tests.x", idempotency_key=taken)
    probe = env.post(
        "/api/jobs", "member", json={"actor_name": "tests.x", "idempotency_key": taken}
    )
    assert probe.status_code == 201, probe.text
    assert probe.json["owner"] == "member@example.com"
    assert probe.json["idempotency_key"] == taken

    squatted = unique("key-")
    first = env.post(
        "/api/jobs", "member", json={"actor_name": "tests.x", "idempotency_key": squatted}
    )
    assert first.status_code == 201
    # The member's own second send returns its first job.
    again = env.post(
        "/api/jobs", "member", json={"actor_name": "tests.x", "idempotency_key": squatted}
    )
    assert again.status_code == 200 and again.json["id"] == first.json["id"]
    # The application's send with the same key is not the member's job.
    app_job = env.create_job("operator", actor_name="tests.x", idempotency_key=squatted)
    assert app_job["id"] != first.json["id"] and app_job["owner"] == "operator@example.com"
    assert app_job["idempotency_key"] == squatted
