"""``dramatiq-pg-broker doctor``: the live database as the broker sees it, each finding with
what to do.

What sinks a PostgreSQL job queue in production is rarely the queue's own code; it is the
database around it. Each check here reads the server's statistics views, the catalog, or a
partial index of the broker's tables, and gives one :class:`Finding`: a level (``ok``,
``warning``, ``problem``, or ``skipped`` when it could not look), one line saying what it
found, the figures behind it, and what to do. The checks, in the order they print:

- ``schema``: migrations this code ships that the schema lacks, or a schema that no longer
  admits this code (:mod:`..db.handshake`);
- ``snapshot``: the oldest holder of the database's xmin horizon: a session with an open
  snapshot or transaction (pid, application, age, query), a prepared transaction, or a
  replication slot's xmin. Vacuum removes no row version that died after it, so every
  claim wades through more dead rows of the hot table for as long as it is held;
- ``hot_table``: the jobs table's dead row versions and size against its live rows, and
  when a vacuum last ran on it; autovacuum turned off;
- ``idle_transactions``: sessions idle in a transaction that hold job rows locked (a
  worker's outcome for such a job waits for them);
- ``expired_leases``: running jobs whose lease expired with no live worker to take them
  back (or live workers whose reaper does not);
- ``unattended_queues``: queues with runnable jobs waiting and no live worker consuming
  them;
- ``partitions``: missing partitions of history for today and the days ahead, and rows
  left in the DEFAULT partitions (:func:`..history.retention.partition_status`);
- ``connections``: slots in use against ``max_connections``, and what the live workers
  may open between them (each records its budget, :attr:`.Settings.connection_budget`);
- ``replication_slots``: slots keeping WAL (inactive ones, or far behind).

:func:`examine` runs them on one connection that it does not take from the broker's pool
(the pool's schema handshake would refuse a schema behind the code, which is one of the
things to report). Its statements stop after :data:`STATEMENT_TIMEOUT_MS`. The
``dramatiq-pg-broker doctor`` command prints the report (``--json`` for scripts) and
exits 0 when every finding is ok, 1 with warnings, 2 with problems; the admin API's
``/metrics`` exports the figures as gauges and its dashboard lists the findings: one
implementation, three readers. The thresholds (:class:`Thresholds`) have documented
defaults; the command takes each as an option.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import textwrap
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import psycopg

from ..control.overview import NO_WORKER, UNDECLARED, overview
from ..control.workers import list_workers
from ..db.handshake import newer_message, pending_message, read_state, this_code, too_old_message
from ..db.queries import statements_for
from ..history.retention import partition_status

#: The levels of a finding, from best to worst; ``skipped`` (the check could not look)
#: does not count towards the exit status.
LEVELS = ("ok", "warning", "problem")
SKIPPED = "skipped"

#: The exit status of each overall level.
EXIT_CODES = {"ok": 0, "warning": 1, "problem": 2}

#: Longest any statement of the examination may run.
STATEMENT_TIMEOUT_MS = 10_000

#: Characters of a session's query shown.
QUERY_CHARS = 200

#: The connection budget counted for a worker of an earlier release (it recorded none):
#: this release's default (a pool of 10, its LISTEN connection, maintenance's turn).
EARLIER_RELEASE_BUDGET = 12


def _threshold(default: float, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Where a figure turns a finding into a warning or a problem. Each field is an option
    of ``dramatiq-pg-broker doctor`` (``snapshot_warning_seconds`` is
    ``--snapshot-warning-seconds``)."""

    snapshot_warning_seconds: float = _threshold(
        60.0,
        "age of the oldest open snapshot (or transaction) of the database that is a warning: "
        "at a few hundred jobs a second the hot table's dead rows pile up within a minute",
    )
    snapshot_problem_seconds: float = _threshold(
        300.0, "age of the oldest open snapshot that is a problem"
    )
    horizon_warning_xids: float = _threshold(
        1_000_000,
        "transactions a replication slot's xmin may lag before it is a warning (a slot's "
        "age has no time)",
    )
    dead_tuples_warning: float = _threshold(
        100_000,
        "dead row versions of the jobs table that are a warning, when they also outnumber "
        "its live rows",
    )
    dead_tuples_problem: float = _threshold(
        1_000_000, "dead row versions of the jobs table that are a problem (idem)"
    )
    vacuum_stale_seconds: float = _threshold(
        600.0,
        "seconds since the jobs table's last vacuum that are a warning while its dead rows "
        "are over the warning",
    )
    idle_transaction_warning_seconds: float = _threshold(
        10.0, "seconds a session may sit idle in a transaction that locks job rows"
    )
    idle_transaction_problem_seconds: float = _threshold(
        60.0,
        "seconds idle in such a transaction that are a problem (or any past the warning, "
        "while a session waits for it)",
    )
    expired_lease_grace_seconds: float = _threshold(
        60.0,
        "seconds a running job's lease may have expired before it counts (a live worker's "
        "reaper takes it back within its interval, 10 s by default)",
    )
    unattended_warning_seconds: float = _threshold(
        60.0, "age of the oldest runnable job of a queue no live worker consumes that is a warning"
    )
    partitions_ahead_warning: float = _threshold(
        2, "days ahead with history partitions below which it is a warning"
    )
    connections_warning: float = _threshold(
        0.75, "share of the connection slots in use that is a warning"
    )
    connections_problem: float = _threshold(
        0.9, "share of the connection slots in use that is a problem"
    )
    slot_wal_warning_bytes: float = _threshold(
        1 << 30, "WAL a replication slot keeps that is a warning (bytes)"
    )
    slot_wal_problem_bytes: float = _threshold(
        10 << 30, "WAL a replication slot keeps that is a problem (bytes)"
    )

    @classmethod
    def documented(cls) -> list[tuple[str, float, str]]:
        """``(name, default, doc)`` of every threshold, in order."""
        return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(cls)]


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one check found.

    Attributes:
      check(str): the check's name (``snapshot``, ``hot_table`` ...).
      level(str): ``ok``, ``warning``, ``problem`` or ``skipped``.
      title(str): what it found, in one line.
      details(tuple[str, ...]): more lines (the other holders, each slot ...).
      advice(str): what to do (None when there is nothing to do).
      figures(dict): the numbers behind it, for ``--json`` and the metrics.
    """

    check: str
    level: str
    title: str
    details: tuple[str, ...] = ()
    advice: str | None = None
    figures: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "level": self.level,
            "title": self.title,
            "details": list(self.details),
            "advice": self.advice,
            "figures": dict(self.figures),
        }


@dataclasses.dataclass(frozen=True)
class Report:
    """Every finding of one examination, in check order."""

    findings: tuple[Finding, ...]
    #: The server's time of the examination.
    checked_at: dt.datetime

    @property
    def level(self) -> str:
        """The worst level of the findings, a ``skipped`` one counting as a warning: a
        check that could not look (no permission, a statement that ran out of time) does
        not let the report, and the command's exit status, say that all is well."""
        levels = [f.level if f.level in LEVELS else "warning" for f in self.findings]
        return max(levels, key=LEVELS.index, default="ok")

    @property
    def exit_code(self) -> int:
        """0 when healthy, 1 with warnings, 2 with problems."""
        return EXIT_CODES[self.level]

    def finding(self, check: str) -> Finding | None:
        """The finding of ``check``, if it ran."""
        return next((f for f in self.findings if f.check == check), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "exit_code": self.exit_code,
            "checked_at": self.checked_at,
            "findings": [f.as_dict() for f in self.findings],
        }


