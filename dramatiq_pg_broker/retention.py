"""Retention: delete finished jobs, with their events, once they are old enough.

Each terminal status has its own age (``retain_succeeded_days``, ``retain_failed_days``,
``retain_cancelled_days``; 0 keeps that status forever). Rows go in batches of
``retention_batch``, each batch its own short transaction that locks only the finished rows
it deletes (``SKIP LOCKED``), so a run never blocks a claim, an ack or another pruner.

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
    """What a run deleted (or, for a dry run, would delete)."""

    dry_run: bool = False
    jobs: dict[str, int] = dataclasses.field(default_factory=dict)
    events: dict[str, int] = dataclasses.field(default_factory=dict)
    reclaimed: dict[str, int] = dataclasses.field(default_factory=dict)
    batches: int = 0
    complete: bool = True

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
) -> PruneReport:
    """Delete finished jobs older than the policy allows, with their events.

    Parameters:
      pool(ProcessPool): where connections come from.
      schema(str): the broker's schema.
      policy(RetentionPolicy): the age of each status.
      batch(int): the most jobs one transaction deletes.
      dry_run(bool): only count what would be deleted; nothing changes.
      budget_seconds(float): stop starting new batches after this long (the next run goes
        on where this one stopped); None runs until nothing is left.
      stop(threading.Event): stop between batches once set (worker shutdown).
      rest(bool): rest between batches (see :data:`DUTY_CYCLE_REST`).
      now(datetime): the clock to measure ages against; default the server's.

    Returns:
      PruneReport: per status, the jobs and events deleted; ``complete`` is False when the
      budget or ``stop`` ended the run early.
    """
    queries = Queries(schema, "retention.sql")
    report = PruneReport(dry_run=dry_run)
    started = time.monotonic()

    def out_of_time() -> bool:
        if stop is not None and stop.is_set():
            return True
        return budget_seconds is not None and time.monotonic() - started >= budget_seconds

    for status, age in policy.ages().items():
        params = {"status": status, "age_s": age.total_seconds(), "now": now, "limit": batch}
        report.jobs[status] = report.events[status] = 0
        if dry_run:
            with pool.connection() as conn:
                jobs, events = conn.execute(queries["count_prunable"], params).fetchone()
            report.jobs[status], report.events[status] = jobs, events
            continue
        while True:
            if out_of_time():
                report.complete = False
                return report
            batch_started = time.monotonic()
            with pool.connection() as conn, conn.transaction():
                ids = [r[0] for r in conn.execute(queries["select_prunable"], params)]
                if ids:
                    events = conn.execute(queries["delete_events_of"], {"ids": ids}).rowcount
                    jobs = conn.execute(queries["delete_jobs"], {"ids": ids}).rowcount
                    report.jobs[status] += jobs
                    report.events[status] += events
                    report.batches += 1
            if len(ids) < batch:
                break
            if rest:
                pause = (time.monotonic() - batch_started) * DUTY_CYCLE_REST
                if stop is not None:
                    stop.wait(pause)
                else:
                    time.sleep(pause)

    if not dry_run:
        for name, fn in _reclaimers():
            report.reclaimed[name] = _reclaim(pool, schema, name, fn, batch, out_of_time, report)
    return report


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
    """:func:`prune` with the policy and batch size of ``settings``."""
    kwargs.setdefault("batch", settings.retention_batch)
    return prune(pool, settings.schema, RetentionPolicy.from_settings(settings), **kwargs)
