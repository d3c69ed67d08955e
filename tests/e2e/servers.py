"""Child processes of the end-to-end tests (gunicorn, dramatiq, the package's CLI), each in
its own process group with its output in a log file, and a raw HTTP client for them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from .workers import REPO

#: A health check that closes its connection.
HEALTH_REQUEST = b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def free_port() -> int:
    """A TCP port nothing listens on (at the time of asking)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``python <args>`` from the repository's root, in a new session, output in ``log``."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL if it is still there 20 s later."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def start_gunicorn(
    pg_url: str, schema: str, port: int, log: Path, **settings: str
) -> subprocess.Popen:
    """The admin API under gunicorn with its own configuration, bound to ``port``;
    ``settings`` are more ``ADMIN_API_*`` environment variables."""
    env = {
        **os.environ,
        "DRAMATIQ_PG_URL": pg_url,
        "DRAMATIQ_PG_SCHEMA": schema,
        "ADMIN_API_BIND": f"127.0.0.1:{port}",
        **settings,
    }
    return start(
        ["-m", "gunicorn", "-c", "python:admin_api.gunicorn_conf", "admin_api.wsgi:app"], env, log
    )


def raw_request(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """Send ``data`` on a new connection; return the status, headers and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            raw = b"".join(chunks)
            head, sep, body = raw.partition(b"\r\n\r\n")
            if sep:
                headers = dict(
                    line.decode("latin-1").split(": ", 1) for line in head.split(b"\r\n")[1:]
                )
                headers = {k.lower(): v for k, v in headers.items()}
                if len(body) >= int(headers.get("content-length", "0")):
                    break
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {
        k.lower(): v for k, v in (line.decode("latin-1").split(": ", 1) for line in lines[1:])
    }
    return status, headers, body
