"""Fixtures for the tests that run real ``dramatiq`` worker processes."""

from __future__ import annotations

import pytest

from .clusters import cluster_factory
from .workers import worker_starter


@pytest.fixture
def start_worker(pg_url, schema, tmp_path):
    """Start real worker processes on the module's schema; all are stopped afterwards."""
    yield from worker_starter(pg_url, schema, tmp_path)


@pytest.fixture
def new_cluster():
    """Make throwaway PostgreSQL clusters of the test's own (see :mod:`.clusters`): the
    fixture's value makes one and starts it; every one is removed afterwards."""
    yield from cluster_factory()
