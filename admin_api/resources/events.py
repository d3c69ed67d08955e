"""``GET /api/job-events``: every job's events, newest first, a cursor page at a time.

A cursor rather than an offset because events are appended while people page: with an
offset each new event would shift the pages and show a row twice; a cursor is a position
(an event id), so pages stay put.
"""

from __future__ import annotations

from typing import Literal

import falcon
from pydantic import Field

from dramatiq_pg_broker.events import ALL as EVENT_TYPES

from .. import responses
from ..auth import READERS, owner_scope
from ..operations import operation
from ..pagination import MAX_EVENT_ID, decode_cursor, encode_cursor, page_link
from ..queries import Cursor, JobQueries
from ..validation import Params, QueryInt, QueryUuid

DEFAULT_LIMIT = 50
MAX_LIMIT = 200


class FeedParams(Params):
    """The filters and the page of ``GET /api/job-events``."""

    limit: QueryInt = Field(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT, description="Page size.")
    cursor: str = Field(None, description="From a next/previous link.")
    type: Literal[EVENT_TYPES] = Field(None, description="Exact event type.")
    job_id: QueryUuid = Field(None, description="One job.")


class EventFeed:
    route = "/api/job-events"

    def __init__(self, queries: JobQueries) -> None:
        self.queries = queries

    @operation(
        roles=READERS,
        scope="members: events of their jobs",
        summary="Every job's events, newest first, with cursor pages.",
        description="Follow next/previous; a cursor is opaque.",
        query=FeedParams,
        responses={200: (responses.EventPage, "One page of events.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response, query: FeedParams) -> None:
        params = query
        limit = params.limit
        cursor = decode_cursor(params.cursor) if params.cursor else None
        results, more = self.queries.event_feed(
            limit=limit,
            cursor=cursor,
            event_type=params.type,
            job_id=params.job_id,
            owner_id=owner_scope(req.context.user),
        )

        def link(older: bool, event_id: int) -> str:
            return page_link(req, cursor=encode_cursor(Cursor(older, event_id)))

        following = preceding = None
        if cursor is None or cursor.older:
            if more:
                following = link(True, results[-1]["id"])
            if cursor is not None:
                # Back towards the newest: everything above this page's first event (or,
                # on an empty page, everything from the cursor up).
                preceding = link(
                    False, results[0]["id"] if results else max(cursor.event_id - 1, 0)
                )
        else:
            if more:
                preceding = link(False, results[0]["id"])
            following = link(
                True, results[-1]["id"] if results else min(cursor.event_id + 1, MAX_EVENT_ID)
            )
        resp.media = {"next": following, "previous": preceding, "results": results}
