"""Job rows and their events in PostgreSQL's binary COPY format (its documented
``COPY BINARY`` layout): what the direct bulk path of a send writes."""

from __future__ import annotations

import datetime as dt
import struct
from typing import Any

import psycopg
from psycopg.copy import LibpqWriter

# -- binary COPY rows (PostgreSQL's documented COPY BINARY format) ---------------------------

#: The header of a binary COPY: signature, flags, header extension length.
_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" * 2
#: The end of a binary COPY: a field count of -1.
_COPY_TRAILER = b"\xff\xff"
_NULL_FIELD = b"\xff\xff\xff\xff"
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
_LENGTH = struct.Struct(">i")
#: 13 fields, then the 16 bytes of the uuid.
_JOB_ROW_START = struct.Struct(">hi").pack(13, 16)
#: priority, available_at, max_attempts.
_JOB_ROW_MIDDLE = struct.Struct(">iiiqii")
_TIMESTAMP = struct.Struct(">iq")
#: 4 fields, then the 16 bytes of the uuid.
_EVENT_ROW_START = struct.Struct(">hi").pack(4, 16)
#: type 'created', attempt 0, then created_at.
_CREATED_EVENT_MIDDLE = _LENGTH.pack(7) + b"created" + struct.Struct(">ii").pack(4, 0)


def _text_field(text: str) -> bytes:
    data = text.encode("utf-8")
    return _LENGTH.pack(len(data)) + data


#: The status of every copied row, written out (the column's default refuses a send that
#: leaves it out: migration 0022).
_QUEUED_FIELD = _text_field("queued")


def _timestamp_us(value: dt.datetime) -> int:
    """A timestamptz as binary COPY holds it: microseconds since 2000-01-01 UTC."""
    return (value - _PG_EPOCH) // dt.timedelta(microseconds=1)


def _buffering_writer(cursor: psycopg.Cursor) -> Any:
    """A COPY writer that hands the data to libpq without waiting for it to reach the
    server (psycopg's default waits for a full flush after every megabyte): the direct
    bulk path then encodes the next chunk at once, and pushes the buffered data out as it
    goes (see :attr:`JobStore.COPY_PUMP_ROWS`); the COPY's end waits for all of it. None
    (psycopg's default writer) where this psycopg has no flush threshold."""
    try:
        return LibpqWriter(cursor, flush_threshold=1 << 62)
    except TypeError:  # pragma: no cover - psycopg without flush_threshold
        return None
