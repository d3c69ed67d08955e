"""The embedded PostgreSQL (the tests' server when no URL is configured) keeps its WAL small
and leaves nothing in the system's temporary folder."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest

from dramatiq_pg_broker.db import embedded

from ..helpers import wait_for

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("DRAMATIQ_PG_TEST_URL") or os.environ.get("DRAMATIQ_PG_URL")),
    reason="the tests use the configured server, not the embedded one",
)


def _settings(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT name, current_setting(name) FROM unnest(%s::text[]) AS name",
            (list(embedded.WAL_SETTINGS),),
        ).fetchall()
    return dict(rows)


def test_the_embedded_servers_wal_is_kept_small(server_url):
    """PostgreSQL's default keeps up to 1 GB of WAL (a test run left a gigabyte in the
    checkout's .pgdata); every start gives the server its small settings back."""
    assert _settings(server_url) == embedded.WAL_SETTINGS
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET max_wal_size = '1GB'")
        conn.execute("SELECT pg_reload_conf()")
    wait_for(lambda: _settings(server_url)["max_wal_size"] == "1GB", 10, "the reload to change it")
    embedded.keep_wal_small(server_url)
    wait_for(
        lambda: _settings(server_url) == embedded.WAL_SETTINGS,
        10,
        "the server to have its small WAL settings again",
        on_timeout=lambda: str(_settings(server_url)),
    )


STATUS_THEN_URL = """
from dramatiq_pg_broker.db import embedded
embedded.status()
embedded.embedded_url()
"""


def test_asking_for_the_status_then_the_server_leaves_nothing_in_the_temporary_folder(
    server_url, tmp_path
):
    """pgserver keeps a lock in the user's runtime folder, /tmp/runtime-<uid> without
    XDG_RUNTIME_DIR: it is kept beside the data directory instead, even when a process
    asked for the server's status (which reads pgserver's files) before using it."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["TMPDIR"] = str(temporary)
    subprocess.run(
        [sys.executable, "-W", "ignore", "-c", STATUS_THEN_URL], env=env, check=True, timeout=120
    )
    assert list(temporary.iterdir()) == []
