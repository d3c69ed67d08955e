"""Shared fixtures: a real PostgreSQL, and a fresh migrated schema per test module.

The server is ``DRAMATIQ_PG_TEST_URL`` when set, else the embedded one (pgserver).
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
    from dramatiq_pg_broker.embedded import data_dir

    return [
        f"database: the embedded PostgreSQL in {data_dir()} (started on first use; it keeps "
        "running afterwards: dramatiq-pg-broker embedded stop)"
    ]


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
def pg_url() -> str:
    url = os.environ.get("DRAMATIQ_PG_TEST_URL") or os.environ.get("DRAMATIQ_PG_URL")
    if url:
        return url
    from dramatiq_pg_broker.embedded import embedded_url

    return embedded_url()


@pytest.fixture(scope="module")
def schema(pg_url):
    """A schema migrated to the latest version, dropped after the module."""
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