# -- formatting --------------------------------------------------------------------------


def age(seconds: float | None) -> str:
    """``45s``, ``2m 30s``, ``3h 5m``, ``2d 4h``; ``-`` for None."""
    if seconds is None:
        return "-"
    seconds = max(0, int(seconds))
    for unit, sub, big, small in (("d", "h", 86400, 3600), ("h", "m", 3600, 60), ("m", "s", 60, 1)):
        if seconds >= big:
            rest = seconds % big // small
            return f"{seconds // big}{unit}" + (f" {rest}{sub}" if rest else "")
    return f"{seconds}s"


def size(n: float | None) -> str:
    """``812 kB``, ``4.2 MB``, ``1.3 GB`` (powers of 1024, as PostgreSQL's
    ``pg_size_pretty``)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if value < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit in ("bytes", "kB") else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _who(application: str | None, user: str | None, client: str | None) -> str:
    where = f"{user or '?'}@{client}" if client else (user or "?")
    return f"{application}, {where}" if application else where


def _query(text: str | None) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= 120 else text[:119] + "…"


def _worse(*levels: str) -> str:
    return max(levels, key=LEVELS.index)


# -- the examination ---------------------------------------------------------------------


class Examination:
    """The checks' shared reads on one connection (each read once)."""

    def __init__(
        self,
        conn: psycopg.Connection,
        schema: str,
        thresholds: Thresholds,
        default_budget: int,
        lease_seconds: float,
    ) -> None:
        self.conn = conn
        self.schema = schema
        self.thresholds = thresholds
        self.default_budget = default_budget
        #: The workers' lease: a lease that ran out while the server was down counts once
        #: the server has been up that long (the reaper's rule, ``lease_ran_out``).
        self.lease_seconds = lease_seconds
        self.queries = statements_for(schema, filename="doctor.sql")
        self._cache: dict[str, Any] = {}

    def rows(self, name: str, params: Mapping[str, Any] | None = None) -> list[tuple]:
        params = {"schema": self.schema, **(params or {})}
        return self.conn.execute(self.queries[name], params).fetchall()

    def once(self, key: str, read: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = read()
        return self._cache[key]

    def hot_table(self) -> tuple | None:
        return self.once("hot_table", lambda: next(iter(self.rows("hot_table")), None))

    def lanes(self) -> list[tuple]:
        """Each lane of jobs: (lane, seconds since it was emptied or None, why the last try
        did not or None); nothing on a schema before 0028."""

        def read() -> list[tuple]:
            if not self.rows("job_lanes_exist")[0][0]:
                return []
            return self.rows("job_lanes")

        return self.once("lanes", read)

    def holders(self) -> list[tuple]:
        """The holders of the horizon, oldest first (at most five)."""
        return self.once(
            "holders",
            lambda: self.rows("snapshot_holders", {"query_chars": QUERY_CHARS, "limit": 5}),
        )

    def live_workers(self) -> list[dict[str, Any]]:
        return self.once("workers", lambda: list_workers(self.conn, self.schema))

    def blind(self, what: str) -> tuple[str, ...]:
        """A finding's detail saying this role sees only its own sessions' ``what`` (none
        when it sees every session's)."""
        if self.sees_every_session():
            return ()
        return (
            f"This role sees only its own sessions' {what}: grant it pg_monitor (or "
            "pg_read_all_stats) for the others'.",
        )

    def sees_every_session(self) -> bool:
        """Whether this role sees other roles' sessions (their queries and snapshots)."""
        return self.once(
            "sees",
            lambda: self.conn.execute(
                "SELECT current_setting('is_superuser') = 'on' "
                "OR pg_has_role('pg_read_all_stats', 'MEMBER')"
            ).fetchone()[0],
        )


def check_schema(ex: Examination) -> Finding:
    code = this_code()
    state = read_state(ex.conn, ex.schema)
    figures = {"level": state.level, "code_level": code.level}
    if not state.admits(code):
        return Finding(
            "schema",
            "problem",
            too_old_message(state, code),
            advice="Upgrade dramatiq-pg-broker where this ran (and on every worker host).",
            figures=figures,
        )
    pending = state.pending(code)
    if pending:
        return Finding(
            "schema",
            "problem",
            pending_message(state, code, pending),
            advice="Run `dramatiq-pg-broker migrate` (workers of this release wait for it and "
            "claim nothing meanwhile; see the upgrading guide for the deploy order).",
            figures={**figures, "pending": len(pending)},
        )
    unknown = state.unknown(code)
    if unknown:
        return Finding("schema", "ok", newer_message(state, code, unknown), figures=figures)
    return Finding(
        "schema", "ok", f"schema {ex.schema!r} is at migration {state.level:04d}", figures=figures
    )


def check_snapshot(ex: Examination) -> Finding:
    t = ex.thresholds
    holders = ex.holders()
    timed = [h for h in holders if h[6] is not None]
    horizon_age = max((h[6] for h in timed), default=0.0)
    figures: dict[str, Any] = {
        "horizon_age_seconds": round(horizon_age, 3),
        "horizon_xid_age": holders[0][7] if holders else 0,
        "holders": len(holders),
    }
    blind = ex.blind("snapshots")
    if not holders:
        return Finding("snapshot", "ok", "no session holds a snapshot", blind, figures=figures)
    # The holder named is the worst by its own level, the oldest horizon among equals: a
    # replication slot a few transactions back can come first and hide a session held
    # for hours behind it (a horizon's age in transactions and a session's in seconds
    # are not the same scale).
    levels = [_holder_level(h, t) for h in holders]
    worst = max(range(len(holders)), key=lambda n: (LEVELS.index(levels[n]), -n))
    level = levels[worst]
    lead = holders[worst]
    kind, pid, application, user, client, state, seconds, xids, query = lead
    if kind == "session":
        held = (
            f"has held a snapshot for {age(seconds)}"
            if seconds is not None
            else f"holds the horizon {xids:,} transactions back"  # a walsender
        )
        title = f"pid {pid} ({_who(application, user, client)}) {held} ({state}): {_query(query)}"
        advice = (
            f"End its transaction (COMMIT or ROLLBACK in the client that opened it), or end "
            f"the session: SELECT pg_terminate_backend({pid}). So that it does not return: "
            "idle_in_transaction_session_timeout for idle holders, statement_timeout (or, "
            "in PostgreSQL 17 and later, transaction_timeout) for the role that runs long "
            "reports, or run those on a standby."
        )
    elif kind == "prepared transaction":
        title = (
            f"prepared transaction {query!r} (owner {user}) has held the horizon for {age(seconds)}"
        )
        advice = (
            f"Finish it: COMMIT PREPARED '{query}' or ROLLBACK PREPARED '{query}', whichever "
            "its transaction manager meant."
        )
    else:
        title = (
            f"replication slot {application!r} ({query}, {state}) holds the horizon "
            f"{xids:,} transactions back"
        )
        advice = (
            f"An unused slot: SELECT pg_drop_replication_slot('{application}'). A physical "
            "slot fed by hot_standby_feedback: a long query on the standby holds it "
            "(max_standby_streaming_delay, or run it without the feedback)."
        )
    details = []
    hot = _hot_table_cost(ex)
    if hot is not None:
        details.append(hot)
    for other in (h for h in holders if h is not lead):
        details.append(
            f"also {other[0]} "
            + (
                f"pid {other[1]} ({_who(other[2], other[3], other[4])}), {age(other[6])}"
                if other[0] == "session"
                else f"{other[2] or other[8]!r}, {other[7]:,} transactions back"
            )
        )
    details.extend(blind)
    return Finding(
        "snapshot",
        level,
        title,
        tuple(details),
        advice if level != "ok" else None,
        figures,
    )


def _holder_level(holder: tuple, t: Thresholds) -> str:
    """One holder of the horizon's level: a session's or a prepared transaction's by its
    age in seconds, a replication slot's by its age in transactions."""
    seconds, xids = holder[6], holder[7]
    if seconds is not None:
        if seconds >= t.snapshot_problem_seconds:
            return "problem"
        return "warning" if seconds >= t.snapshot_warning_seconds else "ok"
    return "warning" if xids >= t.horizon_warning_xids else "ok"


def _hot_table_cost(ex: Examination) -> str | None:
    """What the held horizon costs the hot table, in one line (None: no jobs table)."""
    try:
        hot = ex.hot_table()
    except psycopg.errors.UndefinedTable:  # pragma: no cover - to_regclass gives NULL
        return None
    if hot is None:
        return None
    live, dead = hot[0], hot[1]
    return (
        f"vacuum can remove no row version of {ex.schema}.jobs that died since, and claims "
        f"read past them until the workers empty their lane (TRUNCATE, every 10 s, unless "
        f"the holder has read jobs; the long lane keeps them): it holds {dead:,} dead row "
        f"versions beside {live:,} live ones ({size(hot[2])})"
    )


def check_hot_table(ex: Examination) -> Finding:
    t = ex.thresholds
    hot = ex.hot_table()
    if hot is None:
        return Finding("hot_table", SKIPPED, f"no table {ex.schema}.jobs: run `migrate`")
    live, dead, heap, total, _, _, runs, since, options, autovacuum, naptime = hot
    options = dict(o.split("=", 1) for o in options or ())
    figures = {
        "live_tuples": live,
        "dead_tuples": dead,
        "heap_bytes": heap,
        "total_bytes": total,
        "vacuum_age_seconds": None if since is None else round(since, 3),
        "autovacuum_count": runs,
        "autovacuum_naptime_seconds": naptime,
    }
    lanes = ex.lanes()
    if lanes:
        # The workers empty one lane every 10 s (0028) while a snapshot holds the horizon
        # (0029): how long since each was, and why the last try at one did not.
        ages = [round(age_, 3) if age_ is not None else None for _, age_, _ in lanes]
        figures["lanes_emptied_seconds_ago"] = ages
        figures["lanes_left_because"] = sorted({why for _, _, why in lanes if why})
    last = "never vacuumed" if since is None else f"last vacuumed {age(since)} ago"
    title = (
        f"{ex.schema}.jobs: {live:,} live rows, {dead:,} dead, {size(heap)} "
        f"({size(total)} with its indexes); {last}"
    )
    if not autovacuum or options.get("autovacuum_enabled", "true").lower() in ("false", "off"):
        where = "on this server" if not autovacuum else f"for {ex.schema}.jobs"
        return Finding(
            "hot_table",
            "problem",
            f"autovacuum is off {where}: " + title,
            advice="Turn it on (`autovacuum = on`; ALTER TABLE ... RESET (autovacuum_enabled)):"
            " every job leaves dead rows in this table, and only vacuum removes them.",
            figures=figures,
        )
    level = "ok"
    if dead > live:
        if dead >= t.dead_tuples_problem:
            level = "problem"
        elif dead >= t.dead_tuples_warning:
            level = "warning"
    stale = dead >= t.dead_tuples_warning and (since is None or since >= t.vacuum_stale_seconds)
    if stale:
        level = _worse(level, "warning")
    advice = None
    if level != "ok":
        oldest = max((h[6] or 0 for h in ex.holders()), default=0)
        if oldest >= t.snapshot_warning_seconds:
            advice = "The oldest snapshot (see `snapshot`) keeps vacuum from removing them: end it."
        else:
            advice = (
                "Autovacuum falls behind this table. It visits each database once per "
                f"autovacuum_naptime ({age(naptime)} here): on a server whose jobs table "
                "changes thousands of times a second, 10s keeps the table several times "
                "smaller (the tuning guide). Check also autovacuum_max_workers, that no "
                f"lock keeps it out, and `VACUUM (VERBOSE) {ex.schema}.jobs`, which says "
                "how many dead rows it could not remove."
            )
    return Finding("hot_table", level, title, advice=advice, figures=figures)


def check_idle_transactions(ex: Examination) -> Finding:
    t = ex.thresholds
    rows = ex.rows("idle_job_lockers", {"query_chars": QUERY_CHARS})
    figures: dict[str, Any] = {"sessions": len(rows), "longest_idle_seconds": 0.0}
    if not rows:
        return Finding(
            "idle_transactions",
            "ok",
            "no session idle in a transaction holds job rows",
            ex.blind("states"),
            figures=figures,
        )
    level = "ok"
    lines = []
    worst = None
    for pid, application, user, client, state, idle, _xact, query, xid, waiting in rows:
        if idle >= t.idle_transaction_problem_seconds or (
            waiting and idle >= t.idle_transaction_warning_seconds
        ):
            here = "problem"
        elif idle >= t.idle_transaction_warning_seconds:
            here = "warning"
        else:
            here = "ok"
        level = _worse(level, here)
        held = ""
        if xid is not None:
            ids, count = ex.rows("jobs_locked_by", {"xid": xid, "limit": 3})[0]
            if count:
                more = f" and {count - len(ids)} more" if count > len(ids) else ""
                held = f", holding job {', '.join(ids)}{more}"
        line = (
            f"pid {pid} ({_who(application, user, client)}) {state} for {age(idle)}{held}"
            + (f"; {waiting} session(s) wait for it" if waiting else "")
            + f": {_query(query)}"
        )
        lines.append(line)
        if worst is None:
            worst = pid
        figures["longest_idle_seconds"] = max(figures["longest_idle_seconds"], round(idle, 3))
    advice = None
    if level != "ok":
        advice = (
            "Its client must COMMIT or ROLLBACK; or end it: SELECT pg_terminate_backend("
            f"{worst}). A worker's outcome for a job it locks waits for it. Set "
            "idle_in_transaction_session_timeout for the application's role."
        )
    return Finding(
        "idle_transactions",
        level,
        lines[0],
        (*lines[1:], *ex.blind("states")),
        advice,
        figures,
    )


def check_expired_leases(ex: Examination) -> Finding:
    t = ex.thresholds
    count, oldest, queues, ids = ex.conn.execute(
        statements_for(ex.schema)["leases_ran_out"],
        {
            "grace_s": t.expired_lease_grace_seconds,
            "now": None,
            "lease_ms": round(ex.lease_seconds * 1000),
        },
    ).fetchone()
    workers = ex.live_workers()
    figures = {"jobs": count, "oldest_seconds": None if oldest is None else round(oldest, 3)}
    if not count:
        return Finding(
            "expired_leases",
            "ok",
            f"no running job's lease expired more than {age(t.expired_lease_grace_seconds)} ago",
            figures=figures,
        )
    what = (
        f"{count:,} running job(s) of {', '.join(sorted(queues))} had their lease expire, the "
        f"oldest {age(oldest)} ago (e.g. {', '.join(ids)})"
    )
    if not workers:
        return Finding(
            "expired_leases",
            "problem",
            f"{what}, and no worker is alive to take them back",
            advice="Start a worker (of any queue): its reaper gives them back to their queues "
            "at once. Or requeue them now: `dramatiq-pg-broker jobs requeue --all-expired` "
            "(the reaper's own transition; an interruption counts as one, up to "
            "max_interruptions).",
            figures=figures,
        )
    return Finding(
        "expired_leases",
        "warning",
        f"{what}, and none of the {len(workers)} live worker(s) took them back",
        advice="A worker's reaper runs every reaper_interval: check the workers' logs (a "
        "schema gate waiting for a migration, a reaper failing), and that they run this "
        "release (earlier ones may not reap these). `dramatiq-pg-broker jobs requeue "
        "--all-expired` gives them back now.",
        figures=figures,
    )


def check_unattended_queues(ex: Examination) -> Finding:
    t = ex.thresholds
    # The queues as the operator's views read them (control.overview): a queue no live
    # worker consumes is ``no_worker`` (declared) or ``undeclared``; paused ones wait on
    # purpose, and their runnable jobs are counted apart (``paused``, not ``ready``).
    queues = overview(ex.conn, ex.schema, failed=False)
    waiting = {
        name: q for name, q in queues.items() if q.jobs.ready and q.state in (NO_WORKER, UNDECLARED)
    }
    late = {
        name: q
        for name, q in waiting.items()
        if (q.jobs.oldest_waiting_seconds or 0) >= t.unattended_warning_seconds
    }
    figures = {
        "queues": sorted(waiting),
        "oldest_waiting_seconds": {
            name: q.jobs.oldest_waiting_seconds for name, q in queues.items()
        },
    }
    if not waiting:
        return Finding(
            "unattended_queues",
            "ok",
            "every queue with runnable jobs has a live worker (or is paused)",
            figures=figures,
        )
    lines = [
        f"queue {name}: {q.jobs.ready:,} runnable job(s) wait, the oldest for "
        f"{age(q.jobs.oldest_waiting_seconds)}: {q.waiting_because()[0]['text']}"
        for name, q in sorted(
            waiting.items(), key=lambda kv: -(kv[1].jobs.oldest_waiting_seconds or 0)
        )
    ]
    return Finding(
        "unattended_queues",
        "warning" if late else "ok",
        lines[0],
        tuple(lines[1:]),
        "Start workers for it (`dramatiq your_app --queues NAME`), or pause it "
        "(`dramatiq-pg-broker queues pause NAME`) if nothing should run its jobs now."
        if late
        else None,
        figures,
    )


def check_partitions(ex: Examination) -> list[Finding]:
    t = ex.thresholds
    found = partition_status(ex.conn, ex.schema)
    advice = (
        "Maintenance creates and fills them: keep at least one worker running with "
        "DRAMATIQ_PG_SCHEDULER and DRAMATIQ_PG_RETENTION on, or run `dramatiq-pg-broker "
        "prune` from cron; its log says why a step was skipped (a lock not granted ...)."
    )
    ahead = {"days_ahead": found.days_ahead, "pending": list(found.pending)}
    if found.days_ahead < 0:
        future = Finding(
            "partitions",
            "problem",
            "today's partitions of history are missing: finished jobs fall into the DEFAULT "
            "partitions",
            advice=advice,
            figures=ahead,
        )
    elif found.days_ahead < t.partitions_ahead_warning:
        future = Finding(
            "partitions",
            "warning",
            f"history has partitions only {found.days_ahead} day(s) ahead (through "
            f"{found.through:%Y-%m-%d})",
            advice=advice,
            figures=ahead,
        )
    else:
        future = Finding(
            "partitions",
            "ok",
            f"history has partitions {found.days_ahead} day(s) ahead (through "
            f"{found.through:%Y-%m-%d})",
            figures=ahead,
        )
    if found.pending:
        future = dataclasses.replace(
            future, details=(f"prepared, not attached yet: {', '.join(found.pending)}",)
        )
    held = {name: rows for name, rows in found.default_rows.items() if rows}
    rows = {"default_rows": dict(found.default_rows)}
    if held:
        default = Finding(
            "default_partitions",
            "warning",
            "rows left in DEFAULT partitions: "
            + ", ".join(f"{name} {count:,}" for name, count in held.items()),
            advice="Maintenance moves them into their days' partitions (every attach scans "
            "a DEFAULT partition meanwhile): " + advice,
            figures=rows,
        )
    else:
        default = Finding(
            "default_partitions", "ok", "the DEFAULT partitions are empty", figures=rows
        )
    return [future, default]


def check_connections(ex: Examination) -> Finding:
    t = ex.thresholds
    used, ours, max_connections, superuser, reserved = ex.rows("connections")[0]
    available = max(1, max_connections - superuser - reserved)
    workers, budgets = ex.rows("worker_budgets", {"default_budget": ex.default_budget})[0]
    share = used / available
    figures = {
        "used": used,
        "ours": ours,
        "max_connections": max_connections,
        "available": available,
        "workers": workers,
        "worker_budgets": budgets,
    }
    take = f"the {workers} live worker(s) may open up to {budgets}" if workers else "no live worker"
    title = (
        f"{used} of {available} connection slots in use ({ours} by dramatiq-pg-broker "
        f"processes; max_connections {max_connections}, {superuser + reserved} reserved); "
        f"{take}"
    )
    level = "ok"
    if share >= t.connections_problem:
        level = "problem"
    elif share >= t.connections_warning or budgets > available:
        level = "warning"
    advice = None
    if level != "ok":
        advice = (
            "Each worker process opens at most pool_max_size + 2 connections: lower "
            "DRAMATIQ_PG_POOL_MAX_SIZE on the workers, put PgBouncer in front (transaction "
            "mode, with DRAMATIQ_PG_LISTEN=false and DRAMATIQ_PG_PREPARED_STATEMENTS=false), "
            "or raise max_connections (each slot costs server memory); see the tuning guide."
        )
    return Finding("connections", level, title, advice=advice, figures=figures)


def check_replication_slots(ex: Examination) -> Finding:
    t = ex.thresholds
    slots = ex.rows("replication_slots")
    figures: dict[str, Any] = {
        "slots": len(slots),
        "retained_bytes": {row[0]: row[6] for row in slots},
    }
    if not slots:
        return Finding("replication_slots", "ok", "no replication slot", figures=figures)
    level = "ok"
    lines = []
    for name, kind, active, pid, wal_status, database, retained, xmin_age, _ in slots:
        here = "ok"
        if wal_status in ("lost", "unreserved") or (retained or 0) >= t.slot_wal_problem_bytes:
            here = "problem"
        elif not active or (retained or 0) >= t.slot_wal_warning_bytes:
            here = "warning"
        level = _worse(level, here)
        state = f"active (pid {pid})" if active else "inactive"
        lines.append(
            f"slot {name!r} ({kind}{', ' + database if database else ''}, {state}) keeps "
            f"{size(retained)} of WAL"
            + (f", status {wal_status}" if wal_status else "")
            + (f"; its xmin is {xmin_age:,} transactions back" if xmin_age else "")
        )
    advice = None
    if level != "ok":
        name = slots[0][0] if len(slots) == 1 else "name"
        advice = (
            "A slot keeps WAL until its consumer reads it: drop a slot whose consumer is "
            f"gone (SELECT pg_drop_replication_slot('{name}')), and bound what any slot may "
            "keep with max_slot_wal_keep_size."
        )
    return Finding("replication_slots", level, lines[0], tuple(lines[1:]), advice, figures)


#: Every check, in the order the report lists them. A check gives one finding or several.
def check_workflows(ex: Examination) -> Finding:
    """Steps of running workflows whose job ended without moving the workflow on (a worker
    of a release before migration 0025 finished it): their workflows wait for ever."""
    steps, flows, examples = ex.rows("stalled_workflow_steps", {"limit": 3})[0]
    figures = {"stalled_steps": steps, "workflows": flows}
    if not steps:
        return Finding(
            "workflows",
            "ok",
            "no running workflow waits for a step whose job already ended",
            figures=figures,
        )
    lines = [
        f"{steps:,} step(s) of {flows:,} running workflow(s) ended without moving their "
        "workflow on: their jobs were finished by a worker of a release before migration "
        "0025, which leaves the workflow out of the job's history row"
    ]
    lines += [f"workflow {flow}: job {job} {status}" for flow, job, status in examples]
    return Finding(
        "workflows",
        "warning",
        lines[0],
        tuple(lines[1:]),
        "Upgrade every worker of these queues to this release (`dramatiq-pg-broker workers` "
        "lists the live ones by host). Then `dramatiq-pg-broker workflows abort ID` and "
        "`dramatiq-pg-broker workflows retry ID` run each such workflow on from the stalled "
        "step, which runs once more (its result was not kept).",
        figures,
    )


CHECKS: dict[str, Callable[[Examination], Finding | list[Finding]]] = {
    "schema": check_schema,
    "snapshot": check_snapshot,
    "hot_table": check_hot_table,
    "idle_transactions": check_idle_transactions,
    "expired_leases": check_expired_leases,
    "unattended_queues": check_unattended_queues,
    "partitions": check_partitions,
    "connections": check_connections,
    "replication_slots": check_replication_slots,
    "workflows": check_workflows,
}


def examine(
    conn: psycopg.Connection,
    schema: str,
    *,
    thresholds: Thresholds | None = None,
    checks: Iterable[str] | None = None,
    default_budget: int = EARLIER_RELEASE_BUDGET,
    statement_timeout_ms: int = STATEMENT_TIMEOUT_MS,
    lease_seconds: float = 30.0,
) -> Report:
    """Run the checks on ``conn``, in one transaction of their own (a savepoint of the
    caller's when one is open) that reads only.

    Parameters:
      conn(psycopg.Connection): a connection to the broker's database, not one of the
        broker's pool (whose handshake refuses a schema behind the code).
      schema(str): the broker's schema.
      thresholds(Thresholds): where findings turn into warnings and problems.
      checks(Iterable[str]): the names of the checks to run (default: all, see
        :data:`CHECKS`), in :data:`CHECKS` order.
      default_budget(int): the connection budget counted for a live worker that recorded
        none (a process of an earlier release).
      statement_timeout_ms(int): how long any of its statements may run.
      lease_seconds(float): the workers' ``lease_seconds`` (see ``expired_leases``).

    Returns:
      Report: one finding per check (two for ``partitions``). A check that cannot look (a
      table the schema lacks, a view this role may not read) gives a ``skipped`` finding
      saying why; a lost connection is raised.
    """
    wanted = set(CHECKS if checks is None else checks)
    unknown = wanted - set(CHECKS)
    if unknown:
        raise ValueError(f"no such check: {', '.join(sorted(unknown))}")
    ex = Examination(conn, schema, thresholds or Thresholds(), default_budget, lease_seconds)
    findings: list[Finding] = []
    # One transaction (its statement timeout its own, the session's left as it was), each
    # check in a savepoint of it: a check that fails leaves the others their transaction.
    with conn.transaction():
        conn.execute(
            "SELECT set_config('statement_timeout', %s, true)", (f"{statement_timeout_ms}ms",)
        )
        for name, check in CHECKS.items():
            if name not in wanted:
                continue
            try:
                with conn.transaction():
                    found = check(ex)
            except (
                psycopg.errors.UndefinedTable,
                psycopg.errors.UndefinedColumn,
                psycopg.errors.UndefinedFunction,
            ) as e:
                found = Finding(
                    name,
                    SKIPPED,
                    f"the schema lacks what this check reads ({e.diag.message_primary}): run "
                    "`dramatiq-pg-broker migrate`",
                )
            except (psycopg.errors.InsufficientPrivilege, psycopg.errors.QueryCanceled) as e:
                found = Finding(name, SKIPPED, f"could not look: {e.diag.message_primary}")
            findings.extend(found if isinstance(found, list) else [found])
        checked_at = conn.execute("SELECT now()").fetchone()[0]
    return Report(tuple(findings), checked_at)


#: Columns of the level and the check's name in :func:`render`'s lines.
LEVEL_WIDTH, CHECK_WIDTH = 9, 19


def render(report: Report, width: int | None = None) -> list[str]:
    """The report as lines: each finding's level, check and title, its details indented,
    then what to do (after ``->``); a last line with the overall level and the count of
    each. Wrapped at ``width`` columns (a terminal's); None: one line each (for ``grep``).
    """
    indent = " " * (LEVEL_WIDTH + CHECK_WIDTH)
    lines = []

    def wrapped(text: str, first: str, rest: str = indent) -> list[str]:
        if width is None:
            return [first + text]
        return textwrap.wrap(
            text,
            width=max(width, len(first) + 20),
            initial_indent=first,
            subsequent_indent=rest,
            break_on_hyphens=False,
            break_long_words=False,
        )

    for finding in report.findings:
        head = f"{finding.level.upper():<{LEVEL_WIDTH}}{finding.check:<{CHECK_WIDTH}}"
        lines.extend(wrapped(finding.title, head))
        for detail in finding.details:
            lines.extend(wrapped(detail, indent))
        if finding.advice:
            lines.extend(wrapped(finding.advice, indent + "-> ", indent + "   "))
    counts = {level: 0 for level in (*LEVELS, SKIPPED)}
    for finding in report.findings:
        counts[finding.level] += 1
    summary = ", ".join(f"{n} {level}" for level, n in counts.items() if n)
    lines.append(f"{report.level}: {summary}")
    return lines
