"""Periodic actors: cron and interval schedules run by the ordinary worker processes.

Declare a schedule above the actor::

    @periodic("*/5 * * * *", timezone="Europe/Paris")
    @dramatiq.actor
    def report(): ...

    @periodic(every=30, missed="skip")
    @dramatiq.actor
    def heartbeat(): ...

or give ``PostgresBroker(schedules=[Schedule("report", cron="0 * * * *")])``.

Every worker process runs an APScheduler ``BackgroundScheduler``, started by the
:class:`Periodic` middleware after the worker boots and stopped when it shuts down; there
is no scheduler process to deploy. Each process enqueues every tick it sees, with the tick
as the job's idempotency key (``periodic:<schedule>:<tick in UTC>``): however many
processes on however many hosts fire the same tick, the database keeps one job. Ticks are
computed from the schedule alone (cron fire times; interval ticks aligned to whole
multiples of the interval since 2000-01-01 UTC), so every process agrees on them.

Missed ticks: when a worker boots and the schedule's last enqueued tick is older than the
latest tick due (every worker was down), ``missed="run_once"`` (the default) enqueues one
job for the latest missed tick, and ``missed="skip"`` enqueues nothing. The job's message
carries ``options["periodic"] = {"schedule", "tick", "missed"}`` (``missed``: how many
ticks this job stands for).

The same scheduler runs the broker's maintenance: retention (see :mod:`.retention`) once
per ``retention_interval`` across all processes, decided by a compare-and-set on the
maintenance schedule's last tick.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import dramatiq
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from dramatiq.errors import ActorNotFound, BrokerConnectionError
from dramatiq.middleware import Middleware

from ..config import Settings
from ..db.queries import Queries
from ..errors import ConfigurationError
from .retention import RetentionPolicy, prune
from .schedules import UTC, Schedule

if TYPE_CHECKING:
    from ..db.core import ProcessPool
    from ..db.handshake import SchemaGate

logger = logging.getLogger("dramatiq_pg_broker.periodic")


#: The name of the retention schedule in the schedules table.
RETENTION_SCHEDULE = "dramatiq_pg_broker.retention"


def periodic(
    cron: str | None = None,
    *,
    every: float | dt.timedelta | None = None,
    timezone: str = "UTC",
    missed: str = "run_once",
    name: str | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
):
    """Run the decorated actor on a schedule. Goes above ``@dramatiq.actor``; the actor's
    broker must be a :class:`~dramatiq_pg_broker.PostgresBroker`. See :class:`Schedule`
    for the parameters.

    Raises:
      ConfigurationError: a bad expression, time zone, policy, or a second schedule with
        the same name.
    """

    def decorator(actor: dramatiq.Actor) -> dramatiq.Actor:
        if not isinstance(actor, dramatiq.Actor):
            raise ConfigurationError("@periodic goes above @dramatiq.actor, not below it")
        schedule = Schedule(
            actor.actor_name,
            cron=cron,
            every=every,
            timezone=timezone,
            missed=missed,
            name=name,
            args=args,
            kwargs=kwargs or {},
        )
        add_schedule(actor.broker, schedule)
        return actor

    return decorator


def add_schedule(broker: dramatiq.Broker, schedule: Schedule) -> None:
    """Register a schedule on a broker (what :func:`periodic` does)."""
    schedules = getattr(broker, "schedules", None)
    if schedules is None:
        raise ConfigurationError(
            f"schedule {schedule.name!r}: periodic actors need a PostgresBroker, "
            f"not {type(broker).__name__}"
        )
    if any(s.name == schedule.name for s in schedules):
        raise ConfigurationError(f"two schedules are named {schedule.name!r}")
    schedules.append(schedule)


def list_schedules(conn, schema: str) -> list[dict[str, Any]]:
    """Every schedule the workers registered, with its last tick and next run (what the
    CLI and the admin API show)."""
    cur = conn.execute(Queries(schema, "periodic.sql")["list_schedules"])
    names = [d.name for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


@dataclasses.dataclass(eq=False, repr=False, kw_only=True)
class Scheduler:
    """The schedules of one worker process on an APScheduler ``BackgroundScheduler``.
    :class:`Periodic` builds one when the worker boots (its ``new_scheduler``, which the
    broker binds to its parts).

    Parameters:
      pool(ProcessPool): where the schedule rows are written, and retention runs.
      settings(Settings): the schema, retention's settings.
      schedules(Sequence[Schedule]): the broker's schedules (its list, which ``@periodic``
        adds to: read when the scheduler starts).
      actors(Mapping[str, Actor]): the broker's actors, by name.
      enqueue(callable): ``enqueue(message)`` sends a tick's message and returns it as
        stored (the broker's :meth:`~dramatiq_pg_broker.PostgresBroker.enqueue`).
    """

    pool: ProcessPool
    settings: Settings
    schedules: Sequence[Schedule]
    actors: Mapping[str, dramatiq.Actor]
    enqueue: Callable[[dramatiq.Message], dramatiq.Message]

    def __post_init__(self) -> None:
        self.queries = Queries(self.settings.schema, "periodic.sql")
        self._seen: dict[str, dt.datetime] = {}
        #: Schedules whose registration could not reach the database yet, with the boot
        #: time their catch-up is computed from; retried at their next firing.
        self._pending: dict[str, dt.datetime] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._scheduler: BackgroundScheduler | None = None
        self.retention = Schedule(RETENTION_SCHEDULE, every=self.settings.retention_interval)

    @property
    def running(self) -> bool:
        return self._scheduler is not None

    def next_fire_time(self, name: str) -> dt.datetime | None:
        """When the schedule ``name`` fires next in this process (None while the scheduler
        is not running, or for a name it does not run)."""
        scheduler = self._scheduler
        job = scheduler.get_job(name) if scheduler is not None else None
        return job.next_run_time if job is not None else None

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called (a stopped scheduler never starts again)."""
        return self._stop.is_set()

    def check(self) -> None:
        """Check the schedules without any I/O.

        Raises:
          ConfigurationError: a schedule names an actor the broker does not know.
        """
        for schedule in self.schedules:
            if schedule.actor_name not in self.actors:
                raise ConfigurationError(
                    f"schedule {schedule.name!r} names actor {schedule.actor_name!r}, which "
                    "is not declared on this broker"
                )

    def start(self, now: dt.datetime | None = None) -> None:
        """Register every schedule, enqueue the catch-up of missed ticks, and start firing
        (unless :meth:`stop` was called meanwhile).

        Raises:
          ConfigurationError: a schedule names an actor the broker does not know.
        """
        if self._scheduler is not None:
            return
        self.check()
        schedules = list(self.schedules)
        if not schedules and not self.settings.retention:
            return
        now = now or dt.datetime.now(UTC)
        for schedule in schedules:
            if self._stop.is_set():
                return
            self.try_register(schedule, now)
        if self.settings.retention and not self._stop.is_set():
            self.try_register(self.retention, now, kind="maintenance")

        for name in ("apscheduler.scheduler", "apscheduler.executors.default"):
            quiet = logging.getLogger(name)
            if quiet.level == logging.NOTSET:
                # APScheduler logs every run at INFO: one line a second per process.
                quiet.setLevel(logging.WARNING)
        scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(4)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone=UTC,
        )
        for schedule in schedules:
            scheduler.add_job(
                self.fire, schedule.trigger(), args=[schedule], id=schedule.name, name=schedule.name
            )
        if self.settings.retention:
            scheduler.add_job(
                self.fire_retention,
                self.retention.trigger(),
                id=RETENTION_SCHEDULE,
                name=RETENTION_SCHEDULE,
            )
        with self._lock:
            if self._stop.is_set():
                return  # stopped while the schedules were registered
            scheduler.start()
            self._scheduler = scheduler
        # A tick that fell between the registration above and the scheduler's start is
        # enqueued now, not a period late. Fired here rather than as an immediate first run
        # of the APScheduler job: an interval trigger counts its next run from the previous
        # one, which would shift every later run off the aligned ticks.
        for schedule in schedules:
            self.fire(schedule)
        logger.info(
            "Scheduler started: %d schedule(s)%s.",
            len(schedules),
            f", retention every {self.settings.retention_interval:g}s"
            if self.settings.retention
            else "",
        )

    def stop(self) -> None:
        """Stop firing; waits for a tick being enqueued, interrupts a retention run between
        two batches."""
        self._stop.set()
        with self._lock:
            scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.shutdown(wait=True)

    # -- ticks ---------------------------------------------------------------------------

    def upsert(self, schedule: Schedule, now: dt.datetime, *, kind: str = "actor"):
        """Write a schedule's definition row (``kind``: ``actor`` or ``maintenance``), its
        next run computed from ``now``. Returns the last tick enqueued for it (None for a
        new schedule).

        Raises:
          dramatiq.errors.ConnectionError: the database cannot be reached.
        """
        actor = self.actors.get(schedule.actor_name) if kind == "actor" else None
        params = {
            "name": schedule.name,
            "kind": kind,
            "actor_name": schedule.actor_name if actor else None,
            "queue_name": actor.queue_name if actor else None,
            "trigger": schedule.description,
            "timezone": schedule.timezone,
            "missed": schedule.missed,
            "next_run": schedule.next_run(now),
        }
        with self.pool.connection() as conn:
            return conn.execute(self.queries["upsert_schedule"], params).fetchone()[0]

    def try_register(self, schedule: Schedule, boot: dt.datetime, *, kind: str = "actor") -> bool:
        """Register a schedule (once), as the scheduler's start does. False when the
        database cannot be reached: the schedule is left pending, and its next firing tries
        again with the same boot time, so no tick is lost."""
        with self._lock:
            boot = self._pending.get(schedule.name, boot)
        try:
            if kind == "actor":
                self.register(schedule, boot)
            else:
                self.upsert(schedule, boot, kind=kind)
        except BrokerConnectionError as e:
            # The outage is told once by the process (outage.py); nothing is lost here.
            logger.debug(
                "Schedule %s could not be registered yet (it will be at its next tick): %s",
                schedule.name,
                e,
            )
            with self._lock:
                self._pending[schedule.name] = boot
                self._seen.setdefault(schedule.name, boot)
            return False
        with self._lock:
            self._pending.pop(schedule.name, None)
        return True

    def register(self, schedule: Schedule, now: dt.datetime) -> dt.datetime | None:
        """Write the schedule's definition and, under ``run_once``, enqueue one job for the
        latest tick missed since its last enqueued tick. Ticks after ``now`` are this
        process's to fire. Returns the catch-up tick, if one was enqueued."""
        last_tick = self.upsert(schedule, now)
        with self._lock:
            self._seen[schedule.name] = now
        if last_tick is None or schedule.missed == "skip":
            if last_tick is not None:
                _, count = schedule.ticks(last_tick, now)
                if count:
                    logger.info("Schedule %s: skipping %d missed tick(s).", schedule.name, count)
            return None
        ticks, count = schedule.ticks(last_tick, now)
        if not ticks:
            return None
        logger.info(
            "Schedule %s: %d tick(s) missed since %s; enqueuing one job for %s.",
            schedule.name,
            count,
            last_tick.isoformat(),
            ticks[-1].isoformat(),
        )
        self.enqueue_tick(schedule, ticks[-1], missed=count, now=now)
        return ticks[-1]

    def fire(self, schedule: Schedule, now: dt.datetime | None = None) -> list[dt.datetime]:
        """Enqueue every tick of ``schedule`` due since this process last fired it (one, on
        time; more if this process fell behind). Returns the ticks enqueued."""
        now = now or dt.datetime.now(UTC)
        if schedule.name in self._pending and not self.try_register(schedule, now):
            return []
        with self._lock:
            seen = self._seen.get(schedule.name, now)
        ticks, _ = schedule.ticks(seen, now)
        done: list[dt.datetime] = []
        try:
            for tick in ticks:
                self.enqueue_tick(schedule, tick, now=now)
                done.append(tick)
                with self._lock:
                    self._seen[schedule.name] = max(self._seen.get(schedule.name, tick), tick)
            with self._lock:
                self._seen[schedule.name] = max(self._seen.get(schedule.name, now), now)
        except BrokerConnectionError as e:
            # The ticks not written stay due: the next firing enqueues them. The outage is
            # told once by the process (outage.py).
            logger.debug("Schedule %s: could not enqueue a tick: %s", schedule.name, e)
        return done

    def enqueue_tick(
        self, schedule: Schedule, tick: dt.datetime, *, missed: int = 1, now=None
    ) -> dramatiq.Message:
        """Enqueue the job of one tick (a no-op if any process already did) and record the
        tick on the schedule row."""
        actor = self.actors.get(schedule.actor_name)
        if actor is None:
            raise ActorNotFound(schedule.actor_name)
        tick = tick.astimezone(UTC)
        message = actor.message_with_options(
            args=schedule.args,
            kwargs=schedule.kwargs,
            idempotency_key=schedule.key(tick),
            periodic={"schedule": schedule.name, "tick": tick.isoformat(), "missed": missed},
        )
        sent = self.enqueue(message)
        params = {
            "name": schedule.name,
            "tick": tick,
            "job_id": sent.message_id,
            "next_run": schedule.next_run(max(tick, now or tick)),
        }
        with self.pool.connection() as conn:
            conn.execute(self.queries["record_tick"], params)
        return sent

    # -- maintenance ---------------------------------------------------------------------

    def claim_tick(self, schedule: Schedule, now: dt.datetime) -> dt.datetime | None:
        """The latest tick of a maintenance schedule, if this process is the one to run it
        (compare-and-set on the schedule row); else None."""
        ticks, _ = schedule.ticks(now - schedule.every, now)
        if not ticks:
            return None
        tick = ticks[-1]
        params = {"name": schedule.name, "tick": tick, "next_run": schedule.next_run(now)}
        with self.pool.connection() as conn:
            won = conn.execute(self.queries["claim_tick"], params).fetchone()
        return tick if won else None

    def fire_retention(self, now: dt.datetime | None = None):
        """Run retention if this process wins the tick. Returns the report, or None."""
        now = now or dt.datetime.now(UTC)
        if self.retention.name in self._pending and not self.try_register(
            self.retention, now, kind="maintenance"
        ):
            return None
        try:
            if self.claim_tick(self.retention, now) is None:
                return None
            report = prune(
                self.pool,
                self.settings.schema,
                RetentionPolicy.from_settings(self.settings),
                batch=self.settings.retention_batch,
                budget_seconds=self.settings.retention_interval * 0.8,
                stop=self._stop,
                partitions_ahead=self.settings.history_partitions_ahead,
            )
        except BrokerConnectionError as e:
            # Told once per outage by the process (outage.py); the next run catches up.
            logger.debug("Retention could not reach the database: %s", e)
            return None
        except Exception:
            logger.exception("Retention failed.")
            return None
        # Each failed step was logged with its error by the run; the others ran.
        if report.total_jobs or any(report.reclaimed.values()):
            logger.info(
                "Retention deleted %d finished job(s) %s%s.",
                report.total_jobs,
                report.jobs,
                "" if report.complete else "; the rest goes at the next run",
            )
        return report


