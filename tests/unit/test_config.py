"""Settings: keyword arguments, then DRAMATIQ_PG_* variables, then defaults."""

from __future__ import annotations

import pytest

from dramatiq_pg_broker.config import Settings, mask_url
from dramatiq_pg_broker.db import resolve_url
from dramatiq_pg_broker.errors import ConfigurationError


def test_defaults():
    settings = Settings.load(environ={})
    assert settings.url is None
    assert settings.schema == "dramatiq"
    assert settings.lease_seconds == 30.0
    assert settings.heartbeat_interval == 10.0
    assert settings.listen is True
    assert settings.events is True


def test_environment_overrides_defaults_and_keywords_override_environment():
    environ = {
        "DRAMATIQ_PG_URL": "postgresql://env/db",
        "DRAMATIQ_PG_SCHEMA": "from_env",
        "DRAMATIQ_PG_LEASE_SECONDS": "12.5",
        "DRAMATIQ_PG_LISTEN": "off",
        "DRAMATIQ_PG_REAPER_BATCH": "50",
        "DRAMATIQ_PG_CORS_ORIGINS": "https://a.example, https://b.example",
    }
    settings = Settings.load(environ=environ, schema="from_kwargs")
    assert settings.url == "postgresql://env/db"
    assert settings.schema == "from_kwargs"
    assert settings.lease_seconds == 12.5
    assert settings.listen is False
    assert settings.reaper_batch == 50
    assert settings.cors_origins == ("https://a.example", "https://b.example")


@pytest.mark.parametrize(
    ("environ", "fragment"),
    [
        ({"DRAMATIQ_PG_LEASE_SECONDS": "soon"}, "DRAMATIQ_PG_LEASE_SECONDS='soon'"),
        ({"DRAMATIQ_PG_LISTEN": "maybe"}, "DRAMATIQ_PG_LISTEN"),
        ({"DRAMATIQ_PG_SCHEMA": "Bad-Name"}, "not a valid name"),
        ({"DRAMATIQ_PG_LEASE_SECONDS": "0"}, "lease_seconds must be greater than 0"),
        ({"DRAMATIQ_PG_MAX_ATTEMPTS": "0"}, "max_attempts must be at least 1"),
        ({"DRAMATIQ_PG_HEARTBEAT_SECONDS": "60"}, "heartbeat_seconds"),
    ],
)
def test_bad_values_are_refused_with_a_sentence(environ, fragment):
    with pytest.raises(ConfigurationError, match=fragment.replace("(", r"\(")):
        Settings.load(environ=environ)


def test_unknown_keywords_are_refused():
    with pytest.raises(ConfigurationError, match="unknown setting"):
        Settings.load(environ={}, leese_seconds=3)


def test_public_settings_hide_the_password():
    settings = Settings.load(environ={}, url="postgresql://app:s3cret@db:5432/app")
    assert settings.public()["url"] == "user=app password=*** dbname=app host=db port=5432"
    assert "s3cret" not in repr(settings)
    assert mask_url(None) is None


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:s3cret@db:5432/app",
        "postgres://app:s3cret@db/app?sslmode=require",
        "host=db user=app password=s3cret dbname=app",
        "host=db password='s3cret with spaces' dbname=app",
        "postgresql://:s3cret@db/app",
        "postgresql://app:s3c@ret@db/app",
        "postgresql://app:s3c%40ret@db/app",
        "postgresql://app@db/app?password=s3cret",
        "postgresql:///app?host=/run/postgresql&password=s3cret",
        "host=db sslpassword=s3cret",
        "host=db password s3cret",
    ],
)
def test_every_libpq_form_is_masked(url):
    """Whatever libpq reads as the password is masked (an unencoded ``@`` ends libpq's
    password in a URL: ``s3c@ret@db`` is the password ``s3c`` on the host ``ret@db``)."""
    masked = mask_url(url)
    for part in ("s3cret", "s3c@", "s3c%40"):
        assert part not in masked, masked


def test_a_configured_url_never_starts_the_embedded_server(monkeypatch):
    import dramatiq_pg_broker.db.embedded as embedded

    def explode():
        raise AssertionError("the embedded server must not start when a URL is set")

    monkeypatch.setattr(embedded, "embedded_url", explode)
    assert resolve_url(Settings.load(environ={}, url="postgresql://x/y")) == "postgresql://x/y"


def test_without_a_url_deployments_can_refuse_the_embedded_server():
    with pytest.raises(ConfigurationError, match="DRAMATIQ_PG_URL"):
        resolve_url(Settings.load(environ={}), allow_embedded=False)


def test_prepared_statements_can_be_turned_off_for_a_transaction_mode_pooler():
    from dramatiq_pg_broker.db import connection_kwargs

    on = Settings.load(environ={})
    off = Settings.load(environ={"DRAMATIQ_PG_PREPARED_STATEMENTS": "false"})
    assert on.prepared_statements is True and off.prepared_statements is False
    assert "prepare_threshold" not in connection_kwargs(on)
    assert connection_kwargs(off)["prepare_threshold"] is None
    assert connection_kwargs(on)["autocommit"] and connection_kwargs(off)["autocommit"]


