"""The guides as a reader meets them: their order in the sidebar, and code that runs as
written."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _toctree(path: Path) -> list[str]:
    text = path.read_text("utf-8")
    block = text.split("```{toctree}", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip() and ":" not in line]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text("utf-8"), re.S)


def test_the_django_and_async_guides_come_before_security():
    order = _toctree(DOCS / "guides" / "index.md")
    assert order.index("django") < order.index("security"), order
    assert order.index("async") < order.index("security"), order


def test_operator_control_imports_every_abort_name_it_uses():
    pytest.importorskip("dramatiq_abort")
    for block in _python_blocks(DOCS / "guides" / "operator-control.md"):
        tree = ast.parse(block)
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)  # the import works as written
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module}.{alias.name}"
                    imported.add(alias.asname or alias.name)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        if "AbortMode" in used:
            assert "AbortMode" in imported, block
