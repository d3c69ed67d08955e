"""Retention's partition steps: create the days ahead, drop expired days, and move
rows that fell into a ``DEFAULT`` partition to their own day (see :mod:`.retention`)."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable

import psycopg
from psycopg import sql

from ..errors import SchemaMissing
from .ddl import (
    ACCESS_EXCLUSIVE,
    DDL_TRIES,
    PARENTS,
    SHARE_UPDATE_EXCLUSIVE,
    LockBusy,
    LockedDDL,
    StepResult,
    _attach_locks,
    _day_of,
    _detach_locks,
    _for,
    _identifiers,
    _named,
    _partition_name,
)

logger = logging.getLogger("dramatiq_pg_broker.retention")

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


#: Partitions up to this size are counted exactly before they are dropped; bigger ones
#: are reported with PostgreSQL's estimate of their rows (counting would read them all).
EXACT_COUNT_MAX_BYTES = 64 * 1024 * 1024


class PartitionSteps(LockedDDL):
    """A run's partition steps: create, drop, default (a part of
    :class:`.retention._Run`)."""

    def scan_is_brief(self, partition: str) -> bool:
        """Whether an attach may scan ``partition`` (a DEFAULT one) under its lock."""
        with self.pool.connection() as conn:
            (size,) = conn.execute(
                self.queries["relation_size"], {"schema": self.schema, "partition": partition}
            ).fetchone()
        return (size or 0) <= SCAN_AT_ONCE_BYTES

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
                except (psycopg.errors.UndefinedTable, SchemaMissing):
                    # Dropped or detached meanwhile (a dry run beside a run, or a run
                    # whose turn was lost): the pool reports a missing table as the
                    # schema's (SchemaMissing), its cause says which.
                    continue
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
            else:
                days = conn.execute(_for(self.queries["history_default_days"], default)).fetchall()
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
            if not self.move_day(parent, day, default):
                busy.append(target)
            if self.out_of_time():
                return False
        return True

    def move_day(self, parent: str, day: dt.date, default: str) -> bool:
        """Move one day's rows out of ``default`` into the day's partition and attach it.
        False when a lock was not granted (the rows are then where readers see them: in
        DEFAULT, unless a constraint that could not be dropped keeps them out of it until
        the next run)."""
        target = _partition_name(parent, day)
        statement = _named(
            self.queries["move_default_day"],
            partition=default,
            target=target,
            column=PARENTS[parent],
        )
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
