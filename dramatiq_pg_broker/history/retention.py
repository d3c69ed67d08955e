"""Retention and partition maintenance: finished jobs and their events go once they are
old enough, and history's daily partitions are made ahead, without stalling the hot path.

Finished jobs live in ``jobs_history``, partitioned by status and by UTC day of
``finished_at``; events in ``job_events``, partitioned by UTC day of ``created_at`` (see
migrations 0012 and 0013 and the history guide). Each terminal status has its own age
(``retain_succeeded_days``, ``retain_failed_days``, ``retain_cancelled_days``; 0 keeps that
status forever). A run is a sequence of steps (:data:`STEPS`), each on its own: a step that
fails is logged with its error and reported, and the next one still runs.

- ``create``: the daily partitions of today and the next ``history_partitions_ahead`` days,
  each made as a standalone table with a CHECK constraint of its bound, then attached
  (``ATTACH PARTITION``: SHARE UPDATE EXCLUSIVE on the parent, which sends, claims and
  outcomes never wait for);
- ``drop``: each status's daily partitions whose whole day is past the status's age, and
  the events' past the longest of the three ages: their idempotency keys and owner rows
  go first in batches, then the partition is detached, then dropped;
- ``default``: the rows of the DEFAULT partitions (days that had no partition when they
  were written): those past their age are deleted in batches of ``retention_batch`` (a
  job with its events), the others moved in batches into their day's partition, made for
  the purpose and attached once the day's rows are in, so that DEFAULT stays empty (an
  attach scans it under ACCESS EXCLUSIVE, unless a validated constraint proves it holds
  none of the day: see :data:`SCAN_AT_ONCE_BYTES`);
- ``results``, ``rate_limits``, ``workers``, ``abort``: the ``prune_expired(conn, schema,
  *, limit) -> int`` of those modules (:data:`RECLAIMERS`), in batches.

Every DDL statement runs alone in its transaction, committed without waiting for its WAL
flush (its locks go at once), up to :data:`DDL_TRIES` times with a random pause; a
statement that never gets its lock is left to the next run and its step reports
``skipped``. Before each try, ``pg_locks`` tells who holds a lock that conflicts with the
statement's on the relations it touches: a holder that may keep it long (a long reader
of history, a session idle in its transaction, autovacuum) makes the try give up without
queueing at all, since a waiting ACCESS EXCLUSIVE request makes every later send, claim or
outcome on that relation queue behind it; brief holders (the hot path's own statements)
are waited for under :data:`LOCK_TIMEOUT`. Maintenance thus never holds one lock while it
waits for another, never queues behind a long holder, and gives up long before
PostgreSQL's deadlock detection would pick a victim.

Workers run :func:`prune` on the maintenance schedule (see :mod:`.periodic`): once per
``retention_interval`` across all processes. ``dramatiq-pg-broker prune [--dry-run]`` runs
it from a shell and prints each step.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import importlib
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from dramatiq.errors import BrokerConnectionError
from psycopg import sql

from ..config import Settings
from ..db.core import ProcessPool, Queries
from ..errors import SchemaMissing

logger = logging.getLogger("dramatiq_pg_broker.retention")

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


#: The steps of a run, in order. Each runs on its own and reports ``ok``, ``skipped`` or
#: ``failed`` (with its error): one failing never stops the others.
STEPS = ("create", "drop", "default", *RECLAIMERS)

#: The parents of history's daily partitions, with the column of their bound.
PARENTS = {
    **{f"jobs_history_{status}": "finished_at" for status in FINISHED},
    "job_events": "created_at",
}

#: How long a DDL statement of maintenance (attach, detach, drop) waits for its lock once
#: only brief holders hold it (see :data:`BRIEF_HOLDER_MS`). The hot path queues behind a
#: waiting ACCESS EXCLUSIVE request, so this bounds what a send, claim or outcome can wait
#: for maintenance; it is also far below deadlock_timeout (1 s), so in a lock cycle with
#: the hot path maintenance gives up before PostgreSQL would pick a victim.
LOCK_TIMEOUT = "50ms"

#: A session holding a lock a maintenance statement needs counts as brief (the statement
#: queues behind it, under :data:`LOCK_TIMEOUT`) while it runs a statement in a transaction
#: begun less than this many milliseconds ago; any other holder makes the try give up
#: without queueing (see the ``lock_holders`` statement).
BRIEF_HOLDER_MS = 50

#: The lock modes maintenance statements take, with the modes that conflict with each
#: (PostgreSQL's table of conflicting table-level locks).
ACCESS_EXCLUSIVE = "ACCESS EXCLUSIVE"
SHARE_UPDATE_EXCLUSIVE = "SHARE UPDATE EXCLUSIVE"
CONFLICTS = {
    ACCESS_EXCLUSIVE: (
        "AccessShareLock",
        "RowShareLock",
        "RowExclusiveLock",
        "ShareUpdateExclusiveLock",
        "ShareLock",
        "ShareRowExclusiveLock",
        "ExclusiveLock",
        "AccessExclusiveLock",
    ),
    SHARE_UPDATE_EXCLUSIVE: (
        "ShareUpdateExclusiveLock",
        "ShareLock",
        "ShareRowExclusiveLock",
        "ExclusiveLock",
        "AccessExclusiveLock",
    ),
}

#: An attach scans the parent's DEFAULT partition under ACCESS EXCLUSIVE (every send that
#: reads history through the parent waits meanwhile) unless a validated CHECK constraint
#: proves it holds none of the new day. Up to this size (dead rows count: the scan reads
#: them until vacuum) the scan is brief and done; above it, the constraint comes first.
SCAN_AT_ONCE_BYTES = 8 * 1024 * 1024

#: A day of a DEFAULT partition with at most this many rows moves into its partition in
#: the attach's own transaction (readers never lose sight of a row); a bigger day moves in
#: batches first, out of sight of readers of the parent until the attach.
MOVE_AT_ONCE_ROWS = 10_000

#: Days from this many after today are attached after a validated CHECK constraint on the
#: DEFAULT partition (when it is bigger than :data:`SCAN_AT_ONCE_BYTES`) proves it holds
#: none of them: the attach then skips scanning it. Not for today and tomorrow, whose rows
#: may arrive meanwhile (the constraint would refuse them).
EXCLUDE_FROM_DAYS_AHEAD = 2

#: Tries of one DDL statement, a random pause of :data:`RETRY_PAUSE` seconds between two;
#: after the last the statement is skipped (the step reports it) and the next run tries.
DDL_TRIES = 3
RETRY_PAUSE = (0.05, 0.25)


class LockBusy(Exception):
    """A maintenance statement did not get its lock in :data:`DDL_TRIES` tries."""


class LockHeld(Exception):
    """A session that may hold it long holds a lock a maintenance statement needs: the try
    gives up without queueing."""


#: A relation a maintenance statement locks, and the mode it takes.
Lock = tuple[str, str]


def _attach_locks(parent: str, day: dt.date) -> tuple[Lock, ...]:
    """What ``ATTACH PARTITION`` of ``parent``'s ``day`` locks."""
    return (
        (parent, SHARE_UPDATE_EXCLUSIVE),
        (f"{parent}_default", ACCESS_EXCLUSIVE),
        (_partition_name(parent, day), ACCESS_EXCLUSIVE),
    )


