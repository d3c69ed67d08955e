"""``{settings-table}``: every setting, generated from its own definition.

The rows come from :func:`dramatiq_pg_broker.config.describe`: the :class:`Settings`
fields' metadata (description, group, shown default) and the environment-only variables,
so the reference cannot drift from the code; a unit test checks that every field has a
description. A description is Markdown, parsed as the page is (its links are checked by
the build, relative to this page: ``../guides/...``). One section per group, in the order
of ``config.GROUPS``.
"""

from __future__ import annotations

from docnodes import paragraph, section, table
from docutils import nodes
from sphinx.util.docutils import SphinxDirective

from dramatiq_pg_broker.config import GROUPS, describe


class SettingsTable(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        rows = describe()
        result = []
        for group in GROUPS:
            members = [row for row in rows if row.group == group]
            if not members:
                continue
            part = section(self.state.document, group)
            cells = []
            for row in members:
                # The variable, then the keyword and the default under it: two columns
                # fit the page, four made it scroll sideways.
                setting = [paragraph(f"`{row.variable}`")]
                keyword = f"keyword `{row.name}=`" if row.name else "environment only"
                setting.append(paragraph(f"{keyword}; default {row.default}"))
                cells.append([setting, self.parse_text_to_nodes(row.doc)])
            part += table(["setting", "meaning"], cells, [42, 58])
            result.append(part)
        return result


def setup(app):
    app.add_directive("settings-table", SettingsTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
