"""Page links: opaque keyset cursors for the job list and the event feed."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import re
import uuid
from typing import Any
from urllib.parse import urlencode

import falcon

from .errors import ApiError, bad_request
from .queries import Cursor, JobCursor, JobPage

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


def job_links(
    req: falcon.Request, page: JobPage, *, limit: int, offset: int, cursor: JobCursor | None
) -> tuple[str | None, str | None]:
    """The ``next`` (older jobs) and ``previous`` (newer jobs) links of a job-list page.

    Both are keyset links (``cursor=...``), whatever the request used: a cursor is a
    position, so the next page costs the same however deep it is, and jobs created
    meanwhile do not shift it. ``offset`` is dropped from them.
    """
    results = page.results
    older = cursor is None or cursor.older
    following = preceding = None

    def link(direction_older: bool, job: dict[str, Any]) -> str:
        position = JobCursor(direction_older, job["created_at"], job["id"])
        return page_link(req, cursor=encode_job_cursor(position), offset=None, limit=limit)

    if results:
        if older:
            if page.more:
                following = link(True, results[-1])
            if cursor is not None or offset > 0:
                preceding = link(False, results[0])
        else:
            if page.more:
                preceding = link(False, results[0])
            following = link(True, results[-1])
    elif cursor is not None:
        # An empty page past either end: back the other way from the cursor itself.
        back = {"created_at": cursor.created_at, "id": cursor.id}
        if cursor.older:
            preceding = link(False, back)
        else:
            following = link(True, back)
    return following, preceding


def _encode(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _decode(raw: str) -> str:
    """The text of a cursor made by :func:`_encode`.

    Raises:
      binascii.Error, ValueError: it is not base64 of ASCII text.
    """
    return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode("ascii")


def _not_ours(newest: str) -> ApiError:
    return bad_request(
        "cursor is not one this API made: use the 'next' or 'previous' link of a response, "
        f"or leave cursor out for the newest {newest}"
    )


def encode_job_cursor(cursor: JobCursor) -> str:
    return _encode(f"{'o' if cursor.older else 'n'}|{cursor.created_at.isoformat()}|{cursor.id}")


def decode_job_cursor(raw: str) -> JobCursor:
    """The cursor made by :func:`encode_job_cursor`; a 400 (ApiError) for another."""
    try:
        direction, created_at, job_id = _decode(raw).split("|")
        when = dt.datetime.fromisoformat(created_at)
        if direction not in ("o", "n") or when.tzinfo is None or len(raw) > 200:
            raise ValueError(raw)
        return JobCursor(direction == "o", when, str(uuid.UUID(job_id)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise _not_ours("jobs") from None


def encode_cursor(cursor: Cursor) -> str:
    return _encode(f"{'o' if cursor.older else 'n'}:{cursor.event_id}")


def decode_cursor(raw: str) -> Cursor:
    """The cursor made by :func:`encode_cursor`; a 400 (ApiError) for another."""
    try:
        text = _decode(raw)
    except (binascii.Error, ValueError):
        text = ""
    match = _CURSOR_RE.match(text)
    if match is None or int(match.group(2)) > MAX_EVENT_ID:
        raise _not_ours("events")
    return Cursor(older=match.group(1) == "o", event_id=int(match.group(2)))
