"""Run Dramatiq's own tests against this broker, and against its results and rate-limiter
backends.

::

    git clone https://github.com/Bogdanp/dramatiq /tmp/dramatiq   # the installed release's tag
    python -m tests.dramatiq_suite --source /tmp/dramatiq [-- extra pytest arguments]
    python -m tests.dramatiq_suite --source /tmp/dramatiq --backends

The database is ``DRAMATIQ_PG_TEST_URL``, else this checkout's embedded PostgreSQL (as for
the tests); each Dramatiq test gets a fresh migrated schema of its own, dropped afterwards.
Dramatiq's test folder is copied to a temporary directory and fixtures are added to its
``conftest.py`` there: nothing of Dramatiq's is kept in this repository. The run prints
pytest's summary (``N passed, M failed``); the exit status is pytest's.

**The broker suite** (the default): Dramatiq's tests written against its ``stub_broker``
fixture (actors, retries, composition, callbacks, results, workers, time limits, shutdown
notifications, asyncio ...) run with that fixture giving a
:class:`~dramatiq_pg_broker.PostgresBroker` instead of Dramatiq's in-memory ``StubBroker``,
with Dramatiq's in-memory result and rate-limiter backends. The fixture's broker answers
two conveniences of the ``StubBroker`` that the tests lean on, from what the broker did:
``dead_letters`` (the failed jobs, read from the database) and ``join()``'s ``fail_fast``
(on by default, as in Dramatiq 2: once the queue is done, ``join`` raises the exception of
a message of that queue that this process failed, which is how Dramatiq's tests see that
a time limit, the age limit, a shutdown notification or a missing actor did what it
should; the exception is held for it as the ``StubBroker`` holds it, and not held while a
test makes the ``StubBroker``'s messages let go of theirs). Not run: the tests of the
``StubBroker`` itself (``test_stub_broker.py``) and of Redis, RabbitMQ, memcached, the CLI
and the file watcher; the cases of a test parametrized with a memcached or Redis backend;
and the three tests in :data:`NOT_RUN`, which put messages into or take them out of the
``StubBroker``'s in-memory queues.

Two of the broker suite's tests time what the ``StubBroker`` does in memory, and can fail
on a loaded machine: ``test_workers_process_messages_in_order`` expects the last of five
messages, sent a millisecond earlier, to be in the worker already (here it takes a
notification and a claim's round trip: 1.0 to 1.2 ms at the median, measured on a busy
2-core machine), and the zero-backoff retry tests expect eleven attempts within 0.2 s of
the actor's declaration, a fresh broker's first connections included (a retry took 2 to
5 ms there; the first claim of a fresh broker up to 150 ms when the machine was loaded).

**The backends suite** (``--backends``): every test of Dramatiq's parametrized with a result
backend or a rate-limiter backend (results, composition, group callbacks, barriers, the
concurrent, bucket and window limiters) runs once, with this package's
:class:`~dramatiq_pg_broker.results.PostgresBackend` and
:class:`~dramatiq_pg_broker.rate_limits.PostgresRateLimiterBackend` on the test's schema in
place of Dramatiq's memcached, Redis and in-memory ones, and the broker above.

Not part of ``make test``: it needs Dramatiq's source tree, and its test dependencies
(``pylibmc``, ``redis``, ``pika`` are imported by its conftest; stand-ins are provided when
they are missing, since no test run here uses them). What each behaviour these suites found
became is held by this project's own tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: The broker suite's modules: those whose tests use ``stub_broker``, less
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

#: The backends suite's modules: those with tests parametrized by a result or a
#: rate-limiter backend.
BACKEND_MODULES = (
    "test_results.py",
    "test_composition.py",
    "test_barrier.py",
    "test_bucket_rate_limiter.py",
    "test_concurrent_rate_limiter.py",
    "test_window_rate_limiter.py",
)

#: Tests of the broker suite's modules that are not run, and why.
NOT_RUN = {
    "test_actors.py::test_actors_can_be_sent_messages": (
        "takes the sent message off the StubBroker's in-memory queue (`queues[name].get()`)"
    ),
    "test_actors.py::test_worker_handles_non_numeric_eta_and_logs_warning": (
        "puts a message with an `eta` option straight into the StubBroker's in-memory queue; "
        "here a delay is the row's available_at, and a claimed message carries no eta"
    ),
    "test_actors.py::test_worker_handles_none_eta": "the same",
}

#: Appended to the copy of Dramatiq's conftest.py, in both suites: a later definition of a
#: fixture in the same module replaces the earlier one.
FIXTURE = '''

# -- added by dramatiq-pg-broker's tests/dramatiq_suite.py ------------------------------
import collections as _collections
import uuid as _uuid

import psycopg as _psycopg
from dramatiq.brokers import stub as _stub
from psycopg import sql as _sql

from dramatiq_pg_broker import PostgresBroker as _PostgresBroker
from dramatiq_pg_broker.migrate import migrate as _migrate

_URL = os.environ["DRAMATIQ_PG_TEST_URL"]

#: The StubBroker's message proxies keep their exception for its join, unless a test makes
#: them clear it (Dramatiq's tests that no exception outlives its message).
_STUB_KEEPS = _stub._StubMessageProxy.clear_exception


class _PgStubBroker(_PostgresBroker):
    """The broker under test, answering the two StubBroker conveniences tests read: its
    dead letters, and a join that raises the exception of a message this process failed."""

    fail_fast_default = True

    def __init__(self, **options):
        super().__init__(**options)
        self._failed = _collections.defaultdict(list)

    @property
    def dead_letters(self):
        query = _sql.SQL(
            "SELECT message, message_bytes FROM {}.jobs_history WHERE status = 'failed' "
            "ORDER BY finished_at"
        ).format(_sql.Identifier(self.settings.schema))
        with _psycopg.connect(_URL) as conn:
            rows = conn.execute(query).fetchall()
        return [self.decode_message(r[0], r[1]) for r in rows]

    def emit_before(self, signal, *args, **kwargs):
        if signal == "nack":
            # Before the nack is written: a join that sees the queue done has seen this.
            message = args[0]
            keeps = _stub._StubMessageProxy.clear_exception is _STUB_KEEPS
            self._failed[message.queue_name].append(message._exception if keeps else None)
        super().emit_before(signal, *args, **kwargs)

    def join(self, queue_name, *, timeout=None, fail_fast=None):
        super().join(queue_name, timeout=timeout)
        if self.fail_fast_default if fail_fast is None else fail_fast:
            for exception in self._failed[queue_name]:
                raise (exception or Exception("Message failed with unknown error")) from None

    def flush_all(self):
        super().flush_all()
        self._failed.clear()


@pytest.fixture()
def _pg_schema():
    """A fresh migrated schema for one test, dropped afterwards."""
    schema = f"dq_{_uuid.uuid4().hex[:12]}"
    _migrate(_URL, schema)
    yield schema
    with _psycopg.connect(_URL, autocommit=True) as conn:
        conn.execute(_sql.SQL("DROP SCHEMA {} CASCADE").format(_sql.Identifier(schema)))


@pytest.fixture()
def stub_broker(_pg_schema):
    broker = _PgStubBroker(url=_URL, schema=_pg_schema)
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    yield broker
    broker.flush_all()
    broker.close()
'''

#: Appended after :data:`FIXTURE` for the broker suite.
BROKER_SUITE = '''

_NOT_RUN = {not_run!r}


def pytest_collection_modifyitems(config, items):
    """Only the tests that use a broker from the stub_broker fixture run, with Dramatiq's
    stub result and rate-limit backends (not its memcached or Redis ones)."""

    def runs_here(item):
        params = getattr(getattr(item, "callspec", None), "params", {{}})
        name = item.nodeid.removeprefix("tests/").split("[")[0]
        return (
            "stub_broker" in getattr(item, "fixturenames", ())
            and name not in _NOT_RUN
            and not any(value in ("memcached", "redis") for value in params.values())
        )

    kept = [item for item in items if runs_here(item)]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


@pytest.fixture
def result_backends(stub_result_backend):
    """Only Dramatiq's stub result backend: no memcached or Redis server is asked for."""
    return {{"stub": stub_result_backend}}


