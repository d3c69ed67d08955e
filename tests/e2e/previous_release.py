"""The previous release of this package, built from its commit in this repository's history
and installed into a virtual environment of its own, for the upgrade tests.

The wheel is built with ``git archive`` of the commit and ``pip wheel --no-deps``; its
dependencies install from the package index as any user's would (pip's cache and the
configured index make that take a few seconds). When a new release is made, the release
before it becomes :data:`PREVIOUS_COMMIT` here.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from .workers import FAST_SETTINGS, REPO, WorkerProcess

#: The previous release, 0.1.0: the last commit before the schema handshake.
PREVIOUS_VERSION = "0.1.0"
PREVIOUS_COMMIT = "994d6c9e651fed7250844363efb7947f479b4883"
#: Where the actors, the worker app and the client that both releases run live (the
#: workers run with it as working directory, never the checkout: see upgrade_actors.py).
APPS = Path(__file__).resolve().parent / "release_apps"


def _run(command: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    if result.returncode != 0:
        pytest.fail(f"{what} failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def build(workdir: Path) -> Release:
    """Build the previous release's wheel and install it into ``workdir/venv``.

    Fails (never skips) when the commit is not in this clone: the upgrade test is part of
    every run, and a shallow clone must be deepened (``git fetch --unshallow``).
    """
    found = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{PREVIOUS_COMMIT}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        pytest.fail(
            f"commit {PREVIOUS_COMMIT[:12]} (release {PREVIOUS_VERSION}) is not in this "
            f"clone of the repository at {REPO}: the upgrade test builds the previous "
            "release from it; fetch the full history (git fetch --unshallow) and run again"
        )
    archive = subprocess.run(
        ["git", "archive", "--format=tar", PREVIOUS_COMMIT],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout
    source = workdir / "source"
    # The archive is this repository's own; "data" is the safe filter where it exists.
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, **safe)  # noqa: S202
    wheels = workdir / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    _run([*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), str(source)], "pip wheel")
    (wheel,) = wheels.glob(f"dramatiq_pg_broker-{PREVIOUS_VERSION}-*.whl")
    venv = workdir / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], "python -m venv")
    python = venv / "bin" / "python"
    # This environment's pip installs into the other one (pip's --python).
    _run([*pip, "--python", str(python), "install", str(wheel)], "pip install")
    return Release(python, workdir)


#: The previous release's processes import its own package, never this checkout, even when
#: the tests run with ``PYTHONPATH`` pointing at the checkout (an empty one adds nothing).
OWN_PATH = {"PYTHONPATH": ""}


class Release:
    """An installed release: its interpreter, CLI, workers and senders."""

    def __init__(self, python: Path, workdir: Path) -> None:
        self.python = python
        self.workdir = workdir
        self._workers = 0
        version = _run(
            [str(python), "-c", "import dramatiq_pg_broker as p; print(p.__version__, p.__file__)"],
            "importing the previous release",
            cwd=APPS,
            env={**os.environ, **OWN_PATH},
        ).stdout.split()
        #: The installed version, and where its package is (inside its own environment).
        self.version, self.package = version[0], Path(version[1])

    def env(self, url: str, schema: str) -> dict[str, str]:
        return {
            **os.environ,
            **FAST_SETTINGS,
            **OWN_PATH,
            "DRAMATIQ_PG_URL": url,
            "DRAMATIQ_PG_SCHEMA": schema,
            "PYTHONUNBUFFERED": "1",
        }

    def cli(self, url: str, schema: str, *args: str) -> subprocess.CompletedProcess:
        """``dramatiq-pg-broker ARGS`` of this release."""
        return subprocess.run(
            [str(self.python), "-m", "dramatiq_pg_broker", *args],
            cwd=APPS,
            env=self.env(url, schema),
            capture_output=True,
            text=True,
            timeout=120,
        )

    def send(self, url: str, schema: str, sends: list[dict]) -> list[dict]:
        """Send with this release's broker (see upgrade_client.py); the stored messages."""
        result = self.try_send(url, schema, sends)
        if result.returncode != 0:
            pytest.fail(
                f"a send of the previous release failed (exit {result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}"
            )
        report = json.loads(result.stdout)
        assert report["release"] == "old", "the client ran this checkout's package"
        return report["sent"]

    def try_send(self, url: str, schema: str, sends: list[dict]) -> subprocess.CompletedProcess:
        """:meth:`send`, whatever it ends with: its exit status, output and errors."""
        return subprocess.run(
            [str(self.python), "upgrade_client.py"],
            cwd=APPS,
            env=self.env(url, schema),
            input=json.dumps(sends),
            capture_output=True,
            text=True,
            timeout=120,
        )

    def worker(self, url: str, schema: str, **kwargs) -> WorkerProcess:
        """A ``dramatiq upgrade_app`` worker of this release."""
        self._workers += 1
        log = self.workdir / f"old-worker{self._workers}.log"
        return WorkerProcess(
            url, schema, log, app="upgrade_app", python=self.python, cwd=APPS, **OWN_PATH, **kwargs
        )