def _detach_locks(parent: str, partition: str) -> tuple[Lock, ...]:
    """What ``DETACH PARTITION`` locks: the parent, the partition and the parent's DEFAULT
    partition (whose implicit bound widens)."""
    return (
        (parent, ACCESS_EXCLUSIVE),
        (f"{parent}_default", ACCESS_EXCLUSIVE),
        (partition, ACCESS_EXCLUSIVE),
    )


@dataclasses.dataclass
class StepResult:
    """What one step of a run did: ``state`` is ``ok``, ``skipped`` (nothing failed, but
    something was left to the next run: a lock not granted, out of time, a dry run, a module
    not installed) or ``failed`` (``error`` says why)."""

    state: str = "ok"
    detail: str = ""
    error: str | None = None
    seconds: float = 0.0


@dataclasses.dataclass
class PruneReport:
    """What a run deleted (or, for a dry run, would delete), step by step.

    ``jobs`` counts, per status, the jobs of the partitions dropped (exactly while a
    partition is small, else PostgreSQL's estimate of its rows) and those deleted from the
    DEFAULT partition; ``events``, per status, the events deleted with the latter jobs.
    ``expired_events`` counts the events that went by their own day (their partitions
    dropped, or deleted from the events' DEFAULT partition); ``dropped`` names every
    partition dropped; ``created`` is how many partitions the run attached ahead;
    ``moved`` counts, per DEFAULT partition, the rows moved into their day's partition.
    ``steps`` holds each step's :class:`StepResult`, in the order of :data:`STEPS`.
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
    moved: dict[str, int] = dataclasses.field(default_factory=dict)
    steps: dict[str, StepResult] = dataclasses.field(default_factory=dict)

    @property
    def total_jobs(self) -> int:
        return sum(self.jobs.values())

    @property
    def failed(self) -> list[str]:
        """The steps that failed."""
        return [name for name, step in self.steps.items() if step.state == "failed"]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _reclaimer(name: str) -> Callable[..., int] | None:
    """The ``prune_expired`` of module ``name`` of this package; None when the module does
    not exist. An error raised while importing one that exists (a missing dependency, a
    broken import) is raised: the step fails with it."""
    qualified = f"dramatiq_pg_broker.{name}"
    try:
        module = importlib.import_module(qualified)
    except ModuleNotFoundError as e:
        if e.name != qualified:
            # The module exists but cannot be imported: a bug to see, not an absent
            # module (silently skipping it would stop pruning its table).
            raise
        return None
    fn = getattr(module, "prune_expired", None)
    return fn if callable(fn) else None


def _identifiers(names: dict[str, str]) -> dict[str, sql.Identifier]:
    return {k: sql.Identifier(v) for k, v in names.items()}


def _named(text: str, **names: str) -> sql.Composed:
    """A retention statement with its tables (identifiers) filled in."""
    return sql.SQL(text).format(**_identifiers(names))


def _for(text: str, partition: str) -> sql.Composed:
    """A retention statement with its partition filled in."""
    return _named(text, partition=partition)


def _day_of(moment: dt.datetime) -> dt.date:
    return moment.astimezone(dt.timezone.utc).date()


def _partition_name(parent: str, day: dt.date) -> str:
    return f"{parent}_{day:%Y%m%d}"


class _Run:
    """One retention run: the steps, the clock, the budget and the report."""

    def __init__(
        self,
        pool: ProcessPool,
        schema: str,
        policy: RetentionPolicy,
        *,
        batch: int,
        dry_run: bool,
        budget_seconds: float | None,
        stop: threading.Event | None,
        rest: bool,
        partitions_ahead: int,
    ) -> None:
        self.pool = pool
        self.schema = schema
        self.policy = policy
        self.batch = batch
        self.dry_run = dry_run
        self.budget_seconds = budget_seconds
        self.stop = stop
        self.rest = rest
        self.partitions_ahead = partitions_ahead
        self.queries = Queries(schema, "retention.sql")
        self.report = PruneReport(dry_run=dry_run)
        self.started = time.monotonic()
        self.clock: dt.datetime | None = None
        for status in policy.ages():
            self.report.jobs[status] = self.report.events[status] = 0

    # -- the run's frame -------------------------------------------------------------------

    def out_of_time(self) -> bool:
        if self.stop is not None and self.stop.is_set():
            return True
        return (
            self.budget_seconds is not None
            and time.monotonic() - self.started >= self.budget_seconds
        )

    def pause(self, seconds: float) -> None:
        if self.stop is not None:
            self.stop.wait(seconds)
        else:
            time.sleep(seconds)

    def step(self, name: str, fn: Callable[[], StepResult | None]) -> None:
        """Run one step, recording what it did; any error is its own."""
        if self.out_of_time():
            self.report.complete = False
            self.report.steps[name] = StepResult("skipped", "out of time: the next run goes on")
            return
        started = time.monotonic()
        try:
            result = fn() or StepResult()
        except Exception as e:
            error = str(e).strip() or type(e).__name__
            if isinstance(e, BrokerConnectionError):
                # Told once per outage by the process (outage.py).
                logger.debug("Maintenance step %s could not reach the database: %s", name, e)
            else:
                logger.error(
                    "Maintenance step %s failed: %s",
                    name,
                    error,
                    exc_info=not isinstance(e, psycopg.Error),
                )
            result = StepResult("failed", error=error)
            self.report.complete = False
        result.seconds = round(time.monotonic() - started, 3)
        self.report.steps[name] = result

    def in_batches(self, step: Callable[[psycopg.Connection], int], *, budget=True) -> bool:
        """Run ``step`` (rows handled in one transaction) until a batch comes back short,
        resting between batches. False when the run is out of time (the report says
        it is incomplete); with ``budget=False`` only ``stop`` ends it early."""
        while True:
            stopped = self.stop is not None and self.stop.is_set()
            if stopped or (budget and self.out_of_time()):
                self.report.complete = False
                return False
            batch_started = time.monotonic()
            with self.pool.connection() as conn, conn.transaction():
                handled = step(conn)
            if handled < self.batch:
                return True
            if self.rest:
                self.pause((time.monotonic() - batch_started) * DUTY_CYCLE_REST)

    def ddl(self, statement, params: dict | None = None, *, locks: Sequence[Lock] = ()):
        """Run one maintenance statement alone in its transaction (see :meth:`locked`);
        returns its first column (or None). ``locks`` names what it locks.

        Raises:
          LockBusy: its locks were not granted in :data:`DDL_TRIES` tries.
        """

        def run(conn: psycopg.Connection):
            cur = conn.execute(statement, params)
            row = cur.fetchone() if cur.description else None
            return row[0] if row else None

        return self.locked(locks, run)

    def locked(self, locks: Sequence[Lock], work: Callable[[psycopg.Connection], Any]) -> Any:
        """Run ``work`` in a transaction of its own that takes ``locks`` (relation, mode),
        up to :data:`DDL_TRIES` times with a random pause in between. Each try first asks
        ``pg_locks`` who holds them (:meth:`check_holders`, called again by ``work`` before
        a later statement): a holder that may keep them long ends the try at once, without
        queueing; else the statements wait for brief holders under :data:`LOCK_TIMEOUT`.
        The transaction commits without waiting for its WAL flush (its locks go at once;
        a crash can only undo a partition change the next run makes again).

        Raises:
          LockBusy: not granted in :data:`DDL_TRIES` tries.
        """
        for attempt in range(DDL_TRIES):
            try:
                with self.pool.connection() as conn:
                    started = time.monotonic()
                    with conn.transaction():
                        conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                        conn.execute("SET LOCAL synchronous_commit = off")
                        self.check_holders(conn, locks)
                        result = work(conn)
                    logger.debug(
                        "Maintenance transaction on %s: %.0f ms.",
                        ", ".join(r for r, _ in locks) or "new tables",
                        (time.monotonic() - started) * 1000,
                    )
                    return result
            except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected, LockHeld):
                if attempt + 1 < DDL_TRIES:
                    self.pause(random.uniform(*RETRY_PAUSE))
        raise LockBusy

    def check_holders(self, conn: psycopg.Connection, locks: Sequence[Lock]) -> None:
        """Raise :class:`LockHeld` when a session that may keep it long holds (or waits
        for) a lock conflicting with one of ``locks``."""
        if not locks:
            return
        pairs = [(relation, held) for relation, mode in locks for held in CONFLICTS[mode]]
        conn.execute(self.queries["clear_activity_snapshot"])
        holder = conn.execute(
            self.queries["lock_holders"],
            {
                "schema": self.schema,
                "relations": [r for r, _ in pairs],
                "modes": [m for _, m in pairs],
                "brief_ms": BRIEF_HOLDER_MS,
            },
        ).fetchone()
        if holder is not None:
            relation, mode, granted, pid, state, kind, seconds = holder
            logger.debug(
                "%s %s %s by pid %s (%s, %s, transaction of %s s): not queueing behind it.",
                relation,
                mode,
                "held" if granted else "waited for",
                pid,
                kind,
                state,
                seconds,
            )
            raise LockHeld(relation)

    def free(self, locks: Sequence[Lock]) -> bool:
        """Whether ``locks`` could be had now without waiting for a long holder (nothing
        is locked)."""
        with self.pool.connection() as conn:
            try:
                self.check_holders(conn, locks)
            except LockHeld:
                return False
        return True

    def scan_is_brief(self, partition: str) -> bool:
        """Whether an attach may scan ``partition`` (a DEFAULT one) under its lock."""
        with self.pool.connection() as conn:
            (size,) = conn.execute(
                self.queries["relation_size"], {"schema": self.schema, "partition": partition}
            ).fetchone()
        return (size or 0) <= SCAN_AT_ONCE_BYTES

    def ages(self) -> dict[str, dt.timedelta]:
        return self.policy.ages()

    def events_cutoff(self) -> dt.datetime | None:
        """Events go past the longest age only (a job's timeline outlives the job); never
        while a status is kept forever."""
        ages = self.ages()
        if len(ages) < len(FINISHED):
            return None
        return self.clock - max(ages.values())

    def cutoff(self, parent: str) -> dt.datetime | None:
        if parent == "job_events":
            return self.events_cutoff()
        age = self.ages().get(parent.removeprefix("jobs_history_"))
        return None if age is None else self.clock - age

    # -- run -------------------------------------------------------------------------------

    def run(self, now: dt.datetime | None) -> PruneReport:
        try:
            if now is None:
                with self.pool.connection() as conn:
                    now = conn.execute("SELECT now()").fetchone()[0]
        except Exception as e:
            # Without the clock no step can run: each reports the same failure.
            for name in STEPS:
                self.step(name, functools.partial(_raise, e))
            return self.report
        self.clock = now
        self.step("create", self.create)
        self.step("drop", self.drop)
        self.step("default", self.default)
        for name in RECLAIMERS:
            self.step(name, functools.partial(self.reclaim, name))
        return self.report

    # -- create ----------------------------------------------------------------------------

    def create(self) -> StepResult:
        """Attach the daily partitions of today and the next ``partitions_ahead`` days:
        each prepared as a standalone table, then attached, each statement alone."""
        if self.dry_run:
            return StepResult("skipped", "dry run: nothing created")
        with self.pool.connection() as conn:
            attached = {r[0] for r in conn.execute(self.queries["history_partition_names"])}
        first = _day_of(self.clock)
        days = [first + dt.timedelta(days=offset) for offset in range(self.partitions_ahead + 1)]
        busy, held = [], []
        for parent in PARENTS:
            self.sweep_exclusions(parent)
            missing = [d for d in days if _partition_name(parent, d) not in attached]
            for day, outcome in self.attach_days(parent, missing).items():
                if outcome == "busy":
                    busy.append(_partition_name(parent, day))
                elif outcome == "held":
                    held.append(_partition_name(parent, day))
                elif outcome == "attached":
                    self.report.created += 1
        detail = f"{self.report.created} partition(s) attached, through {days[-1]:%Y-%m-%d}"
        if held:
            detail += f"; {len(held)} day(s) have rows in DEFAULT (the default step moves them)"
        if busy:
            self.report.complete = False
            return StepResult(
                "skipped",
                f"{detail}; lock not granted in {DDL_TRIES} tries: {', '.join(sorted(busy))}",
            )
        return StepResult("ok", detail)

    def attach_days(self, parent: str, days: list[dt.date]) -> dict[dt.date, str]:
        """Prepare and attach ``days`` of ``parent``; for each: ``attached``, ``exists``,
        ``busy`` (lock not granted) or ``held`` (the DEFAULT partition holds rows of the
        day). While the DEFAULT partition is too big to scan under the attach's lock, the
        days from :data:`EXCLUDE_FROM_DAYS_AHEAD` on are attached after one constraint
        proves it holds none of them (:meth:`exclude_from_default`)."""
        outcomes: dict[dt.date, str] = {}
        ready = []
        for day in days:
            try:
                self.ddl(self.queries["prepare_partition"], {"parent": parent, "day": day})
                ready.append(day)
            except LockBusy:
                outcomes[day] = "busy"
        default = f"{parent}_default"
        ahead = [
            d for d in ready if d >= _day_of(self.clock) + dt.timedelta(EXCLUDE_FROM_DAYS_AHEAD)
        ]
        exclusion = None
        if ahead and not self.scan_is_brief(default):
            try:
                exclusion = self.exclude_from_default(parent, ahead[0], ahead[-1])
            except (LockBusy, psycopg.errors.CheckViolation) as e:
                # Not proved: attaching would scan the DEFAULT partition under its lock.
                state = "busy" if isinstance(e, LockBusy) else "held"
                outcomes.update(dict.fromkeys(ahead, state))
                ready = [d for d in ready if d not in ahead]
        try:
            for day in ready:
                outcomes[day] = self.attach(parent, day)
        finally:
            if exclusion is not None:
                self.drop_exclusion(exclusion)
        return outcomes

    def attach(self, parent: str, day: dt.date) -> str:
        """Attach one prepared day of ``parent``: ``attached``, ``exists``, ``busy`` (lock
        not granted) or ``held`` (the DEFAULT partition holds rows of the day)."""
        params = {"parent": parent, "day": day}
        try:
            done = self.ddl(
                self.queries["attach_partition"], params, locks=_attach_locks(parent, day)
            )
        except LockBusy:
            logger.info(
                "Partition %s: its lock was not granted; the next run attaches it.",
                _partition_name(parent, day),
            )
            return "busy"
        except psycopg.errors.CheckViolation:
            return "held"
        return "attached" if done else "exists"

    def exclude_from_default(
        self, parent: str, first: dt.date, last: dt.date | None = None
    ) -> dict[str, str]:
        """Prove with a validated CHECK constraint that ``parent``'s DEFAULT partition holds
        no row of the days ``first`` to ``last`` (default: ``first`` alone), so that their
        attaches skip scanning it under ACCESS EXCLUSIVE. Adding it NOT VALID is instant;
        its scan (VALIDATE) runs under SHARE UPDATE EXCLUSIVE, which sends, claims and
        outcomes never wait for. Returns the names to drop it by (:meth:`drop_exclusion`).

        Raises:
          LockBusy: a lock was not granted.
          psycopg.errors.CheckViolation: the partition holds rows of those days.
        Either way the constraint is dropped again (if that lock is not granted either, it
        stays until the next run's :meth:`sweep_exclusions`).
        """
        last = first if last is None else last
        default = f"{parent}_default"
        suffix = f"{first:%Y%m%d}" + ("" if last == first else f"_{last:%Y%m%d}")
        names = {"partition": default, "constraint": f"{default}_not_{suffix}"}
        lo = dt.datetime.combine(first, dt.time(), dt.timezone.utc)
        hi = dt.datetime.combine(last + dt.timedelta(days=1), dt.time(), dt.timezone.utc)
        bounds = {
            "column": sql.Identifier(PARENTS[parent]),
            "lo": sql.Literal(lo),
            "hi": sql.Literal(hi),
        }
        drop = _named(self.queries["drop_exclusion"], **names)
        add = sql.SQL(self.queries["exclude_day"]).format(**bounds, **_identifiers(names))

        def replace(conn: psycopg.Connection) -> None:
            conn.execute(drop)
            conn.execute(add)

        self.locked(((default, ACCESS_EXCLUSIVE),), replace)
        try:
            self.ddl(
                _named(self.queries["validate_exclusion"], **names),
                locks=((default, SHARE_UPDATE_EXCLUSIVE),),
            )
        except BaseException:
            self.drop_exclusion(names)
            raise
        return names

    def drop_exclusion(self, names: dict[str, str]) -> bool:
        """Drop a constraint of :meth:`exclude_from_default`; False when its lock was not
        granted (it stays until the next run's :meth:`sweep_exclusions`)."""
        try:
            self.ddl(
                _named(self.queries["drop_exclusion"], **names),
                locks=((names["partition"], ACCESS_EXCLUSIVE),),
            )
        except LockBusy:
            logger.info("Constraint %s stays until the next run.", names["constraint"])
            return False
        return True

    def sweep_exclusions(self, parent: str) -> None:
        """Drop the constraints an earlier run left on ``parent``'s DEFAULT partition (it
        stopped, or their lock was not granted, between adding one and dropping it): left
        there, one would refuse rows of its days once they are today's."""
        default = f"{parent}_default"
        with self.pool.connection() as conn:
            left = conn.execute(
                self.queries["exclusion_constraints"],
                {"schema": self.schema, "partition": default},
            ).fetchall()
        for (constraint,) in left:
            self.drop_exclusion({"partition": default, "constraint": constraint})

    # -- drop ------------------------------------------------------------------------------

    def drop(self) -> StepResult:
        """Drop the daily partitions past their age: first their idempotency keys and owner
        rows go in batches, then the partition is detached, then the detached table is
        dropped, each statement in its own transaction."""
        busy = []
        handled = 0
        with self.pool.connection() as conn:
            pending = conn.execute(self.queries["pending_partitions"]).fetchall()
        for parent in PARENTS:
            cutoff = self.cutoff(parent)
            if cutoff is None:
                continue
            with self.pool.connection() as conn:
                expired = [
                    (*row, True)
                    for row in conn.execute(
                        self.queries["expired_partitions"],
                        {"schema": self.schema, "parent": parent, "cutoff": cutoff},
                    )
                ]
            # Tables of expired days that are not attached (detached by a run that could
            # not drop them, or prepared and never attached): their rows are expired too.
            expired += [
                (name, 0, -1, False)
                for p, day, name in pending
                if p == parent
                and dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), dt.timezone.utc)
                <= cutoff
            ]
            for partition, size, estimate, attached in expired:
                if self.out_of_time():
                    self.report.complete = False
                    return StepResult("skipped", "out of time: the next run goes on")
                try:
                    rows = self.drop_one(parent, partition, size, estimate, attached)
                except LockBusy:
                    logger.info(
                        "Partition %s is in use; the next retention run drops it.", partition
                    )
                    busy.append(partition)
                    continue
                except psycopg.errors.UndefinedTable:
                    continue  # another process dropped it meanwhile
                if parent == "job_events":
                    self.report.expired_events += rows
                else:
                    self.report.jobs[parent.removeprefix("jobs_history_")] += rows
                handled += 1
                if not self.dry_run:
                    self.report.dropped.append(partition)
                    logger.debug("Dropped partition %s (%d rows).", partition, rows)
        verb = "would drop" if self.dry_run else "dropped"
        detail = f"{verb} {handled} partition(s)"
        if busy:
            self.report.complete = False
            return StepResult(
                "skipped", f"{detail}; lock not granted in {DDL_TRIES} tries: {', '.join(busy)}"
            )
        return StepResult("skipped" if self.dry_run else "ok", detail)

    def drop_one(
        self, parent: str, partition: str, size: int, estimate: float, attached: bool
    ) -> int:
        with self.pool.connection() as conn:
            if size <= EXACT_COUNT_MAX_BYTES or estimate < 0:
                rows = conn.execute(_for(self.queries["count_partition"], partition)).fetchone()[0]
            else:
                rows = round(estimate)
        if self.dry_run:
            return rows
        if parent != "job_events":
            # Free the day's keys and owner rows first, in short transactions of their
            # own: the drop then holds no row lock while it waits for its table lock (a
            # keyed send that reuses a key of the day waited for that row while holding
            # the parent the drop wanted: a deadlock).
            params = {"limit": self.batch}
            for name in ("free_keys_in", "free_owners_in"):
                statement = _for(self.queries[name], partition)
                while True:
                    with self.pool.connection() as conn:
                        if conn.execute(statement, params).rowcount < self.batch:
                            break
        if attached:
            self.ddl(
                self.queries["detach_partition"],
                {"partition": partition},
                locks=_detach_locks(parent, partition),
            )
        self.ddl(
            _for(self.queries["drop_table"], partition), locks=((partition, ACCESS_EXCLUSIVE),)
        )
        return rows

    # -- default ---------------------------------------------------------------------------

    def default(self) -> StepResult:
        """Keep the DEFAULT partitions empty: delete their rows past their age (in
        batches, as before 0012), and move the others into their day's partition (made
        for the purpose), in batches, then attach it."""
        busy: list[str] = []
        for parent in PARENTS:
            if not self.default_expired(parent):
                return StepResult("skipped", "out of time: the next run goes on")
            if self.dry_run:
                continue
            if not self.default_move(parent, busy):
                return StepResult("skipped", "out of time: the next run goes on")
        if self.dry_run:
            return StepResult("skipped", "dry run: nothing moved")
        moved = sum(self.report.moved.values())
        detail = f"moved {moved} row(s) out of DEFAULT"
        if busy:
            self.report.complete = False
            return StepResult(
                "skipped", f"{detail}; lock not granted in {DDL_TRIES} tries: {', '.join(busy)}"
            )
        return StepResult("ok", detail)

    def default_expired(self, parent: str) -> bool:
        """Delete (or count) the rows of ``parent``'s DEFAULT partition past their age."""
        cutoff = self.cutoff(parent)
        if cutoff is None:
            return True
        queries = self.queries
        if parent == "job_events":
            if self.dry_run:
                with self.pool.connection() as conn:
                    found = conn.execute(queries["count_old_events"], {"cutoff": cutoff})
                    self.report.expired_events += found.fetchone()[0]
                return True

            def delete_old_events(conn: psycopg.Connection) -> int:
                deleted = conn.execute(
                    queries["delete_old_events"], {"cutoff": cutoff, "limit": self.batch}
                ).rowcount
                self.report.expired_events += deleted
                return deleted

            return self.in_batches(delete_old_events)

        status = parent.removeprefix("jobs_history_")
        default = f"{parent}_default"
        params = {
            "age_s": (self.clock - cutoff).total_seconds(),
            "now": self.clock,
            "limit": self.batch,
        }
        if self.dry_run:
            with self.pool.connection() as conn:
                jobs, events = conn.execute(
                    _for(queries["count_prunable"], default), params
                ).fetchone()
            self.report.jobs[status] += jobs
            self.report.events[status] += events
            return True

        def delete_default_batch(conn: psycopg.Connection) -> int:
            rows = conn.execute(_for(queries["select_prunable"], default), params).fetchall()
            ids = [r[0] for r in rows]
            if ids:
                events = conn.execute(queries["delete_events_of"], {"ids": ids}).rowcount
                conn.execute(queries["delete_owners_of"], {"ids": ids})
                conn.execute(queries["delete_keys_of"], {"ids": ids})
                jobs = conn.execute(_for(queries["delete_jobs"], default), {"ids": ids})
                self.report.jobs[status] += jobs.rowcount
                self.report.events[status] += events
                self.report.batches += 1
            return len(ids)

        return self.in_batches(delete_default_batch)

    def default_move(self, parent: str, busy: list[str]) -> bool:
        """Move the rows of ``parent``'s DEFAULT partition into their days' partitions.
        False when out of time."""
        default = f"{parent}_default"
        cutoff = self.cutoff(parent)
        with self.pool.connection() as conn:
            if parent == "job_events":
                days = conn.execute(self.queries["events_default_days"]).fetchall()
                move = self.queries["move_events_default"]
            else:
                days = conn.execute(_for(self.queries["history_default_days"], default)).fetchall()
                move = self.queries["move_history_default"]
            pending = [
                day for p, day, _ in conn.execute(self.queries["pending_partitions"]) if p == parent
            ]
        todo = sorted({d for (d,) in days} | set(pending))
        if days:
            # Watched: a DEFAULT partition holds rows only when maintenance was off or
            # behind (or after an upgrade); every attach of this parent scans it.
            logger.warning(
                "%s holds rows of %d day(s) (%s to %s): moving them into their days.",
                default,
                len(days),
                days[0][0],
                days[-1][0],
            )
        for day in todo:
            if (
                cutoff is not None
                and dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), dt.timezone.utc)
                <= cutoff
            ):
                continue  # expired: deleted above, or dropped by the drop step
            target = _partition_name(parent, day)
            if not self.move_day(parent, day, move, default):
                busy.append(target)
            if self.out_of_time():
                return False
        return True

    def move_day(self, parent: str, day: dt.date, move: str, default: str) -> bool:
        """Move one day's rows out of ``default`` into the day's partition and attach it.
        False when a lock was not granted (the rows are then where readers see them: in
        DEFAULT, unless a constraint that could not be dropped keeps them out of it until
        the next run)."""
        target = _partition_name(parent, day)
        statement = _named(move, partition=default, target=target)
        params = {"day": day, "limit": self.batch}
        try:
            self.ddl(self.queries["prepare_partition"], {"parent": parent, "day": day})
        except LockBusy:
            return False
        with self.pool.connection() as conn:
            (rows,) = conn.execute(
                _named(
                    self.queries["count_default_day"], partition=default, column=PARENTS[parent]
                ),
                {"day": day, "cap": MOVE_AT_ONCE_ROWS + 1},
            ).fetchone()
        if rows <= MOVE_AT_ONCE_ROWS and self.scan_is_brief(default):
            # A small day next to a DEFAULT partition quick to scan moves in the attach's
            # own transaction: readers see its rows in DEFAULT or in their day, never
            # nowhere. A row arriving in between fails the attach (check_violation): try
            # again.
            for _ in range(DDL_TRIES):
                try:
                    self.attach_moving(parent, day, statement, params, default)
                    return True
                except psycopg.errors.CheckViolation:
                    continue
                except LockBusy:
                    break
            self.move_back(target, default)
            return False
        # A big day, or a DEFAULT partition too big to scan under the attach's lock: the
        # rows move in batches, out of sight of readers of the parent until the attach,
        # which a constraint proving DEFAULT holds none of the day spares the scan. First
        # make sure no long holder holds what the attach needs (a long reader holds it
        # for as long as it reads).
        if not self.free(_attach_locks(parent, day)):
            return False

        def move_batch(conn: psycopg.Connection) -> int:
            moved = conn.execute(statement, params).rowcount
            self.report.moved[default] = self.report.moved.get(default, 0) + moved
            return moved

        # A day once started is finished whatever the budget (moving it back would start it
        # over at every run); a worker's shutdown leaves it to the next run, which picks
        # the day's table up with the rest of the day.
        if not self.in_batches(move_batch, budget=False):
            return True
        return self.attach_moved(parent, day, default, lambda: self.in_batches(move_batch))

    def attach_moved(
        self, parent: str, day: dt.date, default: str, move_rest: Callable[[], object]
    ) -> bool:
        """Attach a day whose rows were moved out of ``default`` in batches, after a
        validated constraint proves ``default`` holds none of the day (rows that arrived
        after the last batch are moved by ``move_rest`` first). False when a lock was not
        granted: the rows go back to DEFAULT (or stay in the day's table, out of sight,
        while the constraint could not be dropped)."""
        target = _partition_name(parent, day)
        names = None
        for _ in range(DDL_TRIES):
            try:
                names = self.exclude_from_default(parent, day)
                break
            except psycopg.errors.CheckViolation:
                move_rest()
            except LockBusy:
                break
        attached = False
        if names is not None:
            try:
                self.ddl(
                    self.queries["attach_partition"],
                    {"parent": parent, "day": day},
                    locks=_attach_locks(parent, day),
                )
                attached = True
            except LockBusy:
                pass
            if not self.drop_exclusion(names) and not attached:
                logger.info(
                    "%s stays out of sight until the next run attaches it: constraint %s"
                    " could not be dropped.",
                    target,
                    names["constraint"],
                )
                return False
        if not attached:
            self.move_back(target, default)
        return attached

    def move_back(self, target: str, default: str) -> None:
        """Rows of a day that could not be attached go back to DEFAULT, where readers see
        them; the next run tries again."""
        statement = _named(self.queries["move_back"], partition=default, target=target)
        moved = 0
        while True:
            with self.pool.connection() as conn:
                count = conn.execute(statement, {"limit": self.batch}).rowcount
            moved += count
            if count < self.batch:
                break
        if moved:
            self.report.moved[default] = self.report.moved.get(default, 0) - moved
            logger.info("Moved %d row(s) of %s back to %s: not attached.", moved, target, default)

    def attach_moving(self, parent, day, statement, params, default) -> None:
        """Move a day's rows out of ``default`` and attach the day, in one transaction."""
        locks = _attach_locks(parent, day)

        def move_and_attach(conn: psycopg.Connection) -> int:
            moved = conn.execute(statement, {**params, "limit": 2**31 - 1}).rowcount
            # A long reader may have come while the rows moved.
            self.check_holders(conn, locks)
            conn.execute(self.queries["attach_partition"], {"parent": parent, "day": day})
            return moved

        moved = self.locked(locks, move_and_attach)
        self.report.moved[default] = self.report.moved.get(default, 0) + moved

    # -- reclaimers ------------------------------------------------------------------------

    def reclaim(self, name: str) -> StepResult:
        if self.dry_run:
            return StepResult("skipped", "dry run: nothing reclaimed")
        fn = _reclaimer(name)
        if fn is None:
            return StepResult("skipped", "module not installed")
        total = 0
        while True:
            if self.out_of_time():
                self.report.reclaimed[name] = total
                return StepResult("skipped", f"reclaimed {total}; out of time")
            try:
                with self.pool.connection() as conn:
                    count = fn(conn, self.schema, limit=self.batch)
            except (psycopg.errors.UndefinedTable, SchemaMissing):
                logger.debug("Nothing to reclaim for %s: its table does not exist.", name)
                self.report.reclaimed[name] = total
                return StepResult("ok", "no table")
            total += count
            if count < self.batch:
                self.report.reclaimed[name] = total
                return StepResult("ok", f"reclaimed {total} expired row(s)")


