"""The release installs: ``python -m build`` makes an sdist and a wheel that ``twine check``
accepts, and the wheel, installed without any extra into a fresh virtual environment with
this checkout off the path, migrates, sends and runs a worker, and holds none of the admin
side's web stack.

Everything runs from a temporary folder outside the checkout, with ``PYTHONPATH`` unset, so
only what the wheel installed can be imported. Building the release and the environment
takes a while (pip installs the wheel's dependencies from the package index, or its cache),
so this module builds them once and runs every check in them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import dramatiq_pg_broker

from .workers import REPO, wait_for

pytestmark = pytest.mark.slow

#: What the ``admin`` extra adds; none of it may be in a base install.
ADMIN_ONLY = ("falcon", "gunicorn", "bcrypt", "sqlalchemy", "pydantic")
#: The frameworks of the integrations (``dramatiq_pg_broker.contrib``); none of them either.
FRAMEWORKS = ("django", "django_dramatiq", "fastapi", "uvicorn", "httpx")
#: The only top-level packages the wheel may install.
INSTALLED_PACKAGES = {"dramatiq_pg_broker", "admin_api"}

ACTORS = """
import dramatiq
from dramatiq_pg_broker import PostgresBroker

broker = PostgresBroker()
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="base")
def add(a, b):
    return a + b
"""

#: Jobs the installed worker drains.
JOBS = 20

CHECK_IMPORTS = """
import importlib, json, pkgutil, sys
import dramatiq_pg_broker
# The integrations (dramatiq_pg_broker.contrib.<framework>) import their framework.
names = [m.name for m in pkgutil.walk_packages(dramatiq_pg_broker.__path__, "dramatiq_pg_broker.")
         if not m.name.endswith(".__main__")
         and not m.name.startswith("dramatiq_pg_broker.contrib.")]
for name in names:
    importlib.import_module(name)
found = {name: importlib.util.find_spec(name) is not None for name in %r}
loaded = sorted(m for m in sys.modules if m.split(".")[0] in %r or m.startswith("admin_api"))
print(json.dumps({"modules": names, "installed": found, "loaded": loaded,
                  "file": dramatiq_pg_broker.__file__, "version": dramatiq_pg_broker.__version__}))
"""


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel, built from this checkout as a release is."""
    dist = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)],
        cwd=dist,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def base_venv(release, tmp_path_factory):
    """A new virtual environment with the wheel installed without any extra."""
    root = tmp_path_factory.mktemp("base-install")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(release["wheel"])],
        cwd=root,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return venv


def test_the_release_files_pass_twine_check_and_hold_only_the_packages(release):
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, release.values())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr

    version = dramatiq_pg_broker.__version__
    assert release["wheel"].name == f"dramatiq_pg_broker-{version}-py3-none-any.whl"
    names = zipfile.ZipFile(release["wheel"]).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == INSTALLED_PACKAGES, f"the wheel installs {sorted(top)}"
    migrations = sorted(p.name for p in (REPO / "migrations").glob("*.sql"))
    shipped = sorted(n.rsplit("/", 1)[1] for n in names if "/migrations/" in n)
    assert shipped == migrations, "every migration ships inside the wheel"
    assert "dramatiq_pg_broker/sql/queries.sql" in names
    assert "admin_api/dashboard/index.html" in names

    with tarfile.open(release["sdist"]) as sdist:
        members = {m.split("/", 1)[1] for m in sdist.getnames() if "/" in m}
    assert {"CHANGELOG.md", "README.md", "setup.cfg", "pyproject.toml"} <= members
    assert not any(m.startswith(("demo_actors/", "tests/", "benchmarks/")) for m in members)


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

    # Importing every module of the broker (the framework integrations aside) loads nothing
    # of the admin side or of a web framework, and none of them is even installed.
    code = CHECK_IMPORTS % (ADMIN_ONLY + FRAMEWORKS, ADMIN_ONLY + FRAMEWORKS)
    checked = json.loads(run(base_venv, "python", "-c", code, cwd=tmp_path, env=env).stdout)
    assert "dramatiq_pg_broker.broker" in checked["modules"]
    assert "dramatiq_pg_broker.sending.async_sending" in checked["modules"]
    assert checked["installed"] == dict.fromkeys(ADMIN_ONLY + FRAMEWORKS, False), checked
    assert checked["loaded"] == [], checked
    # What runs is the installed wheel, not this checkout.
    assert Path(checked["file"]).is_relative_to(base_venv), checked["file"]
    assert checked["version"] == dramatiq_pg_broker.__version__
    demo = run(base_venv, "python", "-c", "import demo_actors", cwd=tmp_path, env=env, check=False)
    assert demo.returncode == 1 and "No module named 'demo_actors'" in demo.stderr

    # The command is installed and answers.
    helped = run(base_venv, "dramatiq-pg-broker", "--help", cwd=tmp_path, env=env)
    assert "migrate" in helped.stdout and "jobs" in helped.stdout
    version = run(base_venv, "dramatiq-pg-broker", "--version", cwd=tmp_path, env=env)
    assert version.stdout.split() == ["dramatiq-pg-broker", dramatiq_pg_broker.__version__]

    # The CLI migrates a fresh schema (the migrations ship inside the wheel).
    migrated = run(base_venv, "dramatiq-pg-broker", "migrate", cwd=tmp_path, env=env)
    applied = [line.split()[1] for line in migrated.stdout.splitlines()]
    assert applied == sorted(p.stem for p in (REPO / "migrations").glob("*.sql")), applied

    # The account commands say what to install instead of failing with a traceback.
    users = run(base_venv, "dramatiq-pg-broker", "user", "list", cwd=tmp_path, env=env, check=False)
    assert users.returncode == 2
    assert "dramatiq-pg-broker[admin]" in users.stderr and "Traceback" not in users.stderr

    # Send from a module of the user's, then a real worker drains the queue.
    (tmp_path / "base_app.py").write_text(ACTORS)
    sent = run(
        base_venv,
        "python",
        "-c",
        f"import base_app\nfor n in range({JOBS}): print(base_app.add.send(n, 1).message_id)",
        cwd=tmp_path,
        env=env,
    )
    job_ids = sent.stdout.split()
    assert len(set(job_ids)) == JOBS, sent.stdout
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
            query = sql.SQL(
                "SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*) "
                "FROM {}.all_jobs WHERE id = ANY(%s::uuid[])"
            ).format(sql.Identifier(empty_schema))

            def drained():
                succeeded, stored = conn.execute(query, (job_ids,)).fetchone()
                assert stored == JOBS, f"{stored} of the {JOBS} sent jobs are stored"
                return succeeded == JOBS

            wait_for(
                drained,
                60,
                f"the installed worker to run the {JOBS} jobs",
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
