"""``GET /api/openapi.json`` (credentials needed) and ``GET /api/docs``.

The docs page is a static shell with no data in it, so it needs no credentials: it offers a
login form, then loads the OpenAPI document with the session and lists every endpoint,
its parameters, body fields and responses. It loads nothing from other sites.
"""

from __future__ import annotations

from importlib import resources

import falcon

from ..auth import READERS
from ..operations import ANY_QUERY, PUBLIC, operation
from ..pagination import link_to


class OpenApiDocument:
    route = "/api/openapi.json"

    def __init__(self) -> None:
        # The document is derived from the router's resources, this one among them.
        from ..openapi import build

        self.document = build()

    @operation(
        roles=READERS,
        summary="This document.",
        database=False,
        responses={200: "The OpenAPI document."},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = self.document


class DocsPage:
    route = "/api/docs"

    @operation(
        roles=PUBLIC,
        summary="A page that shows this document (it loads it after you log in).",
        description="At /api/docs/ it is a redirect here: the page finds the document and the "
        "login beside its own address.",
        query=ANY_QUERY,
        database=False,
        responses={200: "HTML.", 301: "From /api/docs/: to /api/docs."},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        # The page's requests are relative to its address (so that it works behind a
        # proxy's path prefix too): from /api/docs/ they would miss the API.
        if req.env.get("PATH_INFO", "").endswith("/"):
            raise falcon.HTTPMovedPermanently(link_to(req, "/api/docs"))
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
