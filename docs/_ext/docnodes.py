"""Small helpers shared by the docs' generated references: docutils nodes for sections,
tables and text with inline code, without going through a markup parser (the pages are
MyST Markdown, the generated parts are built as nodes directly)."""

from __future__ import annotations

import re

from docutils import nodes

_CODE = re.compile(r"`([^`]+)`")
#: Markdown these helpers do not render: a link, emphasis.
_MARKDOWN = re.compile(r"\[[^\]]+\]\([^)]*\)|\*\*[^*]+\*\*|(?<![\w*])\*[^*\s][^*]*\*(?![\w*])")


def inline(text: str) -> list[nodes.Node]:
    """Plain text with `backticks` as inline code: the only markup the descriptions use.

    Raises:
      ValueError: the text has other Markdown (a link, emphasis), which would be shown
        raw: a generated page must parse such text (``SphinxDirective.parse_text_to_nodes``,
        as the settings table does) or the text must do without.
    """
    bare = _CODE.sub("", text)
    found = _MARKDOWN.search(bare)
    if found is not None:
        raise ValueError(f"Markdown that would be shown raw: {found.group()!r} in {text!r}")
    parts: list[nodes.Node] = []
    position = 0
    for match in _CODE.finditer(text):
        if match.start() > position:
            parts.append(nodes.Text(text[position : match.start()]))
        parts.append(nodes.literal(match.group(1), match.group(1)))
        position = match.end()
    if position < len(text):
        parts.append(nodes.Text(text[position:]))
    return parts


def paragraph(text: str) -> nodes.paragraph:
    return nodes.paragraph("", "", *inline(text))


def section(document, title: str, *, code: bool = False) -> nodes.section:
    """A section with a title (as code when ``code``) and an id made from it."""
    node = nodes.section()
    node["names"].append(nodes.fully_normalize_name(title))
    heading = nodes.title()
    heading += nodes.literal(title, title) if code else nodes.Text(title)
    node += heading
    document.note_implicit_target(node, node)
    return node


def table(headers: list[str], rows: list[list[nodes.Node | str]], widths: list[int]) -> nodes.table:
    """A table with these column widths (relative); a cell is a node, a list of nodes,
    or text with `backticks` for code."""
    table_node = nodes.table(classes=["colwidths-given"])
    group = nodes.tgroup(cols=len(headers))
    table_node += group
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    group += head
    head += _row(headers)
    body = nodes.tbody()
    group += body
    for row in rows:
        body += _row(row)
    return table_node


def _row(cells) -> nodes.row:
    row = nodes.row()
    for cell in cells:
        entry = nodes.entry()
        if isinstance(cell, str):
            entry += paragraph(cell)
        elif isinstance(cell, list):
            for part in cell:
                entry += part
        else:
            entry += cell
        row += entry
    return row
