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
    """One queue's unfinished and failed jobs.

    Attributes:
      queued(int): waiting and runnable now (``available_at`` has passed).
      delayed(int): waiting for a later ``available_at`` (a delay, an eta, a retry backoff).
      running(int): claimed by a worker.
      failed(int): in the dead-letter state.
      oldest_waiting_seconds(float): how long the oldest runnable job has been runnable
        (since its ``available_at``); 0 when none waits.
    """

    queued: int = 0
    delayed: int = 0
    running: int = 0
    failed: int = 0
    oldest_waiting_seconds: float = 0.0

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
        """Counts per queue, in one statement (:meth:`queues_statement`). A queue with no
        unfinished or failed job does not appear."""
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
        return {
            row.queue_name: QueueCounts(
                queued=row.queued,
                delayed=row.delayed,
                running=row.running,
                failed=row.failed,
                oldest_waiting_seconds=round(max(0.0, float(row.oldest or 0)), 3),
            )
            for row in rows
        }

    @staticmethod
    def queues_statement(now: dt.datetime | None = None) -> sa.Select:
        """The per-queue counts.

        ``status IN ('queued', 'running', 'failed')`` matches the predicates of the three
        partial indexes (claim order, lease expiry, dead letters), so PostgreSQL reads
        them and not the succeeded rows.
        """
        now_value = sa.literal(now, Timestamp) if now is not None else sa.func.now()
        queued = jobs.c.status == "queued"
        runnable = sa.and_(queued, jobs.c.available_at <= now_value)
        oldest = now_value - sa.func.min(jobs.c.available_at).filter(runnable)
        return (
            sa.select(
                jobs.c.queue_name,
                sa.func.count().filter(runnable).label("queued"),
                sa.func.count().filter(queued, jobs.c.available_at > now_value).label("delayed"),
                sa.func.count().filter(jobs.c.status == "running").label("running"),
                sa.func.count().filter(jobs.c.status == "failed").label("failed"),
                sa.func.extract("epoch", oldest).label("oldest"),
            )
            .where(
                sa.or_(
                    jobs.c.status == "queued", jobs.c.status == "running", jobs.c.status == "failed"
                )
            )
            .group_by(jobs.c.queue_name)
            .order_by(jobs.c.queue_name)
        )

    def throughput(self, *, minutes: int = 60, now: dt.datetime | None = None) -> dict[str, Any]:
        """Succeeded, failed and retried attempts per minute over the last ``minutes``.

        Reads the newest events backwards along the primary key (at most
        :data:`THROUGHPUT_MAX_EVENTS`), so a large history costs nothing.

        Returns:
          dict: ``since``, ``until`` (the minute boundaries), ``buckets`` (one per minute,
          oldest first, each ``{"at", "succeeded", "failed", "retried"}``, minutes without
          events included) and ``truncated`` (the window held more events than were read).
        """
        current = now or self._now()
        until = current.replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
        since = until - dt.timedelta(minutes=minutes)
        recent = (
            sa.select(job_events.c.type, job_events.c.created_at)
            .order_by(job_events.c.id.desc())
            .limit(THROUGHPUT_MAX_EVENTS)
            .subquery("recent")
        )
        minute = sa.func.date_trunc("minute", recent.c.created_at).label("minute")
        counts = (
            sa.select(
                minute,
                *(
                    sa.func.count().filter(recent.c.type == name).label(name)
                    for name in THROUGHPUT_TYPES
                ),
            )
            .where(recent.c.created_at >= sa.literal(since, Timestamp))
            .group_by(minute)
        )
        read = sa.select(sa.func.count(), sa.func.min(recent.c.created_at))
        with self.engine.connect() as conn:
            rows = {row.minute: row for row in conn.execute(counts)}
            n_read, oldest_read = conn.execute(read).one()
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
        truncated = (
            n_read >= THROUGHPUT_MAX_EVENTS and oldest_read is not None and oldest_read > since
        )
        return {"since": since, "until": until, "buckets": buckets, "truncated": truncated}

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
