"""Run Dramatiq's own tests against this broker.

::

    git clone --depth 1 https://github.com/Bogdanp/dramatiq /tmp/dramatiq
    python -m tests.dramatiq_suite --source /tmp/dramatiq [-- extra pytest arguments]

Dramatiq's tests that use its ``stub_broker`` fixture (the broker-agnostic ones: actors,
retries, composition, callbacks, results, workers...) run with that fixture giving a
:class:`~dramatiq_pg_broker.PostgresBroker` on a fresh migrated schema of
``DRAMATIQ_PG_TEST_URL`` instead of Dramatiq's in-memory ``StubBroker``. Dramatiq's test
folder is copied to a temporary directory and the fixture is added to its ``conftest.py``
there: nothing of Dramatiq's is kept in this repository. Tests about the stub broker itself,
Redis, RabbitMQ, memcached, the CLI and the file watcher are not run, nor the cases of a test
parametrized with a memcached or Redis backend.

The run prints pytest's summary (``N passed, M failed``); the exit status is pytest's.
Some tests fail on any real broker, since they test Dramatiq's ``StubBroker`` itself: they
read its ``queues`` dict of Python queues, expect ``join()`` to re-raise the actor's
exception (this broker's ``join(fail_fast=True)`` raises ``JobFailed``), or expect one
worker thread to take messages strictly in priority order (a real consumer prefetches).
One fails by design: a message a middleware skipped without failing it holds
``MessageSkipped`` in a results backend, not None (see :mod:`dramatiq_pg_broker.attempt.skips`).
Not part of ``make test``: it needs Dramatiq's source tree, and its test dependencies
(``pylibmc``, ``redis``, ``pika`` are imported by its conftest; stand-ins are provided when
they are missing, since no test run here uses them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: Dramatiq's test modules run here: those whose tests use ``stub_broker``, less
#: ``test_stub_broker.py`` (the stub broker's own behaviour).
MODULES = (
    "test_actors.py",
    "test_broker.py",
    "test_callbacks.py",
    "test_composition.py",
    "test_encoders.py",
    "test_generic_actors.py",
    "test_messages.py",
    "test_results.py",
    "test_worker.py",
    "middleware/test_asyncio.py",
    "middleware/test_retries.py",
    "middleware/test_shutdown.py",
    "middleware/test_time_limit.py",
)

#: Appended to the copy of Dramatiq's conftest.py: a later definition of a fixture in the
#: same module replaces the earlier one.
FIXTURE = '''

# -- added by dramatiq-pg-broker's tests/dramatiq_suite.py ------------------------------
import uuid as _uuid

import psycopg as _psycopg
from psycopg import sql as _sql

from dramatiq_pg_broker import PostgresBroker as _PostgresBroker
from dramatiq_pg_broker.migrate import migrate as _migrate


class _PgStubBroker(_PostgresBroker):
    """The broker under test, answering the one StubBroker attribute tests read."""

    @property
    def dead_letters(self):
        query = _sql.SQL(
            "SELECT message, message_bytes FROM {}.jobs_history WHERE status = 'failed' "
            "ORDER BY finished_at"
        ).format(_sql.Identifier(self.settings.schema))
        with _psycopg.connect(os.environ["DRAMATIQ_PG_TEST_URL"]) as conn:
            rows = conn.execute(query).fetchall()
        return [self.decode_message(r[0], r[1]) for r in rows]


def pytest_collection_modifyitems(config, items):
    """Only the tests that use a broker from the stub_broker fixture run, with Dramatiq's
    stub result and rate-limit backends (not its memcached or Redis ones)."""

    def runs_here(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        return "stub_broker" in getattr(item, "fixturenames", ()) and not any(
            value in ("memcached", "redis") for value in params.values()
        )

    kept = [item for item in items if runs_here(item)]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


@pytest.fixture
def result_backends(stub_result_backend):
    """Only Dramatiq's stub result backend: no memcached or Redis server is asked for."""
    return {"stub": stub_result_backend}


@pytest.fixture
def rate_limiter_backends(stub_rate_limiter_backend):
    return {"stub": stub_rate_limiter_backend}


@pytest.fixture()
def stub_broker():
    url = os.environ["DRAMATIQ_PG_TEST_URL"]
    schema = f"dq_{_uuid.uuid4().hex[:12]}"
    _migrate(url, schema)
    broker = _PgStubBroker(url=url, schema=schema)
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    yield broker
    broker.flush_all()
    broker.close()
    with _psycopg.connect(url, autocommit=True) as conn:
        conn.execute(_sql.SQL("DROP SCHEMA {} CASCADE").format(_sql.Identifier(schema)))
'''

#: Modules Dramatiq's conftest imports for its Redis, RabbitMQ and memcached fixtures.
STAND_INS = {
    "pylibmc.py": "class SomeErrors(Exception):\n    pass\n",
    "redis.py": "class ConnectionError(Exception):\n    pass\n",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="a checkout of Dramatiq's repository")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if not os.environ.get("DRAMATIQ_PG_TEST_URL"):
        parser.error("set DRAMATIQ_PG_TEST_URL to the PostgreSQL to run against")
    source = Path(args.source) / "tests"
    if not (source / "conftest.py").is_file():
        parser.error(f"{source} holds no conftest.py: give a checkout of Dramatiq's repository")
    project = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="dramatiq-suite-") as tmp:
        root = Path(tmp)
        shutil.copytree(source, root / "tests", ignore=shutil.ignore_patterns("benchmarks"))
        with open(root / "tests" / "conftest.py", "a", encoding="utf-8") as f:
            f.write(FIXTURE)
        stand_ins = root / "stand_ins"
        stand_ins.mkdir()
        for name, text in STAND_INS.items():
            module = name.removesuffix(".py")
            probe = [sys.executable, "-c", f"import {module}"]
            if subprocess.run(probe, stderr=subprocess.DEVNULL).returncode:
                (stand_ins / name).write_text(text, encoding="utf-8")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(project), str(stand_ins), env.get("PYTHONPATH")) if p
        )
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-o",
            "addopts=",
            *[f"tests/{module}" for module in MODULES],
            *args.pytest_args,
        ]
        return subprocess.run(command, cwd=root, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
