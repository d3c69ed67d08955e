"""What an operator tripped on (issue 34): action endpoints that ignored their bodies, HEAD
refused on the pages and /metrics, job ids in other scripts' digits, names with hidden
whitespace, a job page that fetched the whole job every two seconds, and a "Delayed" count
no list could show."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from admin_api.operations import MAX_BODY_BYTES

from .admin_support import CSRF, AdminEnv


@pytest.fixture(scope="module")
def env(pg_url, schema):
    env = AdminEnv(pg_url, schema)
    yield env
    env.close()


def post(env: AdminEnv, path: str, role: str = "operator", **kwargs):
    return env.post(path, role, headers={**CSRF, **kwargs.pop("headers", {})}, **kwargs)


# -- the action endpoints read their bodies like every other endpoint ------------------------


def action_paths(env: AdminEnv) -> list[tuple[str, str]]:
    """(path, what a 200 needs) of each action, on a fresh job or queue."""
    queue = f"act_{uuid.uuid4().hex[:8]}"
    env.declare(queues=[queue])
    return [
        (f"/api/jobs/{env.failed()}/retry", "failed job"),
        (f"/api/jobs/{env.enqueue()}/cancel", "queued job"),
        (f"/api/jobs/{env.enqueue()}/abort", "queued job"),
        (f"/api/queues/{queue}/pause", "declared queue"),
        (f"/api/queues/{queue}/resume", "declared queue"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "status", "words"),
    [
        ({"json": {"force": True}}, 400, "unknown field(s) 'force'; it takes no fields"),
        ({"json": [1]}, 400, "must be a JSON object"),
        ({"body": "{not json", "headers": {"Content-Type": "application/json"}}, 400, "not valid"),
        ({"body": "please", "headers": {"Content-Type": "text/plain"}}, 415, "must be JSON"),
        (
            {"body": "x" * (MAX_BODY_BYTES + 1), "headers": {"Content-Type": "application/json"}},
            413,
            f"at most {MAX_BODY_BYTES} bytes",
        ),
    ],
    ids=["unknown-field", "not-an-object", "malformed", "text-plain", "too-large"],
)
def test_an_action_refuses_a_bad_body_with_a_sentence(env, kwargs, status, words):
    for path, _ in action_paths(env):
        result = post(env, path, **kwargs)
        assert result.status_code == status, f"{path}: {result.status_code} {result.text}"
        assert words in result.json["message"], f"{path}: {result.json}"
        assert result.json["message"].endswith("."), result.json


def test_a_refused_action_body_changes_nothing(env):
    job_id = env.enqueue()
    assert post(env, f"/api/jobs/{job_id}/cancel", json={"reason": "x"}).status_code == 400
    assert env.get(f"/api/jobs/{job_id}").json["status"] == "queued"


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json": {}}, {"body": "", "headers": {"Content-Type": "text/plain"}}],
    ids=["no-body", "empty-object", "empty-text"],
)
def test_an_action_with_no_body_or_an_empty_object_still_works(env, kwargs):
    for path, what in action_paths(env):
        result = post(env, path, **kwargs)
        assert result.status_code == 200, f"{path} ({what}): {result.text}"


# -- HEAD is GET without the body ------------------------------------------------------------


def test_head_is_answered_like_get_on_every_get_route(env):
    job_id = env.enqueue()
    paths = {
        "/": None,
        "/dashboard": None,
        "/dashboard/jobs": None,
        f"/dashboard/jobs/{job_id}": None,
        "/dashboard/static/dashboard.js": None,
        "/metrics": "viewer",
        "/api/jobs": "viewer",
        f"/api/jobs/{job_id}": "viewer",
        "/api/queues": "viewer",
        "/api/docs": None,
        "/api/health": None,
    }
    for path, role in paths.items():
        get = env.get(path, role)
        head = env.request("HEAD", path, role)
        assert head.status_code == get.status_code, f"HEAD {path}: {head.status_code}"
        assert get.status_code in (200, 302), f"GET {path}: {get.status_code}"
        assert head.content == b"", f"HEAD {path} has a body"
        assert head.headers.get("content-type") == get.headers.get("content-type"), path
    # HEAD needs the same credentials as GET.
    assert env.request("HEAD", "/metrics", None).status_code == 401
    assert env.request("HEAD", "/metrics", "member").status_code == 403


# -- job ids in ASCII hex only; names as sent, or refused -----------------------------------


def test_a_job_id_with_another_scripts_digit_is_refused_not_found_as_the_ascii_one(env):
    job_id = env.enqueue()
    digit = next(i for i, c in enumerate(job_id) if c.isdigit())
    # ARABIC-INDIC DIGIT for the same value: int() reads it as the ASCII digit.
    other = job_id[:digit] + chr(0x0660 + int(job_id[digit])) + job_id[digit + 1 :]
    for path in (f"/api/jobs/{other}", f"/api/jobs/{other}/events"):
        result = env.get(path)
        assert result.status_code == 400, f"{path}: {result.status_code} {result.text}"
        assert "must be a UUID" in result.json["message"]
    assert post(env, f"/api/jobs/{other}/cancel").status_code == 400
    assert env.get("/api/job-events", params={"job_id": other}).status_code == 400
    for spelling in (job_id.replace("-", "_"), "+" + job_id.replace("-", "")[1:], f" {job_id}"):
        assert env.get(f"/api/jobs/{spelling}").status_code == 400, spelling
    # The ASCII spellings uuid.UUID() takes are still the job.
    for spelling in (job_id.upper(), job_id.replace("-", ""), f"{{{job_id}}}"):
        assert env.get(f"/api/jobs/{spelling}").json["id"] == job_id, spelling


@pytest.mark.parametrize(
    "name",
    ["tests.noop ", " tests.noop", "tests.noop\t", "tests\tnoop", "tests.noop\u2028", "a\u2029b"],
    ids=["trailing-space", "leading-space", "trailing-tab", "inner-tab", "u2028", "u2029"],
)
def test_an_actor_name_with_hidden_whitespace_is_refused_not_stripped(env, name):
    result = post(env, "/api/jobs", json={"actor_name": name})
    assert result.status_code == 400, result.text
    assert "actor_name must not" in result.json["message"]
    assert env.get("/api/jobs", params={"actor": name}).status_code == 400


@pytest.mark.parametrize("name", ["default ", "default\n", "\tdefault", "default\u2028"])
def test_a_queue_name_with_hidden_whitespace_is_refused_not_stripped(env, name):
    result = post(env, "/api/jobs", json={"actor_name": "tests.noop", "queue_name": name})
    assert result.status_code == 400, result.text
    assert "queue_name must not" in result.json["message"]
    result = env.get("/api/jobs", params={"queue": name})
    assert result.status_code == 400 and "queue must not" in result.json["message"]


def test_pausing_a_queue_name_with_a_final_line_break_is_a_400(env):
    queue = f"nl_{uuid.uuid4().hex[:6]}"
    env.declare(queues=[queue])
    for spelling in (f"{queue}%0A", f"{queue}%20", f"%09{queue}", f"{queue}%E2%80%A8"):
        result = post(env, f"/api/queues/{spelling}/pause")
        assert result.status_code == 400, f"{spelling}: {result.status_code} {result.text}"
    listed = {q["queue_name"]: q for q in env.get("/api/queues", "viewer").json["results"]}
    assert not listed[queue]["paused"]


def test_the_metrics_only_app_answers_head(env):
    from falcon import testing

    from admin_api.resources.metrics import create_metrics_app

    client = testing.TestClient(create_metrics_app(env.settings, engine=env.engine))
    head = client.simulate_head("/metrics")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"].startswith("text/plain")


def test_a_plain_name_is_still_accepted(env):
    job = env.create_job(actor_name="tests.plain_name", queue_name="plain_q")
    assert (job["actor_name"], job["queue_name"]) == ("tests.plain_name", "plain_q")


# -- a polled job costs a few hundred bytes while it does not change -------------------------


def test_an_unchanged_job_and_timeline_answer_304_without_a_body(env):
    job_id = env.enqueue()
    for path in (f"/api/jobs/{job_id}", f"/api/jobs/{job_id}/events"):
        first = env.get(path, "viewer")
        tag = first.headers["etag"]
        assert first.status_code == 200 and tag.endswith('"'), first.headers
        again = env.get(path, "viewer", headers={"If-None-Match": tag})
        assert again.status_code == 304 and again.content == b"", path
        assert again.headers["etag"] == tag
        # Weak comparison, a list, and "*" match; another tag does not.
        strong = tag.removeprefix("W/")
        for header in (f"W/{strong}", strong, f'"other", {tag}', "*"):
            assert env.get(path, "viewer", headers={"If-None-Match": header}).status_code == 304
        other = env.get(path, "viewer", headers={"If-None-Match": '"other"'})
        assert other.status_code == 200 and other.json == first.json
    # A change (here: cancelled, with its event) is a new tag and the whole answer.
    tags = {
        p: env.get(p).headers["etag"] for p in (f"/api/jobs/{job_id}", f"/api/jobs/{job_id}/events")
    }
    assert post(env, f"/api/jobs/{job_id}/cancel").status_code == 200
    for path, tag in tags.items():
        changed = env.get(path, headers={"If-None-Match": tag})
        assert changed.status_code == 200 and changed.headers["etag"] != tag, path
    assert changed.json["results"][-1]["type"] == "cancelled"


def test_a_lease_renewal_alone_leaves_a_running_job_unchanged_for_its_poll(env):
    """The heartbeat moves a running job's ``locked_until`` every few seconds: the job page's
    poll still answers 304 after a renewal, and a real change (its outcome) answers 200."""
    job_id = env.enqueue()
    attempt = env.claim(job_id, lease_seconds=60)
    paths = (f"/api/jobs/{job_id}", f"/api/jobs/{job_id}/events")
    first = {path: env.get(path, "viewer") for path in paths}
    assert first[paths[0]].json["status"] == "running"
    # The heartbeat's renewal: silent (no event), the lease an hour further.
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    assert env.store.renew([attempt], 60, now=later) == {job_id}
    for path in paths:
        polled = env.get(path, "viewer", headers={"If-None-Match": first[path].headers["etag"]})
        assert polled.status_code == 304 and polled.content == b"", path
    # Asked without the tag, the job has its new lease (the tag left only the lease out).
    whole = env.get(paths[0], "viewer")
    assert whole.json["locked_until"] != first[paths[0]].json["locked_until"]
    assert whole.headers["etag"] == first[paths[0]].headers["etag"]
    # Its outcome is a change: a new tag and the whole answer, for the job and its timeline.
    assert env.store.complete([attempt]) == {job_id}
    for path in paths:
        polled = env.get(path, "viewer", headers={"If-None-Match": first[path].headers["etag"]})
        assert polled.status_code == 200 and polled.headers["etag"] != first[path].headers["etag"]
    assert polled.json["results"][-1]["type"] == "succeeded"
    assert env.get(paths[0], "viewer").json["status"] == "succeeded"


def test_polling_a_job_with_a_megabyte_of_arguments_moves_kilobytes_not_megabytes(env):
    """The dashboard's poll of an unfinished job, ten times (20 s of a page left open),
    counted in bytes of the answers."""
    job = env.create_job(args=["x" * (1024 * 1024 - 100)], delay=3_600_000)
    path = f"/api/jobs/{job['id']}"
    first = env.get(path, "viewer")
    assert len(first.content) > 1024 * 1024
    tags = {path: first.headers["etag"]}
    tags[path + "/events"] = env.get(path + "/events", "viewer").headers["etag"]
    moved = 0
    for _ in range(10):
        for where, tag in tags.items():
            result = env.get(where, "viewer", headers={"If-None-Match": tag})
            assert result.status_code == 304
            moved += len(result.content) + sum(
                len(k) + len(v) + 4 for k, v in result.headers.items()
            )
    assert moved < 10_000, f"{moved} bytes in 10 polls"


# -- the overview's counts match a list ------------------------------------------------------


def test_the_delayed_filter_lists_what_the_overview_counts_as_delayed(env):
    queue = f"later_{uuid.uuid4().hex[:6]}"
    delayed = {env.create_job(queue_name=queue, delay=3_600_000)["id"] for _ in range(3)}
    runnable = env.create_job(queue_name=queue)["id"]
    # One more, created by a member: its own list filters the same way.
    mine = env.create_job("member", queue_name=queue, delay=3_600_000)["id"]
    delayed.add(mine)
    counts = {q["queue_name"]: q for q in env.get("/api/queues", "viewer").json["results"]}
    assert (counts[queue]["delayed"], counts[queue]["queued"]) == (4, 1)
    listed = env.get("/api/jobs", "viewer", params={"status": "delayed", "queue": queue}).json
    assert listed["count"] == 4 and {j["id"] for j in listed["results"]} == delayed
    everything = env.get("/api/jobs", "viewer", params={"status": "queued", "queue": queue}).json
    assert {j["id"] for j in everything["results"]} == delayed | {runnable}
    own = env.get("/api/jobs", "member", params={"status": "delayed", "queue": queue}).json
    assert [j["id"] for j in own["results"]] == [mine] and own["count"] == 1
    bad = env.get("/api/jobs", "viewer", params={"status": "later"})
    assert bad.status_code == 400 and "delayed" in bad.json["message"]


def test_the_queue_list_says_how_many_live_workers_consume_each_queue(env, schema):
    from psycopg import sql

    busy, idle = (f"{word}_{uuid.uuid4().hex[:6]}" for word in ("busy", "idle"))
    env.declare(queues=[busy, idle])
    with env.pool.connection() as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.workers (id, host, pid, queues, actors, version, expires_at,"
                " in_flight) VALUES (%(a)s, 'h1', 42, %(q)s, '{{}}', '0',"
                " now() + interval '1 minute', 0),"
                " (%(b)s, 'h2', 43, %(q)s, '{{}}', '0', now() + interval '1 minute', 0),"
                " (%(c)s, 'h3', 44, %(old)s, '{{}}', '0', now() - interval '1 second', 0)"
            ).format(sql.Identifier(schema)),
            {
                "a": f"h1:{busy}",
                "b": f"h2:{busy}",
                "c": f"h3:{idle}",
                "q": [busy],
                "old": [idle],
            },
        )
    listed = {q["queue_name"]: q for q in env.get("/api/queues", "viewer").json["results"]}
    assert listed[busy]["live_workers"] == 2
    assert listed[idle]["live_workers"] == 0 and listed[idle]["declared"]
