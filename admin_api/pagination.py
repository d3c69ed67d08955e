"""Page links: limit-offset for the job list, opaque cursors for the event feed."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any
from urllib.parse import urlencode

import falcon

from .errors import bad_request
from .queries import Cursor

_CURSOR_RE = re.compile(r"^([on]):(\d{1,19})$")
#: The largest event id (a bigint) a cursor may hold.
MAX_EVENT_ID = 2**63 - 1


def link_to(req: falcon.Request, path: str) -> str:
    """A link to ``path`` (``/api/...``, with its query string): under the configured
    public base URL (``DRAMATIQ_PG_PUBLIC_URL``) when there is one, else a relative
    reference (``/api/jobs?...``). Never built from the request's ``Host`` header, which
    the client chooses."""
    return getattr(req.context, "public_base", "") + req.root_path + path


def page_link(req: falcon.Request, **changes: Any) -> str:
    """This request's link with some query parameters replaced (None removes one)."""
    params = {name: value for name, value in req.params.items() if name not in changes}
    params.update({name: value for name, value in changes.items() if value is not None})
    query = urlencode(params, doseq=True)
    return link_to(req, req.path + (f"?{query}" if query else ""))


def offset_links(
    req: falcon.Request, *, count: int, limit: int, offset: int
) -> tuple[str | None, str | None]:
    """The ``next`` and ``previous`` links of a limit-offset page."""
    following = (
        page_link(req, limit=limit, offset=offset + limit) if offset + limit < count else None
    )
    if offset <= 0:
        preceding = None
    else:
        # Past the end, "previous" goes to the last page that has results.
        start = min(offset - limit, max(0, count - limit)) if count else 0
        preceding = page_link(req, limit=limit, offset=max(0, start) or None)
    return following, preceding


def encode_cursor(cursor: Cursor) -> str:
    text = f"{'o' if cursor.older else 'n'}:{cursor.event_id}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(raw: str) -> Cursor:
    """Read a cursor made by :func:`encode_cursor`.

    Raises:
      ApiError: 400 when it is not one.
    """
    try:
        text = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode("ascii")
    except (binascii.Error, ValueError):
        text = ""
    match = _CURSOR_RE.match(text)
    if match is None or int(match.group(2)) > MAX_EVENT_ID:
        raise bad_request(
            "cursor is not one this API made: use the 'next' or 'previous' link of a "
            "response, or leave cursor out for the newest events"
        )
    return Cursor(older=match.group(1) == "o", event_id=int(match.group(2)))
