"""The admin API's reads, composed with SQLAlchemy Core: job lists with filters, one job,
timelines, the event feed, and the stats.

Writes never happen here: every change of a job goes through
:class:`dramatiq_pg_broker.jobs.JobStore`.

Members see only the jobs they created: every read takes ``owner_id`` and, when it is set,
joins ``job_owners`` so that other jobs do not exist for them (a 404, not a 403, so that
ids of other people's jobs leak nothing).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Engine

from dramatiq_pg_broker.backends.results import describe_stored
from dramatiq_pg_broker.db import Queries
from dramatiq_pg_broker.errors import JobNotFound
from dramatiq_pg_broker.events import STATUSES
from dramatiq_pg_broker.jobs import queue_counts_of, state_of
from dramatiq_pg_broker.jobs.states import FINISHED, UNFINISHED, filter_params

from .tables import Timestamp, job_events, job_owners, jobs_history, queues, results, users

# Every read of jobs goes through the view of unfinished and finished jobs (0012): a
# reader never needs to know where a job lives. Conditions, order and limit reach both
# tables (and, on status, the planner leaves out the table that cannot hold it).
from .tables import all_jobs as jobs
from .tables import jobs as jobs_table

#: Up to this size the ``jobs`` heap is counted exactly by the stats (a sequential scan of
#: 32 MiB takes a few tens of milliseconds); above it, succeeded jobs are estimated.
EXACT_STATS_MAX_BYTES = 32 * 1024 * 1024

#: The job list counts matching jobs up to this many; above, ``count_exact`` is false.
COUNT_CAP = 10_000
#: The event types almost every job has, left out of ``job_events_rare_type_idx``
#: (migration 0007): the event feed finds them by walking the primary key.
COMMON_EVENT_TYPES = ("created", "claimed", "succeeded")
#: The most actor names an ``actor`` filter may match.
MAX_ACTOR_MATCHES = 50
#: How many rows of the list an ``actor`` filter matching several names reads, looking for
#: its page, before walking each name's index range instead.
ACTOR_SCAN_ROWS = 1000

#: How far a job's ``created_at`` (which may come from the sender's clock) may be ahead of
#: the server's clock that stamps its finish and its events: the reads that leave out the
#: partitions of history and events before a job was created start this much earlier.
CLOCK_SLACK = dt.timedelta(hours=1)
#: Up to how many owned jobs a member's event feed may be read job by job (see
#: ``JobQueries._feed_by_job``); past it, the feed is walked newest first and filtered.
FEED_OWNED_CAP = 10_000
#: What one index probe of a job's events in one partition costs, in events read by a
#: walk of the feed (measured: about 0.1 ms a job over 15 partitions against 0.003 ms an
#: event walked).
FEED_PROBE_COST = 2

#: The job columns the API shows, in order.
JOB_COLUMNS = (
    "id",
    "queue_name",
    "actor_name",
    "status",
    "priority",
    "available_at",
    "attempts",
    "max_attempts",
    "idempotency_key",
    "locked_by",
    "locked_until",
    "last_error",
    "result",
    "created_at",
    "updated_at",
    "started_at",
    "finished_at",
    "abort_requested_at",
    "abort_requested_by",
    "workflow_node",
)

#: The columns of a job list row: the job's page has the rest. The arguments and the last
#: error are not among them: a row carries a bounded preview of each instead
#: (:data:`PREVIEW_CHARS`), so a page of jobs with megabytes of arguments stays small.
LIST_COLUMNS = tuple(name for name in JOB_COLUMNS if name not in ("last_error", "result"))

#: The longest preview of a job's arguments or last error in a list row, in characters.
PREVIEW_CHARS = 200


@dataclasses.dataclass(frozen=True)
class JobFilters:
    """Filters of the job list; None means "any". ``status`` is a state of
    :data:`dramatiq_pg_broker.jobs.states.FILTERS`: a state, or ``queued`` (every waiting
    job)."""

    status: str | None = None
    queue: str | None = None
    actor: str | None = None
    created_after: dt.datetime | None = None
    created_before: dt.datetime | None = None


@dataclasses.dataclass(frozen=True)
class JobCursor:
    """A position in the job list: jobs older (``older``) or newer than the job created at
    ``created_at`` with ``id``."""

    older: bool
    created_at: dt.datetime
    id: str


@dataclasses.dataclass(frozen=True)
class JobPage:
    """One page of the job list."""

    #: Matching jobs, counted up to COUNT_CAP.
    count: int
    #: False when more than COUNT_CAP jobs match (count is then COUNT_CAP).
    count_exact: bool
    #: The page, newest first.
    results: list[dict[str, Any]]
    #: Whether more jobs lie beyond the page in the direction of travel.
    more: bool


class TooManyActors(ValueError):
    """The actor filter matches too many actor names."""


@dataclasses.dataclass(frozen=True)
class Cursor:
    """A position in the event feed: events with ids below (``older``) or above (newer)
    ``event_id``."""

    older: bool
    event_id: int


#: What names a job's state besides its row (see :func:`with_state`): its queue's pause and
#: the server's clock, read with the row.
_STATE_FACTS = (
    sa.func.coalesce(queues.c.paused, False).label("queue_paused"),
    sa.func.now().label("server_now"),
)


def _with_owner_and_queue(source) -> Any:
    """``source`` (the jobs) joined to their owners and their queue's row."""
    return (
        source.outerjoin(job_owners, job_owners.c.job_id == jobs.c.id)
        .outerjoin(users, users.c.id == job_owners.c.user_id)
        .outerjoin(queues, queues.c.queue_name == jobs.c.queue_name)
    )


