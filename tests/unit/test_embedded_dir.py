"""Which embedded server a process uses: its project's, unless told otherwise."""

from __future__ import annotations

import sys

from dramatiq_pg_broker.db import embedded


def _venv(monkeypatch, prefix):
    monkeypatch.delenv("DRAMATIQ_PG_EMBEDDED_DIR", raising=False)
    monkeypatch.setattr(sys, "prefix", str(prefix))
    monkeypatch.setattr(sys, "base_prefix", "/usr")


def test_a_checkouts_virtualenv_keeps_its_server_in_the_checkout(monkeypatch, tmp_path):
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "pyproject.toml").write_text("")
    _venv(monkeypatch, tmp_path / "one" / ".venv")
    one = embedded.data_dir()
    _venv(monkeypatch, tmp_path / "two" / ".venv")
    two = embedded.data_dir()
    assert one == tmp_path / "one" / ".pgdata" / "data"
    assert two == tmp_path / "two" / ".pgdata" / "data"
    assert "the project of the virtualenv" in embedded.where()[1]


def test_the_variable_wins_and_a_virtualenv_apart_from_a_project_is_per_user(monkeypatch, tmp_path):
    (tmp_path / "envs").mkdir()
    _venv(monkeypatch, tmp_path / "envs" / "app")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "share"))
    assert embedded.data_dir() == tmp_path / "share" / "dramatiq-pg-broker" / "pgdata"
    assert embedded.where()[1].startswith("per user")
    monkeypatch.setenv("DRAMATIQ_PG_EMBEDDED_DIR", str(tmp_path / "mine"))
    assert embedded.where() == (tmp_path / "mine", "DRAMATIQ_PG_EMBEDDED_DIR")


def test_status_of_a_server_never_started(monkeypatch, tmp_path, capsys):
    from dramatiq_pg_broker.cli import main

    monkeypatch.setenv("DRAMATIQ_PG_EMBEDDED_DIR", str(tmp_path / "pgdata"))
    assert main(["embedded", "status"]) == 0
    out = capsys.readouterr().out
    assert f"data directory  {tmp_path / 'pgdata'}" in out
    assert "chosen by       DRAMATIQ_PG_EMBEDDED_DIR" in out
    assert "server          not running" in out
    assert not (tmp_path / "pgdata").exists()  # status starts nothing