@pytest.fixture
def rate_limiter_backends(stub_rate_limiter_backend):
    return {{"stub": stub_rate_limiter_backend}}
'''

#: Appended after :data:`FIXTURE` for the backends suite.
BACKENDS_SUITE = '''

from dramatiq_pg_broker.rate_limits import PostgresRateLimiterBackend as _PgRateLimits
from dramatiq_pg_broker.results import PostgresBackend as _PgResults


def pytest_collection_modifyitems(config, items):
    """Only the tests parametrized with a result or a rate-limiter backend run."""

    def runs_here(item):
        names = getattr(item, "fixturenames", ())
        return "result_backend" in names or "rate_limiter_backend" in names

    kept = [item for item in items if runs_here(item)]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


@pytest.fixture(params=["postgres"])
def result_backend(request, _pg_schema):
    backend = _PgResults(url=_URL, schema=_pg_schema)
    yield backend
    backend.close()


@pytest.fixture(params=["postgres"])
def rate_limiter_backend(request, _pg_schema):
    backend = _PgRateLimits(url=_URL, schema=_pg_schema)
    yield backend
    backend.close()
'''

#: Modules Dramatiq's conftest imports for its Redis, RabbitMQ and memcached fixtures.
STAND_INS = {
    "pylibmc.py": "class SomeErrors(Exception):\n    pass\n",
    "redis.py": "class ConnectionError(Exception):\n    pass\n",
}


def database_url() -> str:
    """``DRAMATIQ_PG_TEST_URL``, else this checkout's embedded PostgreSQL, as the tests'."""
    url = os.environ.get("DRAMATIQ_PG_TEST_URL")
    if url:
        return url
    from dramatiq_pg_broker.db.embedded import embedded_url

    return embedded_url()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="a checkout of Dramatiq's repository")
    parser.add_argument(
        "--backends",
        action="store_true",
        help="run the result and rate-limiter backend tests on this package's backends",
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    source = Path(args.source) / "tests"
    if not (source / "conftest.py").is_file():
        parser.error(f"{source} holds no conftest.py: give a checkout of Dramatiq's repository")
    project = Path(__file__).resolve().parent.parent
    if args.backends:
        suite, modules = BACKENDS_SUITE, BACKEND_MODULES
    else:
        suite, modules = BROKER_SUITE.format(not_run=set(NOT_RUN)), MODULES
    with tempfile.TemporaryDirectory(prefix="dramatiq-suite-") as tmp:
        root = Path(tmp)
        shutil.copytree(source, root / "tests", ignore=shutil.ignore_patterns("benchmarks"))
        with open(root / "tests" / "conftest.py", "a", encoding="utf-8") as f:
            f.write(FIXTURE + suite)
        stand_ins = root / "stand_ins"
        stand_ins.mkdir()
        for name, text in STAND_INS.items():
            module = name.removesuffix(".py")
            probe = [sys.executable, "-c", f"import {module}"]
            if subprocess.run(probe, stderr=subprocess.DEVNULL).returncode:
                (stand_ins / name).write_text(text, encoding="utf-8")
        env = dict(os.environ)
        env["DRAMATIQ_PG_TEST_URL"] = database_url()
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
            *[f"tests/{module}" for module in modules],
            *args.pytest_args,
        ]
        return subprocess.run(command, cwd=root, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
