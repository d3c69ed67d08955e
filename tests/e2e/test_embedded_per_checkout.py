"""Two checkouts, two embedded servers: each project's virtualenv starts its own
PostgreSQL in the project's ``.pgdata/``, and stopping one leaves the other running."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from .workers import REPO

pytestmark = pytest.mark.slow

pytest.importorskip("pgserver")


def _checkout(root: Path) -> Path:
    """A project folder with a virtualenv that sees this checkout and the test run's
    packages (a ``.pth`` file, so nothing is installed)."""
    root.mkdir()
    (root / "pyproject.toml").write_text("")
    venv = root / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (purelib,) = (venv / "lib").glob("python*/site-packages")
    paths = [str(REPO), *site.getsitepackages()]
    (purelib / "test_checkout.pth").write_text("\n".join(paths) + "\n")
    return venv / "bin" / "python"


def _cli(python: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAMATIQ_PG_")}
    env.pop("PYTHONPATH", None)
    env.pop("XDG_RUNTIME_DIR", None)
    result = subprocess.run(
        [str(python), "-m", "dramatiq_pg_broker", "embedded", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=python.parent,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=5) as conn:
            return conn.execute("SELECT 1").fetchone() == (1,)
    except psycopg.OperationalError:
        return False


def test_two_checkouts_get_two_servers_and_stop_only_their_own(tmp_path):
    one, two = _checkout(tmp_path / "one"), _checkout(tmp_path / "two")
    try:
        url_one, url_two = _cli(one, "url"), _cli(two, "url")
        assert url_one != url_two
        assert (tmp_path / "one" / ".pgdata" / "data" / "postmaster.pid").exists()
        assert (tmp_path / "two" / ".pgdata" / "data" / "postmaster.pid").exists()
        status = _cli(one, "status")
        assert str(tmp_path / "one" / ".pgdata" / "data") in status and "running (pid" in status
        assert _answers(url_one) and _answers(url_two)

        assert _cli(one, "stop").startswith("stopped")
        assert not _answers(url_one)
        assert _answers(url_two), "stopping one checkout's server stopped the other's"
        assert "not running" in _cli(one, "status")
    finally:
        _cli(one, "stop")
        _cli(two, "stop")