def test_the_broker_s_connections_are_named_by_process_unless_the_url_names_them():
    """``fallback_application_name``: libpq uses it only when the URL sets no
    ``application_name``; ``dramatiq-pg-broker/<pid>`` tells an operator (and ``doctor``)
    whose connection it is."""
    import os

    from dramatiq_pg_broker.db import connection_kwargs

    kwargs = connection_kwargs(Settings.load(environ={}))
    assert kwargs["fallback_application_name"] == f"dramatiq-pg-broker/{os.getpid()}"
    assert "application_name" not in kwargs


def test_every_setting_is_documented_where_it_is_defined():
    """The docs' settings table is generated from the fields' metadata: a new setting
    without a description, or in no group, fails here rather than leaving a blank row."""
    import dataclasses

    from dramatiq_pg_broker.config import GROUPS

    for field in dataclasses.fields(Settings):
        doc = field.metadata.get("doc", "")
        assert len(doc) > 20 and doc.endswith("."), f"{field.name} has no description"
        assert field.metadata.get("group") in GROUPS, f"{field.name} is in no group"


def test_every_environment_variable_the_code_reads_is_documented():
    import re
    from pathlib import Path

    from dramatiq_pg_broker.config import describe

    root = Path(__file__).resolve().parents[2]
    sources = [*root.glob("dramatiq_pg_broker/**/*.py"), *root.glob("admin_api/**/*.py")]
    named = set()
    for path in sources:
        named.update(re.findall(r"DRAMATIQ_PG_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    documented = {row.variable for row in describe()}
    assert named - documented == set(), "read by the code but missing from the docs"
    assert len(documented) == len(describe()), "a variable is described twice"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://app:s3cret@db:5432/app",
        "postgresql+psycopg2://app:s3cret@db:5432/app",
        "postgres+asyncpg://app:s3cret@db:5432/app",
        "postgres://app:s3cret@db:5432/app",
        "postgresql://app:s3cret@db:5432/app",
    ],
)
def test_sqlalchemy_and_libpq_spellings_are_read_as_postgresql_urls(url):
    settings = Settings.load(environ={}, url=url)
    assert settings.url == "postgresql://app:s3cret@db:5432/app"
    from_env = Settings.load(environ={"DRAMATIQ_PG_URL": url})
    assert from_env.url == "postgresql://app:s3cret@db:5432/app"


def test_a_key_value_connection_string_is_kept_as_it_is():
    url = "host=db user=app password=s3cret dbname=app"
    assert Settings.load(environ={}, url=url).url == url


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("mysql://app:s3cret@db/app", "mysql:// is not a PostgreSQL URL"),
        ("postgresql+mysqldb://app:s3cret@db/app", "is not a PostgreSQL URL"),
        ("sqlite:///app.db", "is not a PostgreSQL URL"),
        ("postgresql://app:s3cret@db/app?pool_size=5", 'invalid URI query parameter: "pool_size"'),
        ("postgresql://app:s3cret@db:fivefour/app", "port 'fivefour' is not a number"),
        ("db.example/app password=s3cret", 'missing "="'),
        ("postgresql://app:s3c@ret@db/app?x=1", "invalid URI query parameter"),
    ],
)
def test_a_url_libpq_cannot_use_is_refused_when_built_naming_the_problem(url, problem):
    from dramatiq_pg_broker import InvalidDatabaseURL

    with pytest.raises(InvalidDatabaseURL) as info:
        Settings.load(environ={}, url=url)
    message = str(info.value)
    assert problem in message, message
    assert "s3c" not in message, message
    assert ("***" in message) == ("s3c" in url), message
    with pytest.raises(InvalidDatabaseURL):
        Settings.load(environ={"DRAMATIQ_PG_URL": url})


def test_the_broker_refuses_a_bad_url_when_it_is_built_not_at_the_first_send():
    from dramatiq_pg_broker import InvalidDatabaseURL, PostgresBroker

    with pytest.raises(InvalidDatabaseURL, match="is not a PostgreSQL URL"):
        PostgresBroker(url="mysql://app:s3cret@db/app")
    broker = PostgresBroker(url="postgresql+psycopg://app:s3cret@db/app")
    assert broker.settings.url == "postgresql://app:s3cret@db/app"


def test_the_cli_refuses_a_bad_url_in_one_line(capsys, monkeypatch):
    from dramatiq_pg_broker.cli import main

    assert main(["--url", "postgresql+psycopg://app:s3cret@db:x/app", "jobs", "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: database URL 'postgresql+psycopg://app:***@db:x/app'"), err
    assert "port 'x'" in err and "s3cret" not in err
    monkeypatch.setenv("DRAMATIQ_PG_URL", "redis://localhost:6379/0")
    assert main(["stats"]) == 2
    assert "redis:// is not a PostgreSQL URL" in capsys.readouterr().err


def test_a_worker_s_connection_budget_is_its_pool_its_listen_and_maintenance_s_turn():
    """What a worker process may open whatever its threads (the tuning guide's budget)."""
    assert Settings.load(environ={}).connection_budget == 12
    assert Settings.load(environ={}, pool_max_size=4).connection_budget == 6
    assert Settings.load(environ={}, listen=False).connection_budget == 11
    assert Settings.load(environ={}, retention=False).connection_budget == 11
    assert Settings.load(environ={}, scheduler=False, listen=False).connection_budget == 10
