"""Conditional GETs: an ``ETag`` on a response, and ``304 Not Modified`` (no body) when the
client's ``If-None-Match`` names it.

For the pages that poll: the dashboard's page of an unfinished job asks for the job and its
timeline every two seconds, and a job's arguments can be a megabyte; with the tag, an
unchanged job costs a few hundred bytes a poll instead of the whole job each time.

The tag is a digest of the JSON body itself, so it changes exactly when the answer does
(whatever changed it: a status, a new event, the caller's role) and needs no column of its
own. The API's ``Cache-Control: no-store`` stays: nothing is kept by caches between users;
a client that wants the saving keeps the tag and sends it back.

A running job is the exception: its worker's heartbeat moves ``locked_until`` every few
seconds without anything else changing, and a tag over the whole body would make every
renewal a full answer. The job's tag is therefore a weak one (``W/"..."``, RFC 9110
8.8.1) over everything but the lease expiry: a renewal alone is a 304, a real change (the
status, an attempt, an abort request, the worker) is a new tag. A client that wants the
current lease asks without ``If-None-Match``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import falcon

from . import media


def etag_of(body: bytes) -> str:
    """The entity tag of a response body (without its quotes)."""
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def respond(req: falcon.Request, resp: falcon.Response, value: Any, *, tagged: Any = None) -> None:
    """Answer ``value`` as JSON with its ``ETag``, or 304 with no body when the request's
    ``If-None-Match`` has that tag (or ``*``). Tags are compared weakly (RFC 9110
    13.1.2): ``W/"x"`` matches ``"x"``.

    Parameters:
      tagged: the part of ``value`` the tag stands for, when a change elsewhere in it is
        not worth a new answer (a job's lease expiry); the tag is then weak. By default the
        tag is the body's own, and strong.
    """
    body = media.dumps(value).encode("utf-8")
    if tagged is None:
        tag = etag_of(body)
        resp.etag = tag
    else:
        tag = etag_of(media.dumps(tagged).encode("utf-8"))
        resp.etag = f'W/"{tag}"'
    wanted = req.if_none_match or ()
    if any(str(other) in ("*", tag) for other in wanted):
        resp.status = falcon.HTTP_304
        return
    resp.content_type = falcon.MEDIA_JSON
    resp.data = body
