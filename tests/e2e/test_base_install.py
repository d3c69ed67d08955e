"""The base install is the broker alone: a fresh virtual environment with
``pip install dramatiq-pg-broker`` (no extra) migrates, sends and runs a worker, and holds
none of the admin side's web stack.

Building the environment takes a while (pip installs the wheel and its dependencies), so
this module builds one and runs every check in it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psycopg
import pytest
from psycopg import sql

from .workers import REPO, wait_for

pytestmark = pytest.mark.slow

#: What the ``admin`` extra adds; none of it may be in a base install.
ADMIN_ONLY = ("falcon", "gunicorn", "bcrypt", "sqlalchemy")

ACTORS = """
import dramatiq
from dramatiq_pg_broker import PostgresBroker

broker = PostgresBroker()
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="base")
def add(a, b):
    return a + b
"""

CHECK_IMPORTS = """
import importlib, json, pkgutil, sys
import dramatiq_pg_broker
names = [m.name for m in pkgutil.walk_packages(dramatiq_pg_broker.__path__, "dramatiq_pg_broker.")
         if m.name not in ("dramatiq_pg_broker.__main__",)]
for name in names:
    importlib.import_module(name)
found = {name: importlib.util.find_spec(name) is not None for name in %r}
loaded = sorted(m for m in sys.modules if m.split(".")[0] in %r or m.startswith("admin_api"))
print(json.dumps({"modules": names, "installed": found, "loaded": loaded}))
"""


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory):
    """A new virtual environment with the package installed without any extra."""
    root = tmp_path_factory.mktemp("base-install")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return venv


def run(venv, *args, cwd, env=None, check=True):
    result = subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that would put this checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def test_base_install_migrates_sends_and_runs_a_worker(base_venv, pg_url, empty_schema, tmp_path):
    env = clean_env(DRAMATIQ_PG_URL=pg_url, DRAMATIQ_PG_SCHEMA=empty_schema, PYTHONUNBUFFERED="1")

    # Importing every module of the broker loads nothing of the admin side, and the admin
    # side's dependencies are not even installed.
    code = CHECK_IMPORTS % (ADMIN_ONLY, ADMIN_ONLY)
    checked = json.loads(run(base_venv, "python", "-c", code, cwd=tmp_path, env=env).stdout)
    assert "dramatiq_pg_broker.broker" in checked["modules"]
    assert checked["installed"] == dict.fromkeys(ADMIN_ONLY, False), checked
    assert checked["loaded"] == [], checked

    # The CLI migrates (the migrations ship inside the wheel).
    migrated = run(base_venv, "dramatiq-pg-broker", "migrate", cwd=tmp_path, env=env)
    assert "applied 0001_" in migrated.stdout

    # The account commands say what to install instead of failing with a traceback.
    users = run(base_venv, "dramatiq-pg-broker", "user", "list", cwd=tmp_path, env=env, check=False)
    assert users.returncode == 2
    assert "dramatiq-pg-broker[admin]" in users.stderr and "Traceback" not in users.stderr

    # Send, then a real worker runs the job.
    (tmp_path / "base_app.py").write_text(ACTORS)
    sent = run(
        base_venv,
        "python",
        "-c",
        "import base_app; print(base_app.add.send(2, 3).message_id)",
        cwd=tmp_path,
        env=env,
    )
    job_id = sent.stdout.strip()
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen(
        [str(base_venv / "bin" / "dramatiq"), "base_app", "--processes", "1", "--threads", "1"],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            query = sql.SQL("SELECT status FROM {}.jobs WHERE id = %s").format(
                sql.Identifier(empty_schema)
            )

            def status():
                row = conn.execute(query, (job_id,)).fetchone()
                return row is not None and row[0] == "succeeded"

            wait_for(
                status,
                60,
                "the base install's worker to run the job",
                on_timeout=lambda: (tmp_path / "worker.log").read_text(errors="replace"),
            )
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
        log.close()


def test_cli_module_lists_every_command(base_venv, tmp_path):
    """``python -m dramatiq_pg_broker.cli --help`` lists the same commands as the script."""
    result = run(
        base_venv, "python", "-m", "dramatiq_pg_broker.cli", "--help", cwd=tmp_path, env=clean_env()
    )
    for command in ("migrate", "status", "embedded", "user", "token"):
        assert command in result.stdout, result.stdout