def _raise(error: BaseException) -> None:
    raise error


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
    """Run the maintenance steps (:data:`STEPS`): partitions ahead, expired days dropped,
    DEFAULT partitions emptied, then the reclaimers. Each step runs on its own: one that
    fails is logged with its error and reported, and the others still run.

    Parameters:
      pool(ProcessPool): where connections come from.
      schema(str): the broker's schema.
      policy(RetentionPolicy): the age of each status.
      batch(int): the most rows one transaction deletes or moves.
      dry_run(bool): only count what would be deleted; nothing changes (no partition is
        created either).
      budget_seconds(float): stop starting new batches after this long (the next run goes
        on where this one stopped); None runs until nothing is left.
      stop(threading.Event): stop between batches once set (worker shutdown).
      rest(bool): rest between batches (see :data:`DUTY_CYCLE_REST`).
      now(datetime): the clock to measure ages against; default the server's.
      partitions_ahead(int): days ahead whose partitions are created.

    Returns:
      PruneReport: what went, per status, and each step's result; ``complete`` is False
      when the budget or ``stop`` ended the run early, a step failed, or a partition's lock
      was not granted (the next run goes on).
    """
    return _Run(
        pool,
        schema,
        policy,
        batch=batch,
        dry_run=dry_run,
        budget_seconds=budget_seconds,
        stop=stop,
        rest=rest,
        partitions_ahead=partitions_ahead,
    ).run(now)


