"""Which partitions of history a send probes for its job's id.

A send inserts its job only if no finished job has the same id (ids stay unique across the
jobs table and ``jobs_history``, see migration 0012). Written against the partitioned
parent, that probe costs more than the rest of the send: a prepared statement's generic
plan locks every partition of ``jobs_history`` at each execution (PostgreSQL prunes them
only after locking), and history has three per UTC day kept (one per terminal status), so
the cost grows with the retention. Measured on one send, server CPU per statement: 487 us
against the parent, 320 us naming today's three partitions, 317 us with no probe at all.

A job cannot finish before its message was built, so a message stamped at ``sent_at``
can only collide with a finished job of ``finished_at >= sent_at - 1 h`` (the hour covers
clocks that differ between sender and server), up to now. When that span lies in today
and tomorrow (UTC, by this process's clock plus the same hour), and their daily partitions
exist, the send reads those partitions by name: a row that finished on such a day is in
its day's partition (a DEFAULT partition never holds rows of a day whose partition
exists: PostgreSQL refuses to create it while it does). Otherwise the send reads the
parent, as before: messages without a usable timestamp, messages stamped more than an
hour before today began (a send in the first hour of a UTC day, a message sent again
days later), sends with an injected clock (tests), and days whose partitions do not exist
(maintenance off or behind).

Today's and tomorrow's partitions are never dropped by retention (it drops only days
wholly past their age). One dropped by hand makes the statement fail with
``UndefinedTable``: a send on the pool's connection forgets what it knew and sends again
against the parent; a send inside the caller's transaction raises (the transaction is
aborted, nothing was written).
"""

from __future__ import annotations

import datetime as dt
import threading
import time

import psycopg
from psycopg import sql

# Clocks of sender and server may differ by this much (milliseconds); defined with the
# statements that share it.
from ..db.queries import CLOCK_SLACK_MS

#: The terminal statuses: one partition of history per status and day.
STATUSES = ("succeeded", "failed", "cancelled")


#: A day whose partitions were missing is looked up again after this long (seconds).
RECHECK_MISSING = 60.0

_DAY_MS = 86_400_000


class HistoryProbe:
    """The relation a send's history probe reads, per schema, cached per UTC day.

    Parameters:
      schema(str): the broker's schema.
    """

    def __init__(self, schema: str) -> None:
        self.schema = schema
        #: The probe's relation as the send statements write it, replaced by :meth:`statement`.
        self.parent = sql.SQL("{}.jobs_history AS h").format(sql.Identifier(schema)).as_string(None)
        self._lock = threading.Lock()
        #: day -> the partitions' relation text, or (None, when it was found missing).
        self._days: dict[dt.date, tuple[str | None, float]] = {}
        self._texts: dict[tuple[str, tuple[dt.date, ...]], str] = {}

    def days(self, sent_at_ms: int | None, now_ms: int | None = None) -> tuple[dt.date, ...]:
        """The UTC days a send stamped ``sent_at_ms`` must probe by name, or ``()`` when it
        must read the parent."""
        if sent_at_ms is None:
            return ()
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        today = _day(now_ms)
        first = _day(sent_at_ms - CLOCK_SLACK_MS)
        last = _day(max(sent_at_ms, now_ms) + CLOCK_SLACK_MS)
        if first < today or (last - today).days > 1:
            return ()
        first = today
        return tuple(first + dt.timedelta(days=n) for n in range((last - first).days + 1))

    def statement(
        self, conn: psycopg.Connection, name: str, text: str, sent_at_ms: int | None
    ) -> str:
        """``text`` (the statement ``name``) with its history probe on the partitions of
        the days :meth:`days` names, when they all exist; else ``text`` as it is."""
        days = self.days(sent_at_ms)
        if not days:
            return text
        parts = [self._partitions(conn, day) for day in days]
        if None in parts:
            return text
        key = (name, days)
        cached = self._texts.get(key)
        if cached is None:
            union = " UNION ALL ".join(parts)  # type: ignore[arg-type]
            cached = text.replace(self.parent, f"({union}) AS h")
            if len(self._texts) > 64:
                self._texts.clear()
            self._texts[key] = cached
        return cached

    def forget(self) -> None:
        """A partition named by a statement is gone: look every day up again."""
        with self._lock:
            self._days.clear()
            self._texts.clear()

    def _partitions(self, conn: psycopg.Connection, day: dt.date) -> str | None:
        known = self._days.get(day)
        if known is not None and (
            known[0] is not None or time.monotonic() - known[1] < RECHECK_MISSING
        ):
            return known[0]
        names = [f"jobs_history_{status}_{day:%Y%m%d}" for status in STATUSES]
        # Attached partitions only: a day's table exists before it is attached (migration
        # 0013 prepares it, then attaches it), and until then the day's rows are in DEFAULT.
        found = conn.execute(
            "SELECT count(*) FROM unnest(%(names)s::text[]) AS n"
            " JOIN pg_class AS c ON c.oid = to_regclass(format('%%I.%%I', %(schema)s::text, n))"
            " WHERE c.relispartition",
            {"schema": self.schema, "names": names},
        ).fetchone()
        relation = None
        if found is not None and found[0] == len(names):
            relation = " UNION ALL ".join(
                sql.SQL("SELECT id, finished_at FROM {}")
                .format(sql.Identifier(self.schema, n))
                .as_string(None)
                for n in names
            )
        with self._lock:
            if len(self._days) > 8:
                self._days.clear()
            self._days[day] = (relation, time.monotonic())
        return relation


def _day(ms: int) -> dt.date:
    return dt.date(1970, 1, 1) + dt.timedelta(days=ms // _DAY_MS)
