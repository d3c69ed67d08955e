"""A queue as an operator sees it: its jobs in each state, whether it is paused and by
whom, its limit and who set it, the live workers that consume it, and why its jobs wait.

One read for every view of the queues: the CLI's ``stats``, ``queues list`` and ``queues
show``, the admin API's ``GET /api/queues`` and ``GET /api/queues/{name}``, the
dashboard's overview and queue page (through the API) and ``/metrics``. The counts are the
job store's (``count_by_queue``, named by :mod:`..jobs.states`); the rest are the small
tables of queue control (pauses, limits, the worker registry). A queue appears when a
worker declared it, when it has unfinished or failed jobs, or when it has a limit (one set
with ``--force`` before any worker declared it).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import psycopg

from ..db.queries import statements_for
from ..jobs.states import QueueCounts, queue_counts_of
from . import limits as queue_limits
from . import queues as queue_control
from .workers import live_workers

#: The most recent finished jobs :func:`throughput` counts: a busier window shows only its
#: most recent part, and says so (``truncated``).
THROUGHPUT_MAX_ROWS = 100_000

#: How a queue stands (:attr:`QueueOverview.state`).
ACTIVE = "active"
PAUSED = "paused"
NO_WORKER = "no_worker"
UNDECLARED = "undeclared"
STATES = (ACTIVE, PAUSED, NO_WORKER, UNDECLARED)


@dataclasses.dataclass
class QueueOverview:
    """One queue (see the module docstring).

    Attributes:
      queue_name(str): its name.
      jobs(QueueCounts): its jobs by state.
      declared(bool): a worker declared it (or an operator paused it ahead of its workers).
      pause(QueueState): its row of queue control (None: not declared).
      limit(QueueLimit): its limit and who set it (None: none).
      live_workers(int): live worker processes that consume it now.
    """

    queue_name: str
    jobs: QueueCounts
    pause: queue_control.QueueState | None = None
    limit: queue_limits.QueueLimit | None = None
    live_workers: int = 0

    @property
    def declared(self) -> bool:
        return self.pause is not None

    @property
    def paused(self) -> bool:
        return self.pause is not None and self.pause.paused

    @property
    def state(self) -> str:
        """``paused``, ``undeclared`` (no worker declared it), ``no_worker`` (declared,
        but no live worker consumes it now) or ``active``."""
        if self.paused:
            return PAUSED
        if not self.declared:
            return UNDECLARED
        return NO_WORKER if not self.live_workers else ACTIVE

    def waiting_because(self) -> list[dict[str, str]]:
        """Why its jobs wait, most blocking first: each ``{"reason", "text"}``, the reason
        one of ``paused``, ``undeclared``, ``no_worker``, ``limit``, ``lease_expired`` and
        ``delayed``. Empty when no job waits or nothing holds the waiting ones back but
        the work ahead of them."""
        jobs = self.jobs
        if not jobs.waiting and not jobs.lease_expired:
            return []
        found = []
        if self.paused:
            who = self.pause.paused_by if self.pause is not None else None
            when = _when(self.pause.paused_at if self.pause is not None else None)
            found.append(
                (
                    "paused",
                    f"paused by {who} since {when}: no worker claims its jobs until it is resumed",
                )
            )
        if not self.declared:
            found.append(
                (
                    "undeclared",
                    "no worker has declared this queue: check the name its jobs were sent "
                    "to, or start a worker that consumes it",
                )
            )
        elif not self.live_workers:
            found.append(("no_worker", "no live worker process consumes this queue"))
        # A job whose lease ran out holds no place under the limit (limited_queue_room).
        if self.limit is not None and jobs.running >= self.limit.limit and jobs.waiting:
            found.append(("limit", f"at its limit: {jobs.running} of {self.limit.limit} running"))
        if jobs.lease_expired:
            found.append(
                (
                    "lease_expired",
                    f"{jobs.lease_expired} job(s) lost their worker (lease expired): a worker's "
                    "reaper takes them back, or an operator requeues them now",
                )
            )
        if jobs.delayed:
            found.append(
                (
                    "delayed",
                    f"{jobs.delayed} job(s) delayed, the next runnable at "
                    f"{_when(jobs.next_delayed_at)}",
                )
            )
        return [{"reason": reason, "text": text} for reason, text in found]

    def as_dict(self) -> dict[str, Any]:
        """The queue as the API and ``--json`` show it. ``queued``, ``delayed``,
        ``running`` and ``failed`` are the counts of earlier releases, kept for their
        readers: ``queued`` is ready + paused (runnable now), ``running`` running +
        lease expired (claimed)."""
        pause = self.pause
        limit = self.limit
        jobs = self.jobs
        return {
            "queue_name": self.queue_name,
            "state": self.state,
            "declared": self.declared,
            "paused": self.paused,
            "paused_at": pause.paused_at if pause and pause.paused else None,
            "paused_by": pause.paused_by if pause and pause.paused else None,
            "resumed_at": pause.resumed_at if pause else None,
            "resumed_by": pause.resumed_by if pause else None,
            "limit": limit.limit if limit else None,
            "limit_source": limit.source if limit else None,
            "limit_set_by": limit.set_by if limit else None,
            "limit_set_at": limit.set_at if limit else None,
            "live_workers": self.live_workers,
            "jobs": jobs.as_dict(),
            "oldest_waiting_seconds": jobs.oldest_waiting_seconds,
            "next_delayed_at": jobs.next_delayed_at,
            "waiting_because": self.waiting_because(),
            "queued": jobs.ready + jobs.paused,
            "delayed": jobs.delayed,
            "running": jobs.running + jobs.lease_expired,
            "failed": jobs.failed,
        }


def _when(at: dt.datetime | None) -> str:
    return at.isoformat(timespec="seconds") if at is not None else "?"


def overview(
    conn: psycopg.Connection,
    schema: str,
    *,
    now: dt.datetime | None = None,
    failed: bool = True,
) -> dict[str, QueueOverview]:
    """Every queue (see the module docstring), by name: four reads on ``conn`` (the counts,
    the pauses, the limits, the live workers).

    Parameters:
      conn(psycopg.Connection): where to read.
      schema(str): the broker's schema.
      now(datetime): the clock to count with (default: the server's).
      failed(bool): count the failed jobs (a count of their partitions of history).
    """
    rows = conn.execute(
        statements_for(schema)["count_by_queue"], {"now": now, "failed": failed}
    ).fetchall()
    counts = queue_counts_of(rows)
    pauses = {state.queue_name: state for state in queue_control.states(conn, schema)}
    limits = queue_limits.all_limits(conn, schema)
    live = live_workers(conn, schema)
    names = sorted(set(counts) | set(pauses) | set(limits))
    return {
        name: QueueOverview(
            queue_name=name,
            jobs=counts.get(name) or QueueCounts(),
            pause=pauses.get(name),
            limit=limits.get(name),
            live_workers=live.get(name, 0),
        )
        for name in names
    }


def queue(
    conn: psycopg.Connection, schema: str, name: str, *, now: dt.datetime | None = None
) -> QueueOverview | None:
    """One queue as :func:`overview` shows it; None when it is unknown (no worker declared
    it, it has no unfinished or failed job and no limit)."""
    return overview(conn, schema, now=now).get(name)


def throughput(
    conn: psycopg.Connection, schema: str, name: str, *, minutes: int = 60
) -> dict[str, Any]:
    """A queue's finished jobs per minute over the last ``minutes`` (by the server's
    clock): ``since``, ``until`` (minute boundaries), ``buckets`` (one per minute, oldest
    first, each ``{"at", "succeeded", "failed"}``), the totals ``succeeded`` and ``failed``,
    and ``truncated`` (more than :data:`THROUGHPUT_MAX_ROWS` jobs finished: only the most
    recent were counted)."""
    current = conn.execute("SELECT now()").fetchone()[0]
    until = current.replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
    since = until - dt.timedelta(minutes=minutes)
    rows = conn.execute(
        statements_for(schema, "queues.sql")["finished_per_minute"],
        {"queue_name": name, "since": since, "limit": THROUGHPUT_MAX_ROWS},
    ).fetchall()
    by_minute: dict[dt.datetime, dict[str, int]] = {}
    read = 0
    for minute, status, n in rows:
        by_minute.setdefault(minute, {})[status] = int(n)
        read += int(n)
    buckets = []
    for i in range(minutes):
        at = since + dt.timedelta(minutes=i)
        found = by_minute.get(at, {})
        buckets.append(
            {"at": at, "succeeded": found.get("succeeded", 0), "failed": found.get("failed", 0)}
        )
    return {
        "since": since,
        "until": until,
        "minutes": minutes,
        "succeeded": sum(b["succeeded"] for b in buckets),
        "failed": sum(b["failed"] for b in buckets),
        "buckets": buckets,
        "truncated": read >= THROUGHPUT_MAX_ROWS,
    }
