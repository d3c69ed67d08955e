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


def test_generated_reference_text_with_markdown_it_would_show_raw_fails_the_build():
    """The generated pages (settings, HTTP, CLI) build their nodes from plain text with
    `backticks`: other Markdown (a link, emphasis) would be shown raw, so it is an error,
    which fails the docs build; the settings table parses its descriptions instead."""
    import sys

    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from docnodes import inline
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    text = "`a=1`, `*b*` and `[x](y)`: 2 * 3 [sic]"
    assert "".join(node.astext() for node in inline(text)) == text.replace("`", "")
    for text in ("See [queue limits](../guides/queue-limits.md).", "**not** this", "an *x* y"):
        with pytest.raises(ValueError, match="shown raw"):
            inline(text)
