"""The CLI without a database URL: inside a Django project it says how to reach the
project's database, elsewhere it names every way to give one."""

from __future__ import annotations

import pytest

from dramatiq_pg_broker.cli import main


@pytest.fixture
def no_url(monkeypatch, tmp_path):
    monkeypatch.delenv("DRAMATIQ_PG_URL", raising=False)
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _never_start_the_embedded_server(monkeypatch):
    import dramatiq_pg_broker.db.embedded as embedded

    def explode():
        raise AssertionError("the embedded server must not start in a Django project")

    monkeypatch.setattr(embedded, "embedded_url", explode)


@pytest.mark.parametrize("argv", [["jobs", "list"], ["stats"], ["migrate"], ["user", "list"]])
def test_inside_a_django_project_the_cli_points_at_manage_py(no_url, monkeypatch, capsys, argv):
    _never_start_the_embedded_server(monkeypatch)
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "shop.settings")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"python manage.py dramatiq_pg {' '.join(argv)}" in err, err
    assert "DJANGO_SETTINGS_MODULE=shop.settings" in err
    assert "--url" in err and "DRAMATIQ_PG_URL" in err


def test_a_manage_py_in_the_working_directory_is_a_django_project(no_url, monkeypatch, capsys):
    _never_start_the_embedded_server(monkeypatch)
    (no_url / "manage.py").write_text("")
    assert main(["jobs", "list", "--status", "failed"]) == 2
    err = capsys.readouterr().err
    assert "python manage.py dramatiq_pg jobs list --status failed" in err, err
    assert "manage.py in this directory" in err


def test_outside_django_without_pgserver_the_cli_names_url_and_the_variable(
    no_url, monkeypatch, capsys
):
    import dramatiq_pg_broker.db.embedded as embedded

    def missing():
        raise ImportError("pgserver is not installed")

    monkeypatch.setattr(embedded, "import_pgserver", missing)
    monkeypatch.setattr(embedded, "_url", None)
    assert main(["jobs", "list"]) == 2
    err = capsys.readouterr().err
    assert "DRAMATIQ_PG_URL" in err and "--url" in err and "embedded extra" in err, err
    assert "manage.py" not in err