#: How long a worker's boot waits for its scheduler to start (it starts at once unless the
#: database is slow or unreachable; it goes on starting in its thread after).
START_WAIT_SECONDS = 1.0


@dataclasses.dataclass(eq=False, repr=False, kw_only=True)
class Periodic(Middleware):
    """Starts the process's :class:`Scheduler` after the worker boots (once the schema
    handshake passed) and stops it on shutdown.
    :class:`~dramatiq_pg_broker.PostgresBroker` installs it; it does nothing with
    ``scheduler=False``.

    Parameters:
      schema_gate(SchemaGate): the scheduler starts once it is open.
      settings(Settings): its ``scheduler`` (False: nothing starts).
      new_scheduler(callable): ``new_scheduler()`` is a :class:`Scheduler` of the broker's
        schedules, not started (the broker's binds the :class:`Scheduler` to its pool,
        settings, schedules, actors and ``enqueue``): one when the worker boots, and a new
        one when a stopped worker boots again.
    """

    schema_gate: SchemaGate
    settings: Settings
    new_scheduler: Callable[[], Scheduler]
    #: The scheduler the last worker boot started (None before the first boot).
    scheduler: Scheduler | None = dataclasses.field(init=False, default=None)

    def after_worker_boot(self, broker, worker) -> None:
        if not self.settings.scheduler:
            return
        if self.scheduler is None or self.scheduler.stopped:
            self.scheduler = self.new_scheduler()
        scheduler = self.scheduler
        scheduler.check()
        # Starting writes the schedules to the database. A worker booting while the
        # database is unreachable must not wait for that (the pool's timeout): Dramatiq
        # prints nothing of its workers until every one has booted, so the log would stay
        # empty meanwhile. The start goes on in its own thread; the boot waits a moment.
        starting = threading.Thread(
            target=self._start, args=(scheduler,), name="dramatiq-pg-scheduler-start", daemon=True
        )
        starting.start()
        starting.join(START_WAIT_SECONDS)

    def _start(self, scheduler: Scheduler) -> None:
        gate = self.schema_gate
        # Nothing is written before the worker's schema handshake passed.
        while not gate.wait(1.0):
            if scheduler.stopped:
                return
        try:
            scheduler.start()
        except Exception:
            logger.exception("The scheduler could not start.")

    def before_worker_shutdown(self, broker, worker) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
