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
import threading
import time
from collections.abc import Callable

import psycopg
from dramatiq.errors import BrokerConnectionError

from ..config import Settings
from ..db.core import ProcessPool
from ..db.queries import Queries
from ..errors import SchemaMissing
from .ddl import FINISHED, PARENTS, StepResult, Turn, TurnLost, _for, _partition_name
from .partitions import PartitionSteps

logger = logging.getLogger("dramatiq_pg_broker.retention")

#: Modules of this package whose ``prune_expired(conn, schema, *, limit) -> int`` a run
#: calls after the jobs (expired results, rate-limit keys, worker registrations, abort
#: events), each a step named after its module's last name. A module that does not exist,
#: or whose table does not exist yet, is skipped; an error raised while importing one that
#: exists (a missing dependency, a broken import) is raised. Imported by name, as the
#: broker's rooms above this one, which this room may not import, hold them.
RECLAIMERS = ("backends.results", "backends.rate_limits", "control.workers", "backends.abort")

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


#: The steps that change history's partitions: one run at a time takes them (see
#: :class:`.ddl.Turn`); a run started while another has them skips them.
PARTITION_STEPS = ("create", "drop", "default")

#: The steps of a run, in order. Each runs on its own and reports ``ok``, ``skipped`` or
#: ``failed`` (with its error): one failing never stops the others.
STEPS = (*PARTITION_STEPS, *(module.rpartition(".")[2] for module in RECLAIMERS))


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
    """The ``prune_expired`` of module ``name`` of this package (``backends.results``);
    None when the module does not exist. An error raised while importing one that exists
    (a missing dependency, a broken import) is raised: the step fails with it."""
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


@dataclasses.dataclass(eq=False)
class _Run(PartitionSteps):
    """One retention run: the steps, the clock, the budget and the report. Its parameters
    are :func:`prune`'s (a dataclass: they are the run's state as given)."""

    pool: ProcessPool
    schema: str
    policy: RetentionPolicy
    _: dataclasses.KW_ONLY
    batch: int
    dry_run: bool
    budget_seconds: float | None
    stop: threading.Event | None
    rest: bool
    partitions_ahead: int
    clock: dt.datetime | None = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        self.queries = Queries(self.schema, "retention.sql")
        self.report = PruneReport(dry_run=self.dry_run)
        self.started = time.monotonic()
        for status in self.policy.ages():
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
        except TurnLost as e:
            logger.warning(
                "Maintenance step %s stopped: the connection holding the partition steps' "
                "turn ended (%s); the next run goes on.",
                name,
                e,
            )
            self.turn = None
            result = StepResult("skipped", f"the partition steps' turn was lost ({e})")
            self.report.complete = False
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
        self.partition_steps()
        for module in RECLAIMERS:
            self.step(module.rpartition(".")[2], functools.partial(self.reclaim, module))
        return self.report

    def partition_steps(self) -> None:
        """The steps that change history's partitions, if this run gets the turn (see
        :class:`.ddl.Turn`); a dry run changes nothing and needs none."""
        steps = {"create": self.create, "drop": self.drop, "default": self.default}
        if self.dry_run:
            for name, fn in steps.items():
                self.step(name, fn)
            return
        try:
            with Turn.take(self.pool.url, self.schema, self.queries["take_turn"]) as turn:
                if not turn.ours:
                    detail = turn.describe_holder()
                    logger.info("Partition steps skipped: %s.", detail)
                    for name in steps:
                        self.report.steps[name] = StepResult("skipped", detail)
                    return
                self.turn = turn
                try:
                    for name, fn in steps.items():
                        if self.turn is None:
                            self.report.steps[name] = StepResult(
                                "skipped", "the partition steps' turn was lost"
                            )
                        else:
                            self.step(name, fn)
                finally:
                    self.turn = None
        except Exception as e:
            # The turn could not be taken (the database is unreachable): each step reports it.
            for name in steps:
                if name not in self.report.steps:
                    self.step(name, functools.partial(_raise, e))

    # -- reclaimers ------------------------------------------------------------------------

    def reclaim(self, module: str) -> StepResult:
        if self.dry_run:
            return StepResult("skipped", "dry run: nothing reclaimed")
        fn = _reclaimer(module)
        name = module.rpartition(".")[2]
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