def _job_select() -> sa.Select:
    owner = users.c.email.label("owner")
    return sa.select(
        *(jobs.c[name] for name in JOB_COLUMNS),
        jobs.c.message,
        (jobs.c.message.is_(None)).label("opaque"),
        owner,
        *_STATE_FACTS,
    ).select_from(_with_owner_and_queue(jobs))


def _summary_select() -> sa.Select:
    """A job list row: :data:`LIST_COLUMNS`, and previews of the arguments and the last
    error cut by the server (one character more than a preview shows, to tell whether it
    was cut): the whole message and error never leave the database for a list."""
    owner = users.c.email.label("owner")
    kwargs = jobs.c.message["kwargs"]
    arguments = sa.func.concat_ws(
        " ",
        sa.cast(jobs.c.message["args"], Text),
        sa.case((kwargs == sa.cast(sa.literal("{}"), JSONB), None), else_=sa.cast(kwargs, Text)),
    )
    return sa.select(
        *(jobs.c[name] for name in LIST_COLUMNS),
        sa.func.left(arguments, PREVIEW_CHARS + 1).label("args_preview"),
        sa.func.left(jobs.c.last_error, PREVIEW_CHARS + 1).label("error_preview"),
        (jobs.c.message.is_(None)).label("opaque"),
        owner,
        *_STATE_FACTS,
    ).select_from(_with_owner_and_queue(jobs))


def with_state(data: dict[str, Any], row: sa.Row) -> dict[str, Any]:
    """``data`` (a job as the API shows it) with its ``state``
    (:func:`dramatiq_pg_broker.jobs.state_of`), named from the row's facts."""
    facts = row._mapping
    data["state"] = state_of(
        data["status"],
        available_at=data["available_at"],
        locked_until=data["locked_until"],
        paused=facts["queue_paused"],
        now=facts["server_now"],
    )
    return data


def preview(text: str | None) -> str | None:
    """At most :data:`PREVIEW_CHARS` characters of ``text``, ending with an ellipsis when
    cut."""
    if text is None or len(text) <= PREVIEW_CHARS:
        return text
    return text[: PREVIEW_CHARS - 1] + "…"


def summary_dict(row: sa.Row) -> dict[str, Any]:
    """A job list row as the API shows it: the job's fields but its arguments, result and
    last error, with ``args_preview`` and ``error_preview`` (bounded; None when there is
    nothing to show: no error, or a message in a binary encoding)."""
    data = {name: row._mapping[name] for name in LIST_COLUMNS}
    data["id"] = str(data["id"])
    opaque = row._mapping["opaque"]
    data["args_preview"] = None if opaque else preview(row._mapping["args_preview"] or None)
    data["error_preview"] = preview(row._mapping["error_preview"])
    data["message_encoding"] = "binary" if opaque else "json"
    data["owner"] = row._mapping["owner"]
    return with_state(data, row)


def _status_conditions(table: sa.Table, name: str) -> list[Any]:
    """The conditions of the list's state filter on ``table``: the facts
    :func:`dramatiq_pg_broker.jobs.states.filter_params` gives for the state, each compared
    when given (by the server's clock, as the counts are), so that no state is defined
    here."""
    facts = filter_params(name)
    now = sa.func.now()
    conditions: list[Any] = [table.c.status == facts["status"]]
    if facts["due"] is not None:
        due = table.c.available_at <= now
        conditions.append(due if facts["due"] else sa.not_(due))
    if facts["lease_current"] is not None:
        current = table.c.locked_until >= now
        conditions.append(current if facts["lease_current"] else sa.not_(current))
    if facts["paused"] is not None:
        paused = sa.exists().where(queues.c.queue_name == table.c.queue_name, queues.c.paused)
        conditions.append(paused if facts["paused"] else sa.not_(paused))
    return conditions


