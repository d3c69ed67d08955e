"""The account store's named statements: every name it looks up exists in accounts.sql."""

from __future__ import annotations

import re
from pathlib import Path

import admin_api
from dramatiq_pg_broker.db import Queries, load_queries

SOURCE = Path(admin_api.__file__).with_name("accounts.py").read_text("utf-8")


def test_every_statement_the_account_store_uses_exists():
    used = set(re.findall(r'statements\["(\w+)"\]', SOURCE))
    used |= set(re.findall(r'_rows\(\s*"(\w+)"', SOURCE))
    assert {"insert_user", "find_token_user", "insert_job_owner"} <= used, used
    missing = used - set(load_queries("accounts.sql", "admin_api"))
    assert not missing, f"used in accounts.py but absent from admin_api/sql/accounts.sql: {missing}"


def test_schema_is_filled_in_as_an_identifier():
    queries = Queries("odd_schema", "accounts.sql", package="admin_api")
    assert '"odd_schema".users' in queries["insert_user"]
