"""Retention: finished jobs and their events go once they are old enough.

Finished jobs live in ``jobs_history``, partitioned by status and by UTC day of
``finished_at``; events in ``job_events``, partitioned by UTC day of ``created_at`` (see
migration 0012 and the history guide). Each terminal status has its own age
(``retain_succeeded_days``, ``retain_failed_days``, ``retain_cancelled_days``; 0 keeps that
status forever). A run:

- creates the daily partitions of the next ``history_partitions_ahead`` days (idempotent;
  many processes may run it at once);
- drops each status's daily partitions whose whole day is past the status's age: constant
  time whatever the day held, no dead rows, no vacuum. A job is therefore kept between its
  age and one day more;
- drops the events' daily partitions past the longest of the three ages (events are kept
  forever while any status is: a job's timeline must outlive the job);
- deletes, in batches of ``retention_batch``, the rows past their age in the DEFAULT
  partitions (rows of a day that had no partition when they were written: maintenance was
  off or lagged), each batch its own short transaction that locks only the rows it deletes
  (``SKIP LOCKED``); a job deleted this way takes its events with it.

Workers run :func:`prune` on the maintenance schedule (see :mod:`.periodic`): once per
``retention_interval`` across all processes. ``dramatiq-pg-broker prune [--dry-run]`` runs
it from a shell.

Expired results, rate-limit keys, worker registrations and dramatiq-abort events are
reclaimed by the same run, through the ``prune_expired(conn, schema, *, limit) -> int`` of
the modules named in :data:`RECLAIMERS`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import logging
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg import sql

from .config import Settings
from .db import ProcessPool, Queries
from .errors import SchemaMissing

logger = logging.getLogger(__name__)

#: The statuses retention deletes, in the order a run visits them.
FINISHED = ("succeeded", "failed", "cancelled")

#: Modules of this package whose ``prune_expired(conn, schema, *, limit) -> int`` a run
#: calls after the jobs (expired results, rate-limit keys, worker registrations, abort
#: events). A module that does not exist, or whose table does not exist yet, is skipped;
#: an error raised while importing one that exists (a missing dependency, a broken
#: import) is raised.
RECLAIMERS = ("results", "rate_limits", "workers", "abort")

#: After each batch a run rests as long as the batch took (a 50 % duty cycle), so a large
#: backlog is worked off steadily without taking the server's I/O away from the workers.
DUTY_CYCLE_REST = 1.0


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """How long each terminal status is kept; None keeps it forever."""

    succeeded: dt.timedelta | None = dt.timedelta(days=7)
    failed: dt.timedelta | None = dt.timedelta(days=30)
    cancelled: dt.timedelta | None = dt.timedelta(days=7)

    @classmethod
    def from_settings(cls, settings: Settings) -> RetentionPolicy:
        def age(days: float) -> dt.timedelta | None:
            return dt.timedelta(days=days) if days > 0 else None

        return cls(
            succeeded=age(settings.retain_succeeded_days),
            failed=age(settings.retain_failed_days),
            cancelled=age(settings.retain_cancelled_days),
        )

    def ages(self) -> dict[str, dt.timedelta]:
        """The statuses that are pruned, with their age."""
        return {s: getattr(self, s) for s in FINISHED if getattr(self, s) is not None}


@dataclasses.dataclass
class PruneReport:
    """What a run deleted (or, for a dry run, would delete).

    ``jobs`` counts, per status, the jobs of the partitions dropped (exactly while a
    partition is small, else PostgreSQL's estimate of its rows) and those deleted from the
    DEFAULT partition; ``events``, per status, the events deleted with the latter jobs.
    ``expired_events`` counts the events that went by their own day (their partitions
    dropped, or deleted from the events' DEFAULT partition); ``dropped`` names every
    partition dropped; ``created`` is how many partitions the run created ahead.
    """

    dry_run: bool = False
    jobs: dict[str, int] = dataclasses.field(default_factory=dict)
    events: dict[str, int] = dataclasses.field(default_factory=dict)
    reclaimed: dict[str, int] = dataclasses.field(default_factory=dict)
    batches: int = 0
    complete: bool = True
    expired_events: int = 0
    dropped: list[str] = dataclasses.field(default_factory=list)
    created: int = 0

    @property
    def total_jobs(self) -> int:
        return sum(self.jobs.values())

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _reclaimers() -> list[tuple[str, Callable[..., int]]]:
    found = []
    for name in RECLAIMERS:
        qualified = f"{__package__}.{name}"
        try:
            module = importlib.import_module(qualified)
        except ModuleNotFoundError as e:
            if e.name != qualified:
                # The module exists but cannot be imported: a bug to see, not an absent
                # module (silently skipping it would stop pruning its table).
                raise
            continue
        fn = getattr(module, "prune_expired", None)
        if callable(fn):
            found.append((name, fn))
    return found


def prune(
    pool: ProcessPool,
    schema: str,
    policy: RetentionPolicy,
    *,
    batch: int = 1000,
    dry_run: bool = False,
    budget_seconds: float | None = None,
    stop: threading.Event | None = None,
    rest: bool = True,
    now: dt.datetime | None = None,
    partitions_ahead: int = 7,
) -> PruneReport:
    """Delete finished jobs older than the policy allows, and events past the longest age.

    Parameters:
      pool(ProcessPool): where connections come from.
      schema(str): the broker's schema.
      policy(RetentionPolicy): the age of each status.
      batch(int): the most rows one transaction deletes from a DEFAULT partition.
      dry_run(bool): only count what would be deleted; nothing changes (no partition is
        created either).
      budget_seconds(float): stop starting new batches after this long (the next run goes
        on where this one stopped); None runs until nothing is left.
      stop(threading.Event): stop between batches once set (worker shutdown).
      rest(bool): rest between batches (see :data:`DUTY_CYCLE_REST`).
      now(datetime): the clock to measure ages against; default the server's.
      partitions_ahead(int): days ahead whose partitions are created.

    Returns:
      PruneReport: what went, per status; ``complete`` is False when the budget or
      ``stop`` ended the run early, or a partition could not be dropped at once (a long
      reader held its table: the next run drops it).
    """
    queries = Queries(schema, "retention.sql")
    report = PruneReport(dry_run=dry_run)
    started = time.monotonic()

    def out_of_time() -> bool:
        if stop is not None and stop.is_set():
            return True
        return budget_seconds is not None and time.monotonic() - started >= budget_seconds

    def in_batches(step: Callable[[psycopg.Connection], int]) -> bool:
        """Run ``step`` (rows handled in one transaction) until a batch comes back short,
        resting between batches. False when the run is out of time (the report says
        it is incomplete)."""
        while True:
            if out_of_time():
                report.complete = False
                return False
            batch_started = time.monotonic()
            with pool.connection() as conn, conn.transaction():
                handled = step(conn)
            if handled < batch:
                return True
            if rest:
                pause = (time.monotonic() - batch_started) * DUTY_CYCLE_REST
                if stop is not None:
                    stop.wait(pause)
                else:
                    time.sleep(pause)

    with pool.connection() as conn:
        clock = now or conn.execute("SELECT now()").fetchone()[0]
        if not dry_run:
            report.created = create_partitions(conn, schema, clock, partitions_ahead, queries)

    for status, age in policy.ages().items():
        report.jobs[status] = report.events[status] = 0
        cutoff = clock - age
        if not _drop_expired(
            pool,
            queries,
            schema,
            f"jobs_history_{status}",
            cutoff,
            report,
            status,
            dry_run,
            out_of_time,
        ):
            return report
        default = f"jobs_history_{status}_default"
        params = {"age_s": age.total_seconds(), "now": clock, "limit": batch}
        if dry_run:
            with pool.connection() as conn:
                jobs, events = conn.execute(
                    _for(queries["count_prunable"], default), params
                ).fetchone()
            report.jobs[status] += jobs
            report.events[status] += events
            continue

        def delete_default_batch(
            conn: psycopg.Connection, status=status, default=default, params=params
        ) -> int:
            rows = conn.execute(_for(queries["select_prunable"], default), params).fetchall()
            ids = [r[0] for r in rows]
            if ids:
                events = conn.execute(queries["delete_events_of"], {"ids": ids}).rowcount
                conn.execute(queries["delete_owners_of"], {"ids": ids})
                conn.execute(queries["delete_keys_of"], {"ids": ids})
                jobs = conn.execute(_for(queries["delete_jobs"], default), {"ids": ids})
                report.jobs[status] += jobs.rowcount
                report.events[status] += events
                report.batches += 1
            return len(ids)

        if not in_batches(delete_default_batch):
            return report

    ages = policy.ages()
    if len(ages) == len(FINISHED):
        # Events go past the longest age only: a job's timeline outlives the job.
        cutoff = clock - max(ages.values())
        if not _drop_expired(
            pool, queries, schema, "job_events", cutoff, report, None, dry_run, out_of_time
        ):
            return report
        if dry_run:
            with pool.connection() as conn:
                found = conn.execute(queries["count_old_events"], {"cutoff": cutoff}).fetchone()
            report.expired_events += found[0]
        else:

            def delete_old_events(conn: psycopg.Connection) -> int:
                deleted = conn.execute(
                    queries["delete_old_events"], {"cutoff": cutoff, "limit": batch}
                ).rowcount
                report.expired_events += deleted
                return deleted

            if not in_batches(delete_old_events):
                return report

    if not dry_run:
        for name, fn in _reclaimers():
            report.reclaimed[name] = _reclaim(pool, schema, name, fn, batch, out_of_time, report)
    return report


#: Partitions up to this size are counted exactly before they are dropped; bigger ones
#: are reported with PostgreSQL's estimate of their rows (counting would read them all).
EXACT_COUNT_MAX_BYTES = 64 * 1024 * 1024

#: How long creating or dropping a partition waits for its parent's lock before leaving it
#: to the next run (a long query on the parent would otherwise queue every outcome behind
#: the wait).
DROP_LOCK_TIMEOUT = "2s"


def _for(text: str, partition: str) -> sql.Composed:
    """A retention statement with its partition filled in."""
    return sql.SQL(text).format(partition=sql.Identifier(partition))


def create_partitions(
    conn, schema: str, today: dt.datetime, days_ahead: int, queries: Queries | None = None
) -> int:
    """Create the daily partitions of history and events from ``today``'s UTC day through
    ``days_ahead`` days later (those missing); returns how many were created."""
    first = today.astimezone(dt.timezone.utc).date()
    params = {"first_day": first, "last_day": first + dt.timedelta(days=days_ahead)}
    with conn.transaction():
        # Creating a partition locks its parent (ACCESS EXCLUSIVE): never wait long for it,
        # or every outcome would queue behind the wait (the function skips that day).
        # Creators in several processes take turns on the function's advisory lock: wait
        # for it here, before the lock timeout is set, so that a turn is never a failure.
        conn.execute("SELECT pg_advisory_xact_lock(1685221479, hashtext(%s))", (schema,))
        conn.execute(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'")
        queries = queries or Queries(schema, "retention.sql")
        created = conn.execute(queries["create_partitions"], params)
        return created.fetchone()[0]


def _drop_expired(
    pool, queries, schema, parent, cutoff, report, status, dry_run, out_of_time
) -> bool:
    """Drop (or, for a dry run, count) the partitions of ``parent`` past ``cutoff``.
    Returns False when the run must stop (out of time)."""
    with pool.connection() as conn:
        expired = conn.execute(
            queries["expired_partitions"], {"schema": schema, "parent": parent, "cutoff": cutoff}
        ).fetchall()
    for partition, size, estimate in expired:
        if out_of_time():
            report.complete = False
            return False
        try:
            with pool.connection() as conn, conn.transaction():
                if size <= EXACT_COUNT_MAX_BYTES or estimate < 0:
                    rows = conn.execute(_for(queries["count_partition"], partition)).fetchone()[0]
                else:
                    rows = round(estimate)
                if not dry_run:
                    conn.execute(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'")
                    if status is not None:
                        conn.execute(_for(queries["delete_owners_in"], partition))
                        conn.execute(_for(queries["delete_keys_in"], partition))
                    conn.execute(_for(queries["drop_partition"], partition))
        except psycopg.errors.LockNotAvailable:
            logger.info("Partition %s is in use; the next retention run drops it.", partition)
            report.complete = False
            continue
        except psycopg.errors.UndefinedTable:
            continue  # another process dropped it meanwhile
        if status is None:
            report.expired_events += rows
        else:
            report.jobs[status] += rows
        if not dry_run:
            report.dropped.append(partition)
            logger.debug("Dropped partition %s (%d rows).", partition, rows)
    return True


def _reclaim(pool, schema, name, fn, batch, out_of_time, report) -> int:
    total = 0
    while not out_of_time():
        try:
            with pool.connection() as conn:
                count = fn(conn, schema, limit=batch)
        except (psycopg.errors.UndefinedTable, SchemaMissing):
            logger.debug("Nothing to reclaim for %s: its table does not exist.", name)
            return total
        total += count
        if count < batch:
            return total
    report.complete = False
    return total


def prune_with_settings(pool: ProcessPool, settings: Settings, **kwargs) -> PruneReport:
    """:func:`prune` with the policy, batch size and partitions ahead of ``settings``."""
    kwargs.setdefault("batch", settings.retention_batch)
    kwargs.setdefault("partitions_ahead", settings.history_partitions_ahead)
    return prune(pool, settings.schema, RetentionPolicy.from_settings(settings), **kwargs)
