"""``GET /api/openapi.json`` (credentials needed) and ``GET /api/docs``.

The docs page is a static shell with no data in it, so it needs no credentials: it offers a
login form, then loads the OpenAPI document with the session and lists every endpoint,
its parameters, body fields and responses. It loads nothing from other sites.
"""

from __future__ import annotations

from importlib import resources

import falcon

from .. import openapi
from ..auth import READERS


class OpenApiDocument:
    permissions = {"GET": READERS}

    def __init__(self) -> None:
        self.document = openapi.build()

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = self.document


class DocsPage:
    public = True

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = falcon.MEDIA_HTML
        # The page runs only its own inline script and talks only to this API.
        resp.set_header(
            "Content-Security-Policy",
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self'; form-action 'self'; frame-ancestors 'none'",
        )
        resp.text = PAGE


#: The page, read once.
PAGE = resources.files("admin_api").joinpath("docs.html").read_text("utf-8")
