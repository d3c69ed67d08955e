"""The shipped gunicorn configuration: slow and idle clients do not stop the API from
answering, and the errors gunicorn answers itself (414, 431) are JSON."""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import time

import gunicorn.config
import pytest

from .servers import HEALTH_REQUEST, free_port, raw_request, start_gunicorn, stop
from .workers import wait_for

pytestmark = pytest.mark.slow

#: Clients that connect and send nothing, and clients that send half a request head.
IDLE_CLIENTS = 25
HALF_HEADER_CLIENTS = 25


def health(port: int) -> tuple[int, float]:
    started = time.perf_counter()
    status, _, _ = raw_request(port, HEALTH_REQUEST)
    return status, time.perf_counter() - started


@pytest.fixture
def api(pg_url, schema, tmp_path):
    port = free_port()
    log = tmp_path / "gunicorn.log"
    process = start_gunicorn(pg_url, schema, port, log, ADMIN_API_LOG_LEVEL="warning")
    try:

        def up():
            with contextlib.suppress(OSError, ValueError, IndexError):
                return health(port)[0] == 200
            return False

        wait_for(up, 60, "gunicorn to answer /api/health", on_timeout=lambda: log.read_text())
        yield port
    finally:
        stop(process)


def test_slow_and_idle_clients_do_not_stop_health(api):
    port = api
    held = []
    try:
        for n in range(IDLE_CLIENTS + HALF_HEADER_CLIENTS):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            if n % 2:
                sock.sendall(b"GET /api/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            held.append(sock)
        time.sleep(0.5)  # let the workers take every one of them
        timings = []
        for _ in range(20):
            status, seconds = health(port)
            assert status == 200
            timings.append(seconds)
        median = statistics.median(timings)
        assert median <= 0.1, f"/api/health median {median * 1000:.0f} ms with slow clients"
        assert max(timings) < 5, timings
    finally:
        for sock in held:
            sock.close()


def test_errors_gunicorn_answers_itself_are_json(api):
    port = api
    long_line = b"GET /api/jobs?actor=" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    status, headers, body = raw_request(port, long_line)
    assert status == 414
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"] == "uri_too_long"

    many = b"".join(b"X-H%d: v\r\n" % n for n in range(150))
    status, headers, body = raw_request(
        port, b"GET /api/jobs HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"
    )
    assert status == 431
    assert headers["content-type"] == "application/json"
    error = json.loads(body)
    assert error["error"] == "request_header_fields_too_large" and error["message"]

    status, headers, body = raw_request(port, b"NOT HTTP\r\n\r\n")
    assert status == 400 and json.loads(body)["error"] == "bad_request"
    assert headers["x-content-type-options"] == "nosniff"


@pytest.mark.skipif(
    "control_socket_disable" not in gunicorn.config.Config().settings,
    reason="this gunicorn has no control socket (before 25.1)",
)
def test_the_shipped_configuration_opens_no_control_socket_unless_given_a_path(
    pg_url, schema, tmp_path
):
    """gunicorn's control socket would be at $HOME/.gunicorn/gunicorn.ctl (or in
    $XDG_RUNTIME_DIR), one path for every gunicorn of the user: the shipped configuration
    opens none, or one at the path ADMIN_API_CONTROL_SOCKET gives. gunicorn logs which, at
    debug level, once its workers are up."""
    home = tmp_path / "home"
    home.mkdir()
    own = tmp_path / "api.ctl"
    for settings, expected in (
        ({}, "Control socket disabled"),
        ({"ADMIN_API_CONTROL_SOCKET": str(own)}, f"Control socket listening at {own}"),
    ):
        port = free_port()
        log = tmp_path / f"gunicorn-{port}.log"
        process = start_gunicorn(
            pg_url,
            schema,
            port,
            log,
            HOME=str(home),
            XDG_RUNTIME_DIR="",
            ADMIN_API_LOG_LEVEL="debug",
            **settings,
        )
        try:
            wait_for(
                lambda log=log: "Control socket" in log.read_text(),
                60,
                "gunicorn to say whether it opened a control socket",
                on_timeout=lambda log=log: log.read_text(),
            )
            assert expected in log.read_text()
            assert own.is_socket() == bool(settings)
        finally:
            stop(process)
        assert list(home.iterdir()) == [], settings
