"""Fixtures for the tests that run real ``dramatiq`` worker processes."""

from __future__ import annotations

import pytest

from .workers import worker_starter


@pytest.fixture
def start_worker(pg_url, schema, tmp_path):
    """Start real worker processes on the module's schema; all are stopped afterwards."""
    yield from worker_starter(pg_url, schema, tmp_path)
