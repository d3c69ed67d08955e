"""The numbers operators watch, read cheaply: per-queue counts of unfinished and failed
jobs, the age of the oldest waiting job, recent throughput, new events since a cursor, and
the database's health as ``dramatiq-pg-broker doctor`` examines it (:meth:`Monitor.health`).

Shared by the dashboard's endpoints (``/api/queues``, ``/api/throughput``) and by
``/metrics``. Every query here reads a partial index or a bounded range of the events'
primary key, never the finished rows of a big ``jobs`` table, so its cost follows the
backlog and the recent traffic, not the history.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from dramatiq_pg_broker import events as event_types
from dramatiq_pg_broker.control import overview
from dramatiq_pg_broker.control.overview import QueueOverview
from dramatiq_pg_broker.health.doctor import STATEMENT_TIMEOUT_MS, Report, examine
from dramatiq_pg_broker.jobs import LEASE_EXPIRED

from .tables import Timestamp, job_events

__all__ = ["Monitor", "NewEvents", "QueueOverview"]

#: The most recent events the throughput chart reads (newest first, along the primary key).
#: A busier hour than this shows only its most recent part, and says so (``truncated``).
THROUGHPUT_MAX_EVENTS = 200_000

#: Events younger than this are left for the next read of :meth:`Monitor.new_events`:
#: event ids are taken at insert, so an id can become visible after a higher one has been
#: read; a transaction that writes an event commits well within this time.
EVENT_SETTLE_SECONDS = 5.0

#: The event types a throughput bucket counts.
THROUGHPUT_TYPES = (
    event_types.SUCCEEDED,
    event_types.FAILED,
    event_types.RETRY_SCHEDULED,
)


@dataclasses.dataclass
class NewEvents:
    """Events written after a cursor, counted by type.

    Attributes:
      counts(dict): events per type.
      lease_expiries(int): attempts whose lease expired (requeued or, out of attempts,
        failed).
      cursor(int): the id to read after next time.
    """

    counts: dict[str, int]
    lease_expiries: int
    cursor: int


class Monitor:
    """The monitoring reads over one schema.

    Parameters:
      engine(Engine): a SQLAlchemy engine on the database.
      schema(str): the schema of the tables.
      lease_seconds(float): the workers' lease (the doctor's rule for a lease that ran
        out, see :meth:`health`).
      statement_timeout_ms(int): how long a statement of :meth:`health` may run.
    """

    def __init__(
        self,
        engine: Engine,
        schema: str,
        *,
        lease_seconds: float = 30.0,
        statement_timeout_ms: int = STATEMENT_TIMEOUT_MS,
    ) -> None:
        self.schema = schema
        self.lease_seconds = lease_seconds
        self.statement_timeout_ms = statement_timeout_ms
        self.engine = engine.execution_options(schema_translate_map={None: schema})

    def queues(self, *, now: dt.datetime | None = None) -> dict[str, QueueOverview]:
        """Every queue as the broker's overview reads it (see
        :mod:`dramatiq_pg_broker.control.overview`, the CLI's ``stats`` read): its jobs in
        each state, its pause, its limit, its live workers."""
        with self.engine.connect() as conn:
            return self._queues(conn, now)

    def queue(self, name: str) -> QueueOverview | None:
        """One queue as :meth:`queues` shows it (None: no such queue)."""
        with self.engine.connect() as conn:
            return overview.queue(_driver(conn), self.schema, name)

    def queue_throughput(self, name: str, *, minutes: int = 60) -> dict[str, Any]:
        """A queue's finished jobs per minute (see
        :func:`dramatiq_pg_broker.control.overview.throughput`)."""
        with self.engine.connect() as conn:
            return overview.throughput(_driver(conn), self.schema, name, minutes=minutes)

    def scrape(self, cursor: int | None, *, settle: float = EVENT_SETTLE_SECONDS):
        """What a metrics scrape reads, on one connection: every queue and the events
        after ``cursor`` (with no cursor yet, only the newest event's id, where counting
        starts).

        Returns:
          tuple: the queues (dict of :class:`QueueOverview`) and :class:`NewEvents`.
        """
        with self.engine.connect() as conn:
            queues = self._queues(conn, None)
            if cursor is None:
                newest = conn.execute(sa.select(sa.func.max(job_events.c.id))).scalar() or 0
                return queues, NewEvents(counts={}, lease_expiries=0, cursor=newest)
            return queues, self._new_events(conn, cursor, settle)

    def _queues(self, conn, now: dt.datetime | None) -> dict[str, QueueOverview]:
        return overview.overview(_driver(conn), self.schema, now=now)

    def throughput(self, *, minutes: int = 60, now: dt.datetime | None = None) -> dict[str, Any]:
        """Succeeded, failed and retried attempts per minute over the last ``minutes``.

        Events carry no time index, but their ids grow with time: a binary search of the
        primary key (a few dozen one-row probes) finds the first event of the window, and
        the counts read from there on (at most the newest :data:`THROUGHPUT_MAX_EVENTS`),
        so the history before the window costs nothing.

        Returns:
          dict: ``since``, ``until`` (the minute boundaries), ``buckets`` (one per minute,
          oldest first, each ``{"at", "succeeded", "failed", "retried"}``, minutes without
          events included) and ``truncated`` (the window held more events than were read).
        """
        with self.engine.connect() as conn:
            current = now or conn.execute(sa.select(sa.func.now())).scalar_one()
            until = current.replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
            since = until - dt.timedelta(minutes=minutes)
            first = self._first_event_at(conn, since)
            rows: dict[dt.datetime, Any] = {}
            n_read = 0
            if first is not None:
                recent = (
                    sa.select(job_events.c.type, job_events.c.created_at)
                    .where(job_events.c.id >= first)
                    .order_by(job_events.c.id.desc())
                    .limit(THROUGHPUT_MAX_EVENTS)
                    .cte("recent")
                )
                minute = sa.func.date_trunc("minute", recent.c.created_at).label("minute")
                in_window = recent.c.created_at >= sa.literal(since, Timestamp)
                counts = sa.select(
                    minute,
                    sa.func.sum(sa.func.count()).over().label("n_read"),
                    *(
                        sa.func.count().filter(recent.c.type == name, in_window).label(name)
                        for name in THROUGHPUT_TYPES
                    ),
                ).group_by(minute)
                for row in conn.execute(counts):
                    rows[row.minute] = row
                    n_read = int(row.n_read)
        buckets = []
        for i in range(minutes):
            at = since + dt.timedelta(minutes=i)
            row = rows.get(at)
            buckets.append(
                {
                    "at": at,
                    "succeeded": row.succeeded if row else 0,
                    "failed": row.failed if row else 0,
                    "retried": row.retry_scheduled if row else 0,
                }
            )
        return {
            "since": since,
            "until": until,
            "buckets": buckets,
            "truncated": n_read >= THROUGHPUT_MAX_EVENTS,
        }

    @staticmethod
    def _first_event_at(conn, since: dt.datetime) -> int | None:
        """The smallest event id written at or after ``since`` (None: no such event),
        by bisecting the primary key; each probe reads one index entry and its row."""
        low, high = conn.execute(
            sa.select(sa.func.min(job_events.c.id), sa.func.max(job_events.c.id))
        ).one()
        if high is None:
            return None
        probe = (
            sa.select(job_events.c.id, job_events.c.created_at)
            .where(job_events.c.id >= sa.bindparam("at"))
            .order_by(job_events.c.id)
            .limit(1)
        )
        newest = conn.execute(probe, {"at": high}).one()
        if newest.created_at < since:
            return None
        while low < high:
            middle = (low + high) // 2
            found = conn.execute(probe, {"at": middle}).one()
            if found.created_at < since:
                low = found.id + 1
            else:
                high = middle
        return low

    def last_event_id(self) -> int:
        """The newest event's id (0 when there is none): one probe of the primary key."""
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.max(job_events.c.id))).scalar() or 0

    def new_events(self, cursor: int, *, settle: float = EVENT_SETTLE_SECONDS) -> NewEvents:
        """Events with ids above ``cursor`` and older than ``settle`` seconds, by type.

        Only the run of ids up to the first unsettled event is counted, so an event whose
        transaction commits late is never skipped: it is counted the next time.
        One range scan of the primary key, as long as the events written since ``cursor``.
        """
        with self.engine.connect() as conn:
            return self._new_events(conn, cursor, settle)

    def _new_events(self, conn, cursor: int, settle: float) -> NewEvents:
        counts: dict[str, int] = {}
        lease_expiries = 0
        newest = cursor
        for type_, lease, n, last in conn.execute(self.new_events_statement(cursor, settle)):
            counts[type_] = counts.get(type_, 0) + n
            if type_ == event_types.TIMEOUT_REQUEUED or lease:
                lease_expiries += n
            newest = max(newest, last)
        return NewEvents(counts=counts, lease_expiries=lease_expiries, cursor=newest)

    @staticmethod
    def new_events_statement(cursor: int, settle: float) -> sa.Select:
        """Counts by type (and whether a failure was a lost lease) of the settled run of
        events after ``cursor``, with the run's last id."""
        fresh = (
            sa.select(
                job_events.c.id,
                job_events.c.type,
                sa.and_(
                    job_events.c.type == event_types.FAILED,
                    job_events.c.data["error"].astext.startswith(LEASE_EXPIRED),
                ).label("lease"),
                job_events.c.created_at,
            )
            .where(job_events.c.id > cursor)
            .cte("fresh")
        )
        settled_before = sa.func.now() - sa.literal(dt.timedelta(seconds=settle))
        stop = (
            sa.select(sa.func.min(fresh.c.id))
            .where(fresh.c.created_at >= settled_before)
            .scalar_subquery()
        )
        return (
            sa.select(fresh.c.type, fresh.c.lease, sa.func.count(), sa.func.max(fresh.c.id))
            .where(sa.or_(stop.is_(None), fresh.c.id < stop))
            .group_by(fresh.c.type, fresh.c.lease)
        )

    def health(self, checks: Iterable[str] | None = None) -> Report:
        """The checks of ``dramatiq-pg-broker doctor`` (all of them, or ``checks``), on one
        of the engine's connections (:func:`dramatiq_pg_broker.health.doctor.examine`: one
        read-only transaction of its own)."""
        with self.engine.connect() as conn:
            return examine(
                conn.connection.driver_connection,
                self.schema,
                checks=checks,
                lease_seconds=self.lease_seconds,
                statement_timeout_ms=self.statement_timeout_ms,
            )

    def _now(self) -> dt.datetime:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.now())).scalar_one()


def _driver(conn) -> Any:
    """The psycopg connection under a SQLAlchemy one: the broker's reads take it."""
    return conn.connection.driver_connection
