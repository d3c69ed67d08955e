"""Shared fixtures: a real PostgreSQL, and a freshly migrated database per test module.

The server is ``DRAMATIQ_PG_TEST_URL`` when set, else the embedded one (pgserver). Each test
module gets a database of its own, a copy of one this process migrated once (see
:mod:`.databases`).
"""

from __future__ import annotations

import os

import psycopg
import pytest

from .helpers import drop_schema, new_schema_name


def pytest_report_header(config) -> list[str]:
    """Say which PostgreSQL the run uses before the first test starts."""
    if os.environ.get("DRAMATIQ_PG_TEST_URL") or os.environ.get("DRAMATIQ_PG_URL"):
        from dramatiq_pg_broker.config import mask_url

        url = os.environ.get("DRAMATIQ_PG_TEST_URL") or os.environ.get("DRAMATIQ_PG_URL")
        return [f"database: {mask_url(url)} (DRAMATIQ_PG_TEST_URL)"]
    from dramatiq_pg_broker.db.embedded import data_dir

    return [
        f"database: the embedded PostgreSQL in {data_dir()} (started on first use; it keeps "
        "running afterwards: dramatiq-pg-broker embedded stop)"
    ]


def pytest_configure(config) -> None:
    """With parallel workers (pytest-xdist's ``-n``) and no database URL, start the embedded
    PostgreSQL here, in the controller, before any worker starts: the workers then find it
    running instead of all starting it at once (the start itself also holds a file lock;
    see :func:`dramatiq_pg_broker.db.embedded.embedded_url`). A failure to start it is left for
    the tests that need a database to report, as in a serial run."""
    if hasattr(config, "workerinput") or getattr(config.option, "dist", "no") == "no":
        return
    if os.environ.get("DRAMATIQ_PG_TEST_URL") or os.environ.get("DRAMATIQ_PG_URL"):
        return
    from dramatiq_pg_broker.db.embedded import embedded_url
    from dramatiq_pg_broker.errors import ConfigurationError

    try:
        embedded_url()
    except ConfigurationError:
        pass


def pytest_collection_modifyitems(config, items) -> None:
    """In a parallel run, the tests marked ``slow`` are handed out first, those allowed the
    longest time (their ``timeout`` mark) ahead: a long test that starts last makes the
    whole run wait for it (``make test`` keeps this order: ``--no-loadscope-reorder``). A
    serial run keeps the files' order."""
    if not hasattr(config, "workerinput"):
        return
    default_timeout = float(config.getini("timeout") or 0)

    def rank(item) -> tuple[int, float]:
        if item.get_closest_marker("slow") is None:
            return (1, 0.0)
        timeout = item.get_closest_marker("timeout")
        return (0, -float(timeout.args[0] if timeout and timeout.args else default_timeout))

    items.sort(key=rank)  # stable: the files' order otherwise


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(config, report):
    """A parallel worker sends each test's report to the controller over a channel that
    carries only UTF-8 text: a lone surrogate anywhere in it (a captured log line of a test
    whose error text cannot be encoded, on purpose) would end the whole run with an internal
    error. Such characters are sent escaped (``\\udcff``), as ``repr`` shows them."""
    data = yield
    return _utf8(data) if hasattr(config, "workerinput") else data


def _utf8(value):
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {key: _utf8(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_utf8(item) for item in value)
    return value


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    """After pytest removed a green run's temporary directory, remove its now empty
    ``pytest-of-<user>`` parent as well (left alone while it holds anything, such as
    another run's directory)."""
    # pytest has no public way to ask for its base directory without making one: its own
    # attributes are read, and anything missing leaves the folder alone.
    factory = getattr(session.config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None)
    if basetemp is None or basetemp.exists() or factory._given_basetemp is not None:
        return
    parent = basetemp.parent
    try:
        for entry in parent.iterdir():
            # pytest's own "latest run" link, dangling once that run's folder is gone.
            if entry.is_symlink() and not entry.exists():
                entry.unlink()
        parent.rmdir()
    except OSError:
        pass


@pytest.fixture(scope="session")
def server_url() -> str:
    """The configured PostgreSQL: ``DRAMATIQ_PG_TEST_URL``, else the embedded one. Tests
    use their module's database (``pg_url``) on it."""
    url = os.environ.get("DRAMATIQ_PG_TEST_URL") or os.environ.get("DRAMATIQ_PG_URL")
    if url:
        return url
    from dramatiq_pg_broker.db.embedded import embedded_url

    return embedded_url()


@pytest.fixture(scope="session")
def template(server_url):
    """This process's template database, migrated once; None when the role may not create
    databases."""
    from .databases import Template

    template = Template.create(server_url)
    yield template
    if template is not None:
        template.drop()


@pytest.fixture(scope="module")
def pg_url(server_url, template) -> str:
    """The URL of the module's own database, a copy of the migrated template (dropped
    after the module); the configured database itself when the role may not create
    databases."""
    if template is None:
        yield server_url
        return
    url = template.copy()
    yield url
    template.drop_copy(url)


@pytest.fixture(scope="module")
def schema(pg_url, template):
    """The broker's schema in the module's database, migrated to the latest version.
    Without a template, a schema of the module's own, migrated here and dropped after the
    module."""
    if template is not None:
        yield template.schema
        return
    from dramatiq_pg_broker.migrate import migrate

    name = new_schema_name()
    migrate(pg_url, name)
    yield name
    drop_schema(pg_url, name)


@pytest.fixture
def empty_schema(pg_url):
    """A schema name with nothing in it yet, dropped after the test."""
    name = new_schema_name("m")
    yield name
    drop_schema(pg_url, name)


@pytest.fixture
def behind(pg_url, empty_schema):
    """``empty_schema`` migrated up to 0.1.0's schema (:data:`~.helpers.RELEASED`): older
    than this code needs."""
    from dramatiq_pg_broker.migrate import migrate

    from .helpers import RELEASED

    migrate(pg_url, empty_schema, target=RELEASED)
    return empty_schema


@pytest.fixture
def conn(pg_url):
    with psycopg.connect(pg_url, autocommit=True) as c:
        yield c