#: Partitions up to this size are counted exactly before they are dropped; bigger ones
#: are reported with PostgreSQL's estimate of their rows (counting would read them all).
EXACT_COUNT_MAX_BYTES = 64 * 1024 * 1024

#: How long :func:`create_partitions` (one transaction for many partitions, used by tests
#: and by hand) waits for each lock before skipping that partition.
DROP_LOCK_TIMEOUT = "2s"


def create_partitions(
    conn, schema: str, today: dt.datetime, days_ahead: int, queries: Queries | None = None
) -> int:
    """Create the daily partitions of history and events from ``today``'s UTC day through
    ``days_ahead`` days later (those missing), in one transaction (the SQL function
    ``create_history_partitions``); returns how many were created. Maintenance runs do it
    one statement per transaction instead (:func:`prune`'s ``create`` step)."""
    first = today.astimezone(dt.timezone.utc).date()
    params = {"first_day": first, "last_day": first + dt.timedelta(days=days_ahead)}
    with conn.transaction():
        # Creators in several processes take turns on the function's advisory lock: wait
        # for it here, before the lock timeout is set, so that a turn is never a failure.
        conn.execute("SELECT pg_advisory_xact_lock(1685221479, hashtext(%s))", (schema,))
        conn.execute(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'")
        queries = queries or Queries(schema, "retention.sql")
        created = conn.execute(queries["create_partitions"], params)
        return created.fetchone()[0]


@dataclasses.dataclass
class PartitionStatus:
    """For ``status``: how many days ahead every parent has its partition attached, and
    the rows of each DEFAULT partition (counted up to :data:`STATUS_COUNT_CAP`)."""

    days_ahead: int
    through: dt.date | None
    default_rows: dict[str, int]
    pending: list[str]


#: ``status`` counts the rows of a DEFAULT partition up to this many.
STATUS_COUNT_CAP = 1_000_000


def partition_status(conn: psycopg.Connection, schema: str) -> PartitionStatus:
    """What ``dramatiq-pg-broker status`` shows of history's partitions."""
    queries = Queries(schema, "retention.sql")
    today = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()[0]
    attached = {r[0] for r in conn.execute(queries["history_partition_names"])}
    ahead = -1
    while all(
        _partition_name(parent, today + dt.timedelta(days=ahead + 1)) in attached
        for parent in PARENTS
    ):
        ahead += 1
        if ahead > 3660:
            break
    rows = {}
    for parent in PARENTS:
        default = f"{parent}_default"
        rows[default] = conn.execute(
            _for(queries["default_rows"], default), {"cap": STATUS_COUNT_CAP}
        ).fetchone()[0]
    pending = [r[2] for r in conn.execute(queries["pending_partitions"])]
    return PartitionStatus(
        days_ahead=ahead,
        through=today + dt.timedelta(days=ahead) if ahead >= 0 else None,
        default_rows=rows,
        pending=pending,
    )


def prune_with_settings(pool: ProcessPool, settings: Settings, **kwargs) -> PruneReport:
    """:func:`prune` with the policy, batch size and partitions ahead of ``settings``."""
    kwargs.setdefault("batch", settings.retention_batch)
    kwargs.setdefault("partitions_ahead", settings.history_partitions_ahead)
    return prune(pool, settings.schema, RetentionPolicy.from_settings(settings), **kwargs)
