"""Sphinx configuration of the dramatiq-pg-broker documentation (``make docs``).

Pages are MyST Markdown. The reference is generated from the code: autodoc for the public
API, and the small extensions in ``_ext/`` for the settings (from their definitions), the
command line (from its parser) and the HTTP API (from its OpenAPI document).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "_ext"))

from dramatiq_pg_broker import __version__  # noqa: E402

project = "dramatiq-pg-broker"
author = "the dramatiq-pg-broker authors"
copyright = "dramatiq-pg-broker authors; LGPL-3.0-or-later"
release = __version__
version = ".".join(__version__.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "settings_table",
    "cli_reference",
    "http_reference",
]

source_suffix = {".md": "markdown"}

root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

# MyST: ::: fences for admonitions, definition lists, and anchors for every heading down
# to level 3, so that pages can link to [a section](page.md#its-title).
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Docstrings follow Dramatiq's layout (Parameters:, Raises:, Returns:), which napoleon's
# Google style reads.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"

html_theme = "furo"
html_title = "dramatiq-pg-broker"
html_static_path: list[str] = []


class _GuidesGlobFilter(logging.Filter):
    """The guides' index lists its pages in reading order, then a glob (``*``) that picks
    up every other page of the folder by itself. While every page is listed, that glob
    matches nothing, which is not a mistake: drop that one warning (Sphinx gives it no
    type that ``suppress_warnings`` could name), and only for that page."""

    def filter(self, record: logging.LogRecord) -> bool:
        node = getattr(record, "location", None)
        page = node.get("parent") if hasattr(node, "get") else None
        return not ("didn't match any documents" in record.getMessage() and page == "guides/index")


def setup(app):
    logging.getLogger("sphinx.sphinx.directives.other").addFilter(_GuidesGlobFilter())