def _capped_count(conn, rows: sa.Select, cap: int | None = None) -> int:
    """How many rows ``rows`` (a select) gives, counted up to ``cap`` (by default
    :data:`COUNT_CAP`) + 1: the read stops there."""
    capped = rows.limit((COUNT_CAP if cap is None else cap) + 1).subquery()
    return conn.execute(sa.select(sa.func.count()).select_from(capped)).scalar_one()


def _newest_first(created_at, id_, newest: bool = True) -> tuple:
    """The list's order on these columns: ``(created_at, id)`` descending, or ascending
    (``newest`` false, a page walked towards newer jobs)."""
    if newest:
        return created_at.desc(), id_.desc()
    return created_at.asc(), id_.asc()


def _page_rows(conn, ids: list, created: list[dt.datetime]) -> list[sa.Row]:
    """A page's jobs (list rows, newest first) by id, read from the partitions that can
    hold them: none finished before the oldest of them was created (less
    :data:`CLOCK_SLACK`)."""
    oldest = min(created) - CLOCK_SLACK
    return conn.execute(
        _summary_select()
        .where(
            jobs.c.id.in_(ids),
            sa.or_(jobs.c.finished_at.is_(None), jobs.c.finished_at >= oldest),
        )
        .order_by(*_newest_first(jobs.c.created_at, jobs.c.id))
    ).all()


#: The partitions of a partitioned table, added up from the planner's statistics: rows
#: (a partition's reltuples is -1 until its first ANALYZE), pages, bytes, the block size,
#: whether every partition was analyzed, and how many partitions.
_PARTITIONS = sa.text(
    "SELECT coalesce(sum(c.reltuples) FILTER (WHERE c.reltuples > 0), 0), "
    "coalesce(sum(c.relpages), 0), coalesce(sum(pg_relation_size(c.oid)), 0), "
    "current_setting('block_size')::int, coalesce(bool_and(c.reltuples >= 0), true), "
    "count(*) "
    "FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
    "WHERE i.inhparent = to_regclass(:parent)"
)


def _stored_result(job_id: str) -> sa.Select:
    """The job's unexpired result from the results backend's table, newest first (an expired
    one is already gone for every reader)."""
    return (
        sa.select(results.c.value, results.c.failed, results.c.expires_at)
        .where(results.c.message_id == str(job_id), results.c.expires_at > sa.func.now())
        .order_by(results.c.stored_at.desc())
        .limit(1)
    )


def job_dict(row: sa.Row) -> dict[str, Any]:
    """A job row as the API shows it. ``message`` is the row's jsonb view of the encoded
    message (for display; workers decode the stored bytes). A message that is not JSON (a
    non-JSON encoder such as pickle) is opaque: ``message`` is null and
    ``message_encoding`` says why. A JSON message that jsonb cannot hold exactly shows a
    display-safe copy (``NaN`` as a string, NUL characters as U+FFFD)."""
    data = {name: row._mapping[name] for name in JOB_COLUMNS}
    data["id"] = str(data["id"])
    opaque = row._mapping["opaque"]
    data["message"] = None if opaque else row._mapping["message"]
    data["message_encoding"] = "binary" if opaque else "json"
    data["owner"] = row._mapping["owner"]
    return with_state(data, row)


def event_dict(row: sa.Row) -> dict[str, Any]:
    data = dict(row._mapping)
    data["job_id"] = str(data["job_id"])
    return data


