"""End to end: gunicorn serves the admin API, a dramatiq worker runs the jobs, and the
test sees a job it created through the API succeed, and a failed one retried, through the
API only."""

from __future__ import annotations

import http.cookiejar
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .. import helpers
from .servers import free_port, start, stop
from .workers import REPO

PASSWORD = "e2e admin password"
#: The worker: the dashboard tests' actors (``dash.add``, ``dash.flaky`` ...) serve here too.
WORKER = ["-m", "dramatiq", "tests.e2e.dashboard_actors", "--processes", "1", "--threads", "2"]


class Api:
    """A tiny HTTP client: a session cookie after login, JSON in and out."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )

    def call(self, method: str, path: str, body=None, headers=None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.base + path,
            data=data,
            method=method,
            headers={
                "Content-Type": "application/json",
                "X-Requested-With": "e2e",
                **(headers or {}),
            },
        )
        try:
            with self.opener.open(request, timeout=10) as response:
                text = response.read()
                return response.status, json.loads(text) if text else None
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")


def wait_for(what: str, check, timeout: float, logs: list[Path]):
    """Wait for ``check`` over HTTP (a refused connection is "not yet"); on failure, show
    the processes' logs."""

    def tails() -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)

    return helpers.wait_for(check, timeout, what, on_timeout=tails, interval=0.2, ignore=(OSError,))


@pytest.mark.slow
def test_a_job_created_through_the_api_runs_and_a_failed_one_is_retried(pg_url, schema, tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "DRAMATIQ_PG_URL": pg_url,
        "DRAMATIQ_PG_SCHEMA": schema,
        "ADMIN_API_WORKERS": "1",
        "PYTHONPATH": str(REPO),
    }
    logs_dir = tmp_path
    created = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_broker", "user", "create", "--email",
         "e2e@example.com", "--role", "operator", "--password-stdin"],
        input=PASSWORD + "\n", env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    token = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_broker", "token", "create", "--email",
         "e2e@example.com", "--name", "e2e"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert token.returncode == 0, token.stderr
    bearer = {"Authorization": f"Bearer {token.stdout.strip()}"}

    api_log, worker_log = logs_dir / "gunicorn.log", logs_dir / "worker.log"
    logs = [api_log, worker_log]
    processes = []
    try:
        processes.append(
            start(
                [
                    "-m",
                    "gunicorn",
                    "-c",
                    "python:admin_api.gunicorn_conf",
                    "--bind",
                    f"127.0.0.1:{port}",
                    "admin_api.wsgi:app",
                ],
                env,
                api_log,
            )  # fmt: skip
        )
        processes.append(start(WORKER, env, worker_log))
        api = Api(f"http://127.0.0.1:{port}")
        wait_for(
            "the API answering /api/health",
            lambda: api.call("GET", "/api/health")[0] == 200,
            30,
            logs,
        )

        status, body = api.call(
            "POST", "/api/auth/login", {"email": "e2e@example.com", "password": PASSWORD}
        )
        assert status == 200, body

        def declared():
            # The API creates jobs only for actors a worker declared when it booted.
            status, actors = api.call("GET", "/api/actors", headers=bearer)
            assert status == 200, actors
            names = {a["actor_name"] for a in actors["results"]}
            return {"dash.add", "dash.flaky"} <= names

        wait_for("the worker declaring its actors", declared, 60, logs)
        status, job = api.call(
            "POST",
            "/api/jobs",
            {"actor_name": "dash.add", "queue_name": "dash", "args": [2, 3]},
        )
        assert status == 201, job

        def finished(job_id):
            def check():
                status, current = api.call("GET", f"/api/jobs/{job_id}", headers=bearer)
                assert status == 200, current
                return current if current["status"] in ("succeeded", "failed") else None

            return check

        done = wait_for("the job succeeding", finished(job["id"]), 60, logs)
        assert done["status"] == "succeeded", done
        status, timeline = api.call("GET", f"/api/jobs/{job['id']}/events", headers=bearer)
        assert [e["type"] for e in timeline["results"]] == ["created", "claimed", "succeeded"]

        # dash.flaky fails while its flag file is missing: this one is never created.
        missing = str(tmp_path / "never-created")
        status, doomed = api.call(
            "POST",
            "/api/jobs",
            {"actor_name": "dash.flaky", "queue_name": "dash", "args": [missing]},
        )
        assert status == 201, doomed
        failed = wait_for("the failing job failing", finished(doomed["id"]), 60, logs)
        assert failed["status"] == "failed", failed
        assert f"{missing} does not exist yet" in failed["last_error"], failed
        status, retried = api.call("POST", f"/api/jobs/{doomed['id']}/retry")
        assert status == 200 and retried["attempts"] == 0, retried

        def failed_again():
            status, timeline = api.call("GET", f"/api/jobs/{doomed['id']}/events", headers=bearer)
            types = [e["type"] for e in timeline["results"]]
            return types if types.count("failed") == 2 else None

        types = wait_for("the retried job running again", failed_again, 60, logs)
        assert "manual_retry" in types
        status, stats = api.call("GET", "/api/jobs/stats", headers=bearer)
        assert stats["by_status"]["succeeded"] == 1 and stats["by_status"]["failed"] == 1, stats
        status, body = api.call("POST", "/api/auth/logout")
        assert status == 204
        assert api.call("GET", "/api/jobs")[0] == 401
    finally:
        for process in processes:
            stop(process)
    assert "Traceback" not in api_log.read_text(), api_log.read_text()[-3000:]
