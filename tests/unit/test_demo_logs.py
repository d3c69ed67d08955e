"""``make demo`` keeps its logs in the project (``.demo-logs/``, git-ignored), never in the
system's temporary folder."""

from __future__ import annotations

import ast
from pathlib import Path

from demo_actors import run

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_logs_in_the_project_and_git_ignores_them():
    assert run.LOGS == REPO / ".demo-logs"
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert ".demo-logs/" in ignored and ".pgdata/" in ignored


def test_the_demo_makes_nothing_in_the_temporary_folder():
    tree = ast.parse(Path(run.__file__).read_text("utf-8"))
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert "tempfile" not in imported