class JobQueries:
    """Read queries over one schema.

    Parameters:
      engine(Engine): a SQLAlchemy engine on the database.
      schema(str): the schema of the tables (applied with ``schema_translate_map``).
    """

    def __init__(self, engine: Engine, schema: str) -> None:
        self.schema = schema
        self.engine = engine.execution_options(schema_translate_map={None: schema})
        #: The per-queue count the CLI and the metrics read too.
        self._count_by_queue = Queries(schema)["count_by_queue"]

    def ping(self) -> None:
        """Check that the database answers and the schema is migrated.

        Raises:
          sqlalchemy.exc.OperationalError: the database cannot be reached.
          LookupError: the schema has no jobs table.
        """
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.select(sa.func.to_regclass(sa.literal(f'"{self.schema}".jobs')))
            ).scalar()
        if found is None:
            raise LookupError(f"schema {self.schema!r} has no jobs table")

    # -- jobs ----------------------------------------------------------------------------

    def list_jobs(
        self,
        filters: JobFilters,
        *,
        limit: int,
        offset: int = 0,
        cursor: JobCursor | None = None,
        owner_id: int | None = None,
    ) -> JobPage:
        """One page of jobs, newest first (``created_at``, then ``id``, descending), and how
        many match, counted up to :data:`COUNT_CAP`.

        How it stays fast at millions of rows:

        - a page is a walk of an index in ``(created_at, id)`` order in each partition of
          ``jobs_history``: ``jobs_history_created_at_idx``, or, under a queue or actor
          filter, ``jobs_history_queue_created_idx`` / ``jobs_history_actor_created_idx``;
          the unfinished jobs (the ``jobs`` table, the backlog, which indexes only what the
          workers need: migration 0017) are sorted into the same order, a top-N sort of the
          rows the filters leave; the view ``all_jobs`` merges both in order, and a status
          filter leaves out the table that cannot hold it;
        - deep pages are keyset (``cursor``): a position, not a number of rows to skip;
        - the count stops at :data:`COUNT_CAP` rows (``count_exact`` is then false);
        - the actor filter (a case-insensitive substring) is first resolved to the actor
          names that match, read one distinct name at a time (a few index probes per actor
          in history, a pass over the backlog); each name then walks its own index range and
          the pages are merged.

        Raises:
          TooManyActors: the actor filter matches more than :data:`MAX_ACTOR_MATCHES` names.
        """
        if owner_id is not None:
            return self._list_owned_jobs(
                filters, limit=limit, offset=offset, cursor=cursor, owner_id=owner_id
            )
        conditions = self._conditions(filters)
        with self.engine.connect() as conn:
            branches: list[list[Any]] = [[]]
            names_condition: list[Any] = []
            if filters.actor is not None:
                names, every_actor = self._matching_actors(conn, filters.actor)
                if not names:
                    return JobPage(0, True, [], False)
                if not every_actor:  # a filter every job passes is left out
                    branches = [[jobs.c.actor_name == name] for name in names]
                    names_condition = [jobs.c.actor_name.in_(names)]
            older = cursor is None or cursor.older
            order = _newest_first(jobs.c.created_at, jobs.c.id, older)
            position: list[Any] = []
            if cursor is not None:
                key = sa.tuple_(jobs.c.created_at, jobs.c.id)
                mark = sa.tuple_(
                    sa.literal(cursor.created_at, Timestamp), sa.literal(cursor.id, jobs.c.id.type)
                )
                position.append(key < mark if cursor.older else key > mark)
            # The page: one walk of the list's order kept by actor when several names match
            # (as long as the page is near the start); else one index walk per branch.
            wanted = offset + limit + 1
            found, count = None, None
            if len(branches) > 1 and wanted * 4 <= ACTOR_SCAN_ROWS:
                found = self._scan_for_actors(conn, [*conditions, *position], order, names, wanted)
            if found is None and len(branches) > 1:
                # The names are rare here: when none of them matches at all (the count
                # probes each partition's actor index once), no name needs its walk.
                count = _capped_count(conn, self._counted(conditions, names_condition))
                if count == 0:
                    return JobPage(0, True, [], False)
            if found is None:
                found = self._walk_branches(
                    conn, [*conditions, *position], branches, older, limit, offset
                )
            else:
                found = found[offset:]
            more = len(found) > limit
            page = found[:limit]
            rows = []
            if page:
                rows = _page_rows(conn, [r.id for r in page], [r.created_at for r in page])
            if count is None:
                count = _capped_count(conn, self._counted(conditions, names_condition))
        exact = count <= COUNT_CAP
        return JobPage(min(count, COUNT_CAP), exact, [summary_dict(row) for row in rows], more)

    @staticmethod
    def _counted(conditions, names_condition) -> sa.Select:
        """The jobs of the list that its count counts."""
        return sa.select(sa.literal(1)).select_from(jobs).where(*conditions, *names_condition)

    @staticmethod
    def _scan_for_actors(conn, conditions, order, names, wanted: int):
        """The first ``wanted`` jobs of a filter matching several actor names, read from
        one walk of the list's order (``jobs_history_created_at_idx`` in each partition) and
        kept when their actor is one of ``names``; None when :data:`ACTOR_SCAN_ROWS` rows
        were read without finding as many (the names are rare: each then walks its own
        index range, see :meth:`_walk_branches`).

        A walk per name merges that name's range of every partition of history; with many
        names, planning those walks alone costs more than reading the rows that a filter
        matching many actors finds among the first of the list.
        """
        rows = conn.execute(
            sa.select(jobs.c.id, jobs.c.created_at, jobs.c.actor_name)
            .where(*conditions)
            .order_by(*order)
            .limit(ACTOR_SCAN_ROWS)
        ).all()
        kept = set(names)
        found = [row for row in rows if row.actor_name in kept][:wanted]
        if len(found) < wanted and len(rows) == ACTOR_SCAN_ROWS:
            return None
        return found

    @staticmethod
    def _walk_branches(conn, conditions, branches, older: bool, limit: int, offset: int):
        """The page after ``offset`` jobs (and one more, to tell whether more follow): one
        index walk per branch (an actor name each, or one branch without a name), each
        fetching what the page could need, merged."""
        wanted = offset + limit + 1
        order = _newest_first(jobs.c.created_at, jobs.c.id, older)
        selects = [
            sa.select(jobs.c.id, jobs.c.created_at)
            .where(*conditions, *branch)
            .order_by(*order)
            .limit(wanted)
            for branch in branches
        ]
        if len(selects) == 1:
            merged = selects[0].limit(limit + 1).offset(offset).subquery("page")
        else:
            merged_all = sa.union_all(*(q.subquery().select() for q in selects)).subquery("b")
            merged = (
                sa.select(merged_all.c.id, merged_all.c.created_at)
                .order_by(*_newest_first(merged_all.c.created_at, merged_all.c.id, older))
                .limit(limit + 1)
                .offset(offset)
                .subquery("page")
            )
        return conn.execute(
            sa.select(merged.c.id, merged.c.created_at).order_by(
                *_newest_first(merged.c.created_at, merged.c.id, older)
            )
        ).all()

    def _list_owned_jobs(
        self,
        filters: JobFilters,
        *,
        limit: int,
        offset: int,
        cursor: JobCursor | None,
        owner_id: int,
    ) -> JobPage:
        """:meth:`list_jobs` for a member: the same page, order, cursor and count as the
        full list restricted to the jobs they created.

        A member's jobs are few, but scattered through history: a probe of ``all_jobs`` by
        id reads the id index of every partition of history (they are by day of finish).
        So the walk goes the other way: ``job_owners_user_created_idx`` gives the member's
        jobs in the list's order, ``(created_at, id)`` (an owner row holds its job's
        ``created_at``, so the cursor and the created filters apply to it), and each job is
        fetched by id from ``jobs`` and from the partitions of ``jobs_history`` that
        finished at or after it was created: PostgreSQL prunes, per owner row, every day
        before (in ``EXPLAIN ANALYZE``, those partitions are never executed). A page of
        recent jobs reads the last days only. The status, queue and actor filters apply to
        the fetched job, and their count reads, for each of up to :data:`COUNT_CAP` owned
        jobs, the days from its creation on until the job is found; without them the
        count is of the member's owner rows alone (an owner row goes with its job:
        retention and a queue's flush delete both). An owner row whose job is gone anyway
        is skipped by the page.
        """
        owners = job_owners
        live = sa.select(
            jobs_table.c.id, jobs_table.c.status, jobs_table.c.queue_name, jobs_table.c.actor_name
        ).where(jobs_table.c.id == owners.c.job_id)
        finished = sa.select(
            jobs_history.c.id,
            jobs_history.c.status,
            jobs_history.c.queue_name,
            jobs_history.c.actor_name,
        ).where(
            jobs_history.c.id == owners.c.job_id,
            jobs_history.c.finished_at >= owners.c.created_at,
        )
        if filters.status is not None:
            # Said on each side, so that the planner leaves out the table (or the status
            # partitions) that cannot hold it.
            live = live.where(*_status_conditions(jobs_table, filters.status))
            finished = finished.where(*_status_conditions(jobs_history, filters.status))
        # A job is in one place (ids are unique across the hot table and history): the
        # lateral stops at the first row found, so the job's later partitions are never
        # read (the hot table first, then history's days from its creation on).
        job = sa.union_all(live, finished).limit(1).lateral("job")
        conditions: list[Any] = [owners.c.user_id == owner_id]
        if filters.queue is not None:
            conditions.append(job.c.queue_name == filters.queue)
        if filters.created_after is not None:
            conditions.append(owners.c.created_at >= filters.created_after)
        if filters.created_before is not None:
            conditions.append(owners.c.created_at < filters.created_before)
        older = cursor is None or cursor.older
        position: list[Any] = []
        if cursor is not None:
            key = sa.tuple_(owners.c.created_at, owners.c.job_id)
            mark = sa.tuple_(
                sa.literal(cursor.created_at, Timestamp),
                sa.literal(cursor.id, owners.c.job_id.type),
            )
            position.append(key < mark if cursor.older else key > mark)
        order = _newest_first(owners.c.created_at, owners.c.job_id, older)
        source = owners.join(job, sa.true())
        job_filtered = filters.status is not None or filters.queue is not None
        with self.engine.connect() as conn:
            if filters.actor is not None:
                names, every_actor = self._matching_actors(conn, filters.actor)
                if not names:
                    return JobPage(0, True, [], False)
                if not every_actor:  # a filter every job passes is left out
                    conditions.append(job.c.actor_name.in_(names))
                    job_filtered = True
            page = (
                sa.select(owners.c.job_id, owners.c.created_at)
                .select_from(source)
                .where(*conditions, *position)
                .order_by(*order)
                .limit(limit + 1)
                .offset(offset)
            )
            found = conn.execute(page).all()
            more = len(found) > limit
            found = found[:limit]
            rows = []
            if found:
                rows = _page_rows(conn, [r.job_id for r in found], [r.created_at for r in found])
            counted = sa.select(sa.literal(1)).where(*conditions)
            if job_filtered:
                counted = counted.select_from(source)
            else:
                # Nothing asked of the job itself: each owner row stands for its job (every
                # path that deletes jobs deletes their owner rows: retention, a queue's
                # flush), and the count reads the member's index entries alone.
                counted = counted.select_from(owners)
            count = _capped_count(conn, counted)
        exact = count <= COUNT_CAP
        return JobPage(min(count, COUNT_CAP), exact, [summary_dict(row) for row in rows], more)

    def _matching_actors(self, conn, fragment: str) -> tuple[list[str], bool]:
        """The distinct actor names containing ``fragment`` (case-insensitive), and whether
        they are every actor name of the table.

        A loose index scan of ``jobs_history_actor_created_idx`` in each partition of
        history: each step of the recursive query jumps to the next distinct name, so it
        costs one index probe per actor, not one row per job; and the distinct names of the
        unfinished jobs (the backlog, which has no index by actor since migration 0017), in
        one pass over them.

        Raises:
          TooManyActors: more than :data:`MAX_ACTOR_MATCHES` names match.
        """
        first = (
            sa.select(jobs_history.c.actor_name.label("name"))
            .order_by(jobs_history.c.actor_name)
            .limit(1)
        )
        actors = first.cte("actors", recursive=True)
        later = jobs_history.alias("later")
        following = (
            sa.select(later.c.actor_name)
            .where(later.c.actor_name > actors.c.name)
            .order_by(later.c.actor_name)
            .limit(1)
            .scalar_subquery()
        )
        actors = actors.union_all(sa.select(following).where(actors.c.name.is_not(None)))
        finished = sa.select(actors.c.name).where(actors.c.name.is_not(None))
        # The unfinished jobs have no index by actor (migration 0017): one pass over them.
        # Both halves in one statement: one round trip.
        unfinished = sa.select(jobs_table.c.actor_name).distinct()
        names = sorted(set(conn.execute(sa.union_all(finished, unfinished)).scalars()))
        needle = fragment.casefold()
        matching = [name for name in names if needle in name.casefold()]
        if len(matching) == len(names):
            return matching, True
        if len(matching) > MAX_ACTOR_MATCHES:
            raise TooManyActors(
                f"actor {fragment!r} matches {len(matching)} actor names; give more of the name "
                f"(at most {MAX_ACTOR_MATCHES} may match)"
            )
        return matching, False

    @staticmethod
    def _conditions(filters: JobFilters) -> list[Any]:
        conditions: list[Any] = []
        if filters.status is not None:
            conditions.extend(_status_conditions(jobs, filters.status))
        if filters.queue is not None:
            conditions.append(jobs.c.queue_name == filters.queue)
        if filters.created_after is not None:
            conditions.append(jobs.c.created_at >= filters.created_after)
        if filters.created_before is not None:
            conditions.append(jobs.c.created_at < filters.created_before)
        return conditions

    def get_job(self, job_id: str, *, owner_id: int | None = None) -> dict[str, Any]:
        """One job.

        Raises:
          JobNotFound: no job has this id (or, for a member, they did not create it).
        """
        query = _job_select().where(jobs.c.id == job_id)
        if owner_id is not None:
            query = query.where(job_owners.c.user_id == owner_id)
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
            if row is None:
                raise JobNotFound(f"No job has the id {job_id}")
            stored = conn.execute(_stored_result(job_id)).first()
        data = job_dict(row)
        if stored is not None:
            data["result"] = describe_stored(stored.value, stored.failed)
            data["result"]["expires_at"] = stored.expires_at
        return data

    def job_events(self, job_id: str, *, owner_id: int | None = None) -> list[dict[str, Any]]:
        """A job's timeline, oldest first.

        Raises:
          JobNotFound: no job has this id (or, for a member, they did not create it).
        """
        visible = sa.select(jobs.c.id).where(jobs.c.id == job_id)
        if owner_id is not None:
            visible = visible.join(job_owners, job_owners.c.job_id == jobs.c.id).where(
                job_owners.c.user_id == owner_id
            )
        query = sa.select(job_events).where(job_events.c.job_id == job_id).order_by(job_events.c.id)
        with self.engine.connect() as conn:
            if conn.execute(visible).first() is None:
                raise JobNotFound(f"No job has the id {job_id}")
            rows = conn.execute(query).all()
        return [event_dict(row) for row in rows]

    # -- the event feed ------------------------------------------------------------------

    def event_feed(
        self,
        *,
        limit: int,
        cursor: Cursor | None = None,
        event_type: str | None = None,
        job_id: str | None = None,
        owner_id: int | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:
        """One page of events, newest first, from a cursor position.

        Keyset pagination on the event id (the primary key): a page costs the same however
        deep the reader goes, and events appended meanwhile never shift a page.

        Returns:
          tuple: the page (newest first) and whether more events lie beyond it in the
          direction of travel.
        """
        query = sa.select(job_events)
        if event_type is not None:
            query = query.where(job_events.c.type == event_type)
            if event_type not in COMMON_EVENT_TYPES:
                # The predicate of the partial index job_events_rare_type_idx, written out
                # as constants so that the planner sees the index serves this query.
                common = [sa.literal_column(f"'{name}'") for name in COMMON_EVENT_TYPES]
                query = query.where(job_events.c.type.not_in(common))
        if job_id is not None:
            query = query.where(job_events.c.job_id == job_id)
        newer = cursor is not None and not cursor.older
        if cursor is not None:
            query = query.where(
                job_events.c.id > cursor.event_id if newer else job_events.c.id < cursor.event_id
            )
        order = job_events.c.id.asc() if newer else job_events.c.id.desc()
        with self.engine.connect() as conn:
            if owner_id is not None and job_id is None and self._feed_by_job(conn, owner_id, limit):
                rows = conn.execute(self._owned_feed(query, newer, limit, owner_id)).all()
            else:
                if owner_id is not None:
                    query = query.join(
                        job_owners, job_owners.c.job_id == job_events.c.job_id
                    ).where(job_owners.c.user_id == owner_id)
                rows = conn.execute(query.order_by(order).limit(limit + 1)).all()
        more = len(rows) > limit
        rows = rows[:limit]
        if newer:
            rows.reverse()
        return [event_dict(row) for row in rows], more

    def _feed_by_job(self, conn, owner_id: int, limit: int) -> bool:
        """Whether a member's page of the feed is cheaper read job by job
        (:meth:`_owned_feed`) than by walking the feed newest first and keeping their
        events: by the member's share of the events. A walk reads about ``limit`` events
        for each of the member's among all (everyone's events per the planner's
        statistics, three per owned job); asking each owned job costs an index probe per
        partition of events, about :data:`FEED_PROBE_COST` rows of a walk each. Up to
        :data:`FEED_OWNED_CAP` owned jobs (counted from ``job_owners_user_created_idx``).
        """
        owned_rows = sa.select(sa.literal(1)).where(job_owners.c.user_id == owner_id)
        owned = _capped_count(conn, owned_rows, FEED_OWNED_CAP)
        if owned == 0 or owned > FEED_OWNED_CAP:
            return False
        events, *_, partitions = conn.execute(
            _PARTITIONS, {"parent": f'"{self.schema}".job_events'}
        ).one()
        walked = (limit + 1) * float(events) / (3 * owned)
        return owned * int(partitions) * FEED_PROBE_COST < walked

    @staticmethod
    def _owned_feed(query, newer: bool, limit: int, owner_id: int):
        """A member's page of the feed, driven by their jobs: for each job they own, its
        own page of events (``job_events_job_id_idx``, in the partitions from the day the
        job was created on), merged by event id.

        Walking the feed newest first and keeping the member's events reads, for a member
        whose jobs are old or rare, nearly every event of the retention period. Asking each
        of their jobs instead costs an index probe per partition and job, however long
        the feed is (:meth:`_feed_by_job` chooses). An event is never older than
        its job; :data:`CLOCK_SLACK` covers a client clock ahead of the server's (the
        job's ``created_at`` may be the sender's). ``newer``: the page after a cursor, oldest
        first; else newest first.
        """
        owners = job_owners.alias("owners")
        per_job = (
            query.where(
                job_events.c.job_id == owners.c.job_id,
                job_events.c.created_at >= owners.c.created_at - CLOCK_SLACK,
            )
            .order_by(job_events.c.id.asc() if newer else job_events.c.id.desc())
            .limit(limit + 1)
            .lateral("event")
        )
        by_id = per_job.c.id.asc() if newer else per_job.c.id.desc()
        return (
            sa.select(*[per_job.c[column.name] for column in job_events.c])
            .select_from(owners.join(per_job, sa.true()))
            .where(owners.c.user_id == owner_id)
            .order_by(by_id)
            .limit(limit + 1)
        )

    # -- stats ---------------------------------------------------------------------------

    def stats(self, *, now: dt.datetime | None = None) -> dict[str, Any]:
        """Counts for a dashboard, cheap on a table with millions of finished rows.

        How it stays fast: every number comes from a partial index, or from the planner's
        statistics, never from a scan of the finished rows of a big table.

        - ``queued`` and ``running`` (and ``by_queue``, ``expired_leases``,
          ``retries_pending``, ``oldest_queued``) are exact, read from the partial indexes
          on queued rows (``jobs_claim_order_idx``) and on running rows
          (``jobs_lease_expiry_idx``); they hold only unfinished jobs. The counts per
          queue are the job store's (``count_by_queue``), which the CLI and the metrics
          show too.
        - ``succeeded``, ``failed`` and ``cancelled`` (history only: the hot table holds
          no finished job) are each exact while that status's partitions of history are
          small (under :data:`EXACT_STATS_MAX_BYTES` together). Above that the count is
          PostgreSQL's own row estimate (``pg_class.reltuples`` per page, times the
          partitions' current pages: what the planner uses), and ``estimated`` is then
          true. Partitions are only ever inserted into, and autovacuum analyzes them as
          they fill.

        ``by_queue`` counts unfinished jobs only (queued and running per queue): counting
        the history per queue would mean reading every finished row.
        """
        now_value = sa.literal(now, Timestamp) if now is not None else sa.func.now()
        queued = jobs.c.status == "queued"
        running = jobs.c.status == "running"
        expired = (
            sa.select(sa.func.count())
            .select_from(jobs)
            .where(running, jobs.c.locked_until < now_value)
        )
        retries = sa.select(sa.func.count()).select_from(jobs).where(queued, jobs.c.attempts > 0)
        # MATERIALIZED keeps the planner on the queued-rows index: left alone, it may walk
        # an index in created_at order from the oldest row hoping to meet a queued one soon
        # (before migration 0017 the jobs table had one, jobs_created_at_idx).
        waiting = (
            sa.select(jobs.c.id, jobs.c.queue_name, jobs.c.actor_name, jobs.c.created_at)
            .where(queued)
            .cte("waiting")
            .prefix_with("MATERIALIZED")
        )
        oldest = (
            sa.select(
                waiting,
                sa.func.extract("epoch", now_value - waiting.c.created_at).label("age"),
            )
            .order_by(waiting.c.created_at, waiting.c.id)
            .limit(1)
        )
        with self.engine.connect() as conn:
            by_status = dict.fromkeys(STATUSES, 0)
            by_queue: dict[str, dict[str, int]] = {}
            # by_queue holds no failed count: the statement leaves out its failed part.
            per_queue = conn.exec_driver_sql(self._count_by_queue, {"now": now, "failed": False})
            by_state = dict.fromkeys(UNFINISHED, 0)
            for queue_name, counts in queue_counts_of(per_queue).items():
                for state in UNFINISHED:
                    by_state[state] += getattr(counts, state)
                waiting, running = counts.waiting, counts.running + counts.lease_expired
                by_status["queued"] += waiting
                by_status["running"] += running
                if waiting or running:
                    by_queue[queue_name] = {"queued": waiting, "running": running}
            estimated = False
            for status in ("succeeded", "failed", "cancelled"):
                parent = f'"{self.schema}".jobs_history_{status}'
                reltuples, relpages, size_bytes, block, analyzed, _ = conn.execute(
                    _PARTITIONS, {"parent": parent}
                ).one()
                reltuples, relpages, size_bytes = float(reltuples), int(relpages), int(size_bytes)
                # reltuples is -1 until the first ANALYZE: count exactly until then.
                if size_bytes > EXACT_STATS_MAX_BYTES and relpages > 0 and analyzed:
                    by_status[status] = round(reltuples / relpages * (size_bytes / block))
                    estimated = True
                else:
                    by_status[status] = conn.execute(
                        sa.select(sa.func.count()).select_from(jobs).where(jobs.c.status == status)
                    ).scalar_one()
            total = sum(by_status.values())
            expired_count = conn.execute(expired).scalar_one()
            retries_count = conn.execute(retries).scalar_one()
            oldest_row = conn.execute(oldest).first()
        oldest_queued = None
        if oldest_row is not None:
            oldest_queued = {
                "id": str(oldest_row.id),
                "queue_name": oldest_row.queue_name,
                "actor_name": oldest_row.actor_name,
                "created_at": oldest_row.created_at,
                "age_seconds": round(max(0.0, float(oldest_row.age)), 3),
            }
        return {
            "total": total,
            "estimated": bool(estimated),
            "by_status": by_status,
            "by_state": {**by_state, **{status: by_status[status] for status in FINISHED}},
            "by_queue": dict(sorted(by_queue.items())),
            "expired_leases": expired_count,
            "retries_pending": retries_count,
            "oldest_queued": oldest_queued,
        }
