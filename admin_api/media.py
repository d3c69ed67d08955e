"""JSON in and out.

Out: datetimes as ISO 8601 with their offset, UUIDs as strings, bytes never (the API shows
binary messages as opaque). In: standard JSON only, so ``NaN`` and ``Infinity`` (which
Python's parser accepts but PostgreSQL's jsonb does not) are malformed input, and so is
nesting deep enough to exhaust the parser.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import uuid
from typing import Any

import falcon
import falcon.media


def _default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str) -> Any:
    """Parse standard JSON; raises ValueError for anything else (Falcon turns it into a
    400)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None


dumps = functools.partial(json.dumps, default=_default, ensure_ascii=False)


def json_handler() -> falcon.media.JSONHandler:
    return falcon.media.JSONHandler(dumps=dumps, loads=loads)


def install(app: falcon.App) -> None:
    """Use this JSON for request bodies and responses."""
    handler = json_handler()
    extra = {falcon.MEDIA_JSON: handler, "application/json; charset=UTF-8": handler}
    app.req_options.media_handlers.update(extra)
    app.resp_options.media_handlers.update(extra)
