"""The broker and the admin side are separate: the broker never imports the admin side or
its web stack, and the CLI lists the same commands however it is started."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import dramatiq_pg_broker

PACKAGE = Path(dramatiq_pg_broker.__file__).parent
ADMIN_ONLY = ("admin_api", "falcon", "gunicorn", "bcrypt", "sqlalchemy", "pydantic")


def test_importing_the_broker_loads_no_admin_module():
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import dramatiq_pg_broker as p\n"
        "for m in pkgutil.walk_packages(p.__path__, 'dramatiq_pg_broker.'):\n"
        "    if not m.name.endswith('.__main__'):\n"
        "        importlib.import_module(m.name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {ADMIN_ONLY!r})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_the_broker_package_never_names_the_admin_side():
    """Not even the CLI: the admin extra adds its account commands through entry points
    (``dramatiq_pg_broker.commands``)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                if name.split(".")[0] in ADMIN_ONLY:
                    offenders.append((path.relative_to(PACKAGE).as_posix(), name))
    assert offenders == [], offenders


def test_cli_module_help_lists_the_account_commands():
    for module in ("dramatiq_pg_broker", "dramatiq_pg_broker.cli"):
        result = subprocess.run(
            [sys.executable, "-m", module, "token", "--help"], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        for command in ("create", "list", "revoke"):
            assert command in result.stdout, (module, result.stdout)
        result = subprocess.run(
            [sys.executable, "-m", module, "user", "--help"], capture_output=True, text=True
        )
        for command in ("create", "list", "deactivate", "activate", "set-password"):
            assert command in result.stdout, (module, result.stdout)


def test_without_the_admin_extra_each_account_command_says_how_to_install_it(monkeypatch, capsys):
    """Without the admin extra (its dependency bcrypt missing), ``user`` and ``token`` are
    still commands, each saying which extra it needs; a module missing from the admin side
    itself is a bug, and is raised."""
    import argparse

    from dramatiq_pg_broker.cli import build_parser, main

    for name in ("admin_api.cli", "admin_api.accounts"):  # imported afresh: they need bcrypt
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "bcrypt", None)  # import raises ModuleNotFoundError
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    assert helps["user"] == "user commands (needs the admin extra)"
    assert helps["token"] == "token commands (needs the admin extra)"
    assert main(["token", "list", "--email", "a@b.c"]) == 2
    assert capsys.readouterr().err == (
        "error: the token commands need the admin extra: pip install 'dramatiq-pg-broker[admin]'\n"
    )
    monkeypatch.delitem(sys.modules, "bcrypt")  # importable again
    monkeypatch.setitem(sys.modules, "admin_api.accounts", None)
    with pytest.raises(ModuleNotFoundError):
        build_parser()
