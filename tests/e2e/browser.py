"""A real admin API under gunicorn, real dramatiq workers and a headless Chromium, for the
dashboard's browser tests.

The browser is Debian's ``chromium`` driven through the system ``chromedriver``
(``apt-get install chromium chromium-driver``): Selenium is given both paths, so it never
looks for (or downloads) a driver of its own. Without them the tests are skipped, unless
``DRAMATIQ_PG_REQUIRE_BROWSER`` is set (CI sets it), when they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ..helpers import wait_for
from .servers import free_port
from .workers import REPO

CHROMIUM = os.environ.get("DRAMATIQ_PG_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("DRAMATIQ_PG_CHROMEDRIVER", "/usr/bin/chromedriver")


def require_browser() -> None:
    """Skip (or, when CI requires the browser tests, fail) without Chromium and its driver."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if missing:
        message = (
            f"browser tests need {', '.join(missing)}: apt-get install chromium chromium-driver"
            " and pip install -e '.[dev]'"
        )
        if os.environ.get("DRAMATIQ_PG_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)


def new_driver(temp: Path, width: int = 1366, height: int = 900):
    """A headless Chromium on the system driver.

    ``temp`` becomes the driver's and the browser's temporary folder (their profile, and
    the singleton socket folder Chromium leaves behind when it is stopped), so nothing of
    theirs lands in the system's temporary folder.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    # Belt and braces: Selenium Manager (which could download a driver) stays offline.
    os.environ.setdefault("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI containers run as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        f"--window-size={width},{height}",
        "--force-device-scale-factor=1",
        "--lang=en-GB",
    ):
        options.add_argument(argument)
    temp.mkdir(parents=True, exist_ok=True)
    service = Service(executable_path=CHROMEDRIVER, env={**os.environ, "TMPDIR": str(temp)})
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(60)
    return driver


class Process:
    """A child process in its own process group, its output in a log file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tail(self, chars: int = 3000) -> str:
        if not self._out.closed:
            self._out.flush()
        return f"--- {self.log.name}\n{self.log.read_text(errors='replace')[-chars:]}"

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crashed host would: no shutdown runs, the
        jobs it holds keep their rows (running, with a lease nobody renews)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._out.close()


class Stack:
    """gunicorn serving the admin API on a free port, and dramatiq workers on demand, all
    on one schema. ``stop()`` ends every process it started."""

    def __init__(self, pg_url: str, schema: str, logs: Path) -> None:
        self.logs = logs
        self.env = {
            **os.environ,
            "DRAMATIQ_PG_URL": pg_url,
            "DRAMATIQ_PG_SCHEMA": schema,
            "ADMIN_API_WORKERS": "1",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
        }
        self.processes: list[Process] = []
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"

    def start_api(self) -> None:
        self.processes.append(
            Process(
                [
                    "-m",
                    "gunicorn",
                    "-c",
                    "python:admin_api.gunicorn_conf",
                    "--bind",
                    f"127.0.0.1:{self.port}",
                    "admin_api.wsgi:app",
                ],
                self.env,
                self.logs / "gunicorn.log",
            )  # fmt: skip
        )
        self.wait_for("the API answering /api/health", lambda: self.get("/api/health")[0] == 200)

    def start_worker(
        self,
        module: str = "tests.e2e.dashboard_actors",
        *,
        queues: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> Process:
        """A ``dramatiq`` worker (one process, two threads) of ``module``, consuming only
        ``queues`` when given, with ``env`` added to the stack's environment."""
        args = ["-m", "dramatiq", module, "--processes", "1", "--threads", "2"]
        if queues:
            args += ["--queues", *queues]
        worker = Process(
            args,
            {**self.env, **(env or {})},
            self.logs / f"worker{len(self.processes)}.log",
        )
        self.processes.append(worker)
        return worker

    def workers(self) -> list[Process]:
        """The worker processes still running."""
        return [
            p for p in self.processes if p.log.name.startswith("worker") and p.proc.poll() is None
        ]

    def stop_workers(self) -> None:
        for process in self.workers():
            process.stop()

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()

    def tails(self) -> str:
        return "\n".join(process.tail() for process in self.processes)

    def request(self, method: str, path: str, token: str | None = None, body=None):
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(
            self.base + path, data=data, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get(self, path: str, token: str | None = None):
        return self.request("GET", path, token)

    def api(self, method: str, path: str, token: str, body=None):
        status, raw = self.request(method, path, token, body)
        assert status < 300, f"{method} {path}: {status} {raw[:500]!r}"
        return json.loads(raw) if raw else None

    def wait_for(self, what: str, check, timeout: float = 60):
        """Wait for ``check`` over HTTP (a refused connection is "not yet"); on failure,
        show the processes' logs."""
        return wait_for(
            check, timeout, what, on_timeout=self.tails, interval=0.2, ignore=(OSError,)
        )


@contextmanager
def api_stack(pg_url: str, schema: str, directory: Path) -> Iterator[Stack]:
    """The admin API under gunicorn for a module's browser tests (skipped, or failed when
    the browser is required, without Chromium), stopped at the end."""
    require_browser()
    stack = Stack(pg_url, schema, directory)
    try:
        stack.start_api()
        yield stack
    finally:
        stack.stop()


@contextmanager
def chromium():
    """A headless Chromium for one test. It gets a short directory of its own (Chromium
    puts a Unix socket in it, whose path has a length limit a deep tmp_path would break),
    removed once the browser has quit."""
    with tempfile.TemporaryDirectory(prefix="dpb-chromium-") as temp:
        driver = new_driver(Path(temp))
        try:
            yield driver
        finally:
            driver.quit()
