"""Conditional GETs: an ``ETag`` on a response, and ``304 Not Modified`` (no body) when the
client's ``If-None-Match`` names it.

For the pages that poll: the dashboard's page of an unfinished job asks for the job and its
timeline every two seconds, and a job's arguments can be a megabyte; with the tag, an
unchanged job costs a few hundred bytes a poll instead of the whole job each time.

The tag is a digest of the JSON body itself, so it changes exactly when the answer does
(whatever changed it: a status, a lease, a new event, the caller's role) and needs no
column of its own. The API's ``Cache-Control: no-store`` stays: nothing is kept by caches
between users; a client that wants the saving keeps the tag and sends it back.
"""

from __future__ import annotations

import hashlib
from typing import Any

import falcon

from . import media


def etag_of(body: bytes) -> str:
    """The entity tag of a response body (without its quotes)."""
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def respond(req: falcon.Request, resp: falcon.Response, value: Any) -> None:
    """Answer ``value`` as JSON with its ``ETag``, or 304 with no body when the request's
    ``If-None-Match`` has that tag (or ``*``). Tags are compared weakly (RFC 9110
    13.1.2): ``W/"x"`` matches ``"x"``."""
    body = media.dumps(value).encode("utf-8")
    tag = etag_of(body)
    resp.etag = tag
    wanted = req.if_none_match or ()
    if any(str(other) in ("*", tag) for other in wanted):
        resp.status = falcon.HTTP_304
        return
    resp.content_type = falcon.MEDIA_JSON
    resp.data = body
