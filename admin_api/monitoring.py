"""The numbers operators watch, read cheaply: per-queue counts of unfinished and failed
jobs, the age of the oldest waiting job, recent throughput, and new events since a cursor.

Shared by the dashboard's endpoints (``/api/queues``, ``/api/throughput``) and by
``/metrics``. Every query here reads a partial index or a bounded range of the events'
primary key, never the finished rows of a big ``jobs`` table, so its cost follows the
backlog and the recent traffic, not the history.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from dramatiq_pg_broker import events as event_types

from .tables import Timestamp, job_events, jobs
from .tables import queues as queues_table

#: The most recent events the throughput chart reads (newest first, along the primary key).
#: A busier hour than this shows only its most recent part, and says so (``truncated``).
THROUGHPUT_MAX_EVENTS = 200_000

#: Events younger than this are left for the next read of :meth:`Monitor.new_events`:
#: event ids are taken at insert, so an id can become visible after a higher one has been
#: read; a transaction that writes an event commits well within this time.
EVENT_SETTLE_SECONDS = 5.0

#: The prefix of the error the reaper records when a lease expired (see ``reap_expired``).
LEASE_EXPIRED_PREFIX = "lease expired:"

#: The event types a throughput bucket counts.
THROUGHPUT_TYPES = (
    event_types.SUCCEEDED,
    event_types.FAILED,
    event_types.RETRY_SCHEDULED,
)


@dataclasses.dataclass
class QueueCounts:
    """One queue's unfinished and failed jobs, and its state.

    Attributes:
      queued(int): waiting and runnable now (``available_at`` has passed).
      delayed(int): waiting for a later ``available_at`` (a delay, an eta, a retry backoff).
      running(int): claimed by a worker.
      failed(int): in the dead-letter state.
      oldest_waiting_seconds(float): how long the oldest runnable job has been runnable
        (since its ``available_at``); 0 when none waits.
      declared(bool): a worker declared the queue (see :mod:`dramatiq_pg_broker.queues`);
        False for a queue that only has jobs (sent to a queue no worker consumes).
      paused(bool), paused_at(datetime), paused_by(str): whether an operator paused it,
        when and who.
    """

    queued: int = 0
    delayed: int = 0
    running: int = 0
    failed: int = 0
    oldest_waiting_seconds: float = 0.0
    declared: bool = True
    paused: bool = False
    paused_at: dt.datetime | None = None
    paused_by: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    """

    def __init__(self, engine: Engine, schema: str) -> None:
        self.schema = schema
        self.engine = engine.execution_options(schema_translate_map={None: schema})

    def queues(self, *, now: dt.datetime | None = None) -> dict[str, QueueCounts]:
        """Counts per queue (:meth:`queues_statement`) and the state of every declared
        queue: a declared queue appears even with no job; a queue with jobs that no worker
        declared appears with ``declared`` False."""
        with self.engine.connect() as conn:
            return self._queues(conn, now)

    def scrape(self, cursor: int | None, *, settle: float = EVENT_SETTLE_SECONDS):
        """What a metrics scrape reads, on one connection: the per-queue counts and the
        events after ``cursor`` (with no cursor yet, only the newest event's id, where
        counting starts).

        Returns:
          tuple: the counts per queue (dict of :class:`QueueCounts`) and :class:`NewEvents`.
        """
        with self.engine.connect() as conn:
            queues = self._queues(conn, None)
            if cursor is None:
                newest = conn.execute(sa.select(sa.func.max(job_events.c.id))).scalar() or 0
                return queues, NewEvents(counts={}, lease_expiries=0, cursor=newest)
            return queues, self._new_events(conn, cursor, settle)

    def _queues(self, conn, now: dt.datetime | None) -> dict[str, QueueCounts]:
        rows = conn.execute(self.queues_statement(now)).all()
        declared = conn.execute(
            sa.select(
                queues_table.c.queue_name,
                queues_table.c.paused,
                queues_table.c.paused_at,
                queues_table.c.paused_by,
            )
        ).all()
        found = {
            row.queue_name: QueueCounts(
                queued=int(row.queued),
                delayed=int(row.delayed),
                running=int(row.running),
                failed=int(row.failed),
                oldest_waiting_seconds=round(max(0.0, float(row.oldest or 0)), 3),
                declared=False,
            )
            for row in rows
        }
        for row in declared:
            counts = found.setdefault(row.queue_name, QueueCounts())
            counts.declared = True
            counts.paused = bool(row.paused)
            counts.paused_at = row.paused_at
            counts.paused_by = row.paused_by
        return dict(sorted(found.items()))

    @staticmethod
    def queues_statement(now: dt.datetime | None = None) -> sa.Select:
        """The per-queue counts: three aggregates, one per partial index, added up.

        Each part's ``status = ...`` is the predicate of a partial index (claim order,
        lease expiry, dead letters), so PostgreSQL reads those indexes and never the
        succeeded rows. The waiting jobs, usually the most numerous, are counted from the
        claim-order index alone (an index-only scan: it holds queue_name and
        available_at), grouped in index order.
        """
        now_value = sa.literal(now, Timestamp) if now is not None else sa.func.now()
        runnable = jobs.c.available_at <= now_value
        zero = sa.literal(0, sa.BigInteger)
        no_time = sa.null().cast(Timestamp)
        waiting = (
            sa.select(
                jobs.c.queue_name,
                sa.func.count().filter(runnable).label("queued"),
                sa.func.count().filter(sa.not_(runnable)).label("delayed"),
                zero.label("running"),
                zero.label("failed"),
                sa.func.min(jobs.c.available_at).filter(runnable).label("oldest_at"),
            )
            .where(jobs.c.status == "queued")
            .group_by(jobs.c.queue_name)
        )

        def other(status: str) -> sa.Select:
            return (
                sa.select(
                    jobs.c.queue_name,
                    zero,
                    zero,
                    sa.func.count() if status == "running" else zero,
                    sa.func.count() if status == "failed" else zero,
                    no_time,
                )
                .where(jobs.c.status == status)
                .group_by(jobs.c.queue_name)
            )

        parts = sa.union_all(waiting, other("running"), other("failed")).subquery("parts")
        oldest = now_value - sa.func.min(parts.c.oldest_at)
        return (
            sa.select(
                parts.c.queue_name,
                sa.func.sum(parts.c.queued).label("queued"),
                sa.func.sum(parts.c.delayed).label("delayed"),
                sa.func.sum(parts.c.running).label("running"),
                sa.func.sum(parts.c.failed).label("failed"),
                sa.func.extract("epoch", oldest).label("oldest"),
            )
            .group_by(parts.c.queue_name)
            .order_by(parts.c.queue_name)
        )

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
                    job_events.c.data["error"].astext.startswith(LEASE_EXPIRED_PREFIX),
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

    def _now(self) -> dt.datetime:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.now())).scalar_one()
