"""Jobs: list, create, detail, timeline, stats, retry, cancel and abort."""

from __future__ import annotations

import datetime as dt
from typing import Literal

import dramatiq
import falcon
from pydantic import Field

from dramatiq_pg_broker import queue_rules
from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.control import queues as queue_control
from dramatiq_pg_broker.control.workers import actor_declaration
from dramatiq_pg_broker.errors import InvalidMessage, JobNotFound
from dramatiq_pg_broker.jobs import JobStore, states
from dramatiq_pg_broker.sending.messages import (
    APPLICATION_SCOPE,
    MAX_DELAY_MS,
    UNLIMITED_ATTEMPTS,
    default_max_retries,
    idempotency_scope,
    job_from_message,
)

from .. import conditional, responses
from ..accounts import AccountStore, User
from ..auth import CREATORS, OBSERVERS, OPERATORS, READERS, owner_scope
from ..errors import ApiError, bad_request
from ..operations import operation
from ..pagination import decode_job_cursor, job_links, link_to
from ..queries import JOB_COLUMNS, JobFilters, JobQueries, TooManyActors
from ..validation import (
    NAME_PATTERN,
    Body,
    DateTime,
    Name,
    Params,
    QueryInt,
    QueryName,
    Text,
    given,
)

#: Page size of the job list when ``limit`` is not given, and its largest value.
DEFAULT_LIMIT = 25
MAX_LIMIT = 100
#: The deepest ``offset`` accepted: deeper, follow the ``next`` links (keyset cursors),
#: which cost the same at any depth.
MAX_OFFSET = 10_000
#: The longest ``queue`` or ``actor`` filter (Dramatiq's names are shorter).
MAX_FILTER_LENGTH = 255
#: The 404 of an operation on one job.
NO_JOB = "No such job (or, for a member, not one of theirs)."

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class JobRequest(Body):
    """The body of POST /api/jobs."""

    actor_name: Name = Field(
        max_length=255,
        pattern=NAME_PATTERN,
        description="The actor's name, as declared with @dramatiq.actor. Whitespace at "
        "either end, control characters (tabs, line breaks) and U+2028/U+2029 are refused, "
        "not stripped.",
    )
    queue_name: Name = Field(
        None,
        max_length=queue_rules.MAX_QUEUE_NAME,
        pattern=queue_rules.QUEUE_NAME_PATTERN,
        description="The actor's queue: a letter or '_', then letters, digits, '.', '_', "
        "'-'. Default: the queue the actor was declared on by the workers (a different one "
        "is a 400); with DRAMATIQ_PG_ADMIN_ADHOC_ACTORS, 'default' for an actor no worker "
        "declared.",
    )
    args: list = Field([], description="Positional arguments of the actor.")
    kwargs: dict = Field({}, description="Keyword arguments of the actor.")
    priority: int = Field(
        None,
        ge=INT32_MIN,
        le=INT32_MAX,
        description="Lower runs first (Dramatiq's meaning). Default: the priority the "
        "workers declared the actor with (0 for an actor no worker declared).",
    )
    delay: int | None = Field(
        None,
        ge=0,
        le=MAX_DELAY_MS,
        description="Milliseconds to wait before the job may run. Not with available_at.",
    )
    available_at: DateTime | None = Field(
        None,
        description="Earliest time the job may run (ISO 8601; UTC without an offset). "
        "Not with delay.",
    )
    max_retries: int | None = Field(
        None,
        ge=0,
        le=UNLIMITED_ATTEMPTS - 1,
        description="Retries after the first attempt (max_attempts = max_retries + 1). "
        "Default: the max_retries the workers declared the actor with; for an actor "
        "declared without one, the row's max_attempts is DRAMATIQ_PG_MAX_ATTEMPTS.",
    )
    idempotency_key: Text | None = Field(
        None,
        max_length=255,
        description="A second request with the same key returns the first job (200) "
        "instead of creating one. A member's keys live in that member's own namespace.",
    )


class ActionRequest(Body):
    """The body of the action endpoints (retry, cancel, abort; pause and resume of a
    queue), of logging out and of revoking a token: none, or an empty JSON object. Any
    field is refused, like every endpoint's unknown fields."""


#: The list's state filter: a state (:mod:`dramatiq_pg_broker.jobs.states`), or ``queued``,
#: the stored status (every waiting job), which it took before the states existed.
LIST_STATUSES = states.FILTERS


class JobListParams(Params):
    """The filters and the page of ``GET /api/jobs``."""

    limit: QueryInt = Field(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT, description="Page size.")
    offset: QueryInt = Field(0, ge=0, le=MAX_OFFSET, description="Jobs to skip (not with cursor).")
    cursor: str = Field(None, description="A position from a next or previous link.")
    status: Literal[LIST_STATUSES] = Field(
        None,
        description="A state: ready, delayed, paused (runnable, its queue paused), running, "
        "lease_expired (its worker stopped renewing its lease), succeeded, failed, "
        "cancelled; or queued, the stored status: every waiting job (ready, delayed and "
        "paused), as earlier releases meant it. Every job's state field is one of these.",
    )
    queue: QueryName = Field(None, max_length=MAX_FILTER_LENGTH, description="Exact queue name.")
    actor: QueryName = Field(
        None,
        max_length=MAX_FILTER_LENGTH,
        description="Case-insensitive substring of the actor's name (at most 50 actor names "
        "may match).",
    )
    created_after: DateTime = Field(None, description="Created at or after (ISO 8601).")
    created_before: DateTime = Field(None, description="Created before (ISO 8601).")


def member_scope(user: User) -> str:
    """The idempotency scope of a job created through the API. A member's keys live in
    that member's own scope (``member:<user id>``), so a member can neither take a key the
    application will use (its job would be returned for the application's later send, and
    the real job would never exist) nor learn whether a key exists. Other roles act for
    the application and share its scope."""
    if user.role != "member":
        return APPLICATION_SCOPE
    return idempotency_scope(f"member:{user.id}")


class JobList:
    """``GET /api/jobs`` (filters; keyset pages, or an offset up to :data:`MAX_OFFSET`)
    and ``POST /api/jobs``."""

    route = "/api/jobs"

    def __init__(
        self, queries: JobQueries, store: JobStore, accounts: AccountStore, settings: Settings
    ) -> None:
        self.queries = queries
        self.store = store
        self.accounts = accounts
        self.settings = settings

    @operation(
        roles=READERS,
        summary="List jobs, newest first, with filters and keyset pages.",
        description="Members see only the jobs they created. Follow next and previous (cursor "
        f"links) to page; offset serves the first {MAX_OFFSET:,} jobs only.",
        query=JobListParams,
        responses={200: (responses.JobPage, "One page of jobs.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response, query: JobListParams) -> None:
        params = query
        limit, offset = params.limit, params.offset
        cursor = decode_job_cursor(params.cursor) if params.cursor else None
        if cursor is not None and offset:
            raise bad_request("give cursor or offset, not both")
        filters = JobFilters(
            status=params.status,
            queue=params.queue,
            actor=params.actor,
            created_after=params.created_after,
            created_before=params.created_before,
        )
        try:
            page = self.queries.list_jobs(
                filters,
                limit=limit,
                offset=offset,
                cursor=cursor,
                owner_id=owner_scope(req.context.user),
            )
        except TooManyActors as e:
            raise bad_request(str(e)) from None
        following, preceding = job_links(req, page, limit=limit, offset=offset, cursor=cursor)
        resp.media = {
            "count": page.count,
            "count_exact": page.count_exact,
            "next": following,
            "previous": preceding,
            "results": page.results,
        }

    @operation(
        roles=CREATORS,
        summary="Enqueue a message for an actor by name.",
        description="The API needs no actor code: it stores the message a worker of the queue "
        "will run. The actor must be one a worker declared (GET /api/actors), and the job goes "
        "to its queue: another actor name, or another queue_name, is a 400 (unless "
        "DRAMATIQ_PG_ADMIN_ADHOC_ACTORS allows actors no worker declared).",
        body=JobRequest,
        responses={
            201: (responses.Job, "The new job."),
            200: (responses.Job, "The job that already had this idempotency key."),
            400: "Bad input, an actor no worker declared, or a queue that is not the actor's.",
            409: "A member reused a key of a job they did not create.",
        },
    )
    def on_post(self, req: falcon.Request, resp: falcon.Response, body: JobRequest) -> None:
        values = given(body)
        user = req.context.user
        queue_name, declared = self._queue_of(values["actor_name"], values.get("queue_name"))
        if "delay" in values and "available_at" in values:
            raise bad_request("give delay or available_at, not both")
        delay_ms = values.get("delay", 0)
        if "available_at" in values:
            wait = values["available_at"] - dt.datetime.now(dt.timezone.utc)
            delay_ms = max(0, int(wait.total_seconds() * 1000))
            if delay_ms > MAX_DELAY_MS:
                raise bad_request("available_at must be at most ten years from now")
        options: dict = {}
        if "idempotency_key" in values and values["idempotency_key"] is not None:
            options["idempotency_key"] = values["idempotency_key"]
        if "priority" in values:
            options["priority"] = values["priority"]
        if "max_retries" in values:
            # Only when asked: the worker reads the message's max_retries before the
            # actor's, so a default here would override the actor's own setting.
            options["max_retries"] = values["max_retries"]
        # The API holds no actor code: the message is built as actor.send_with_options()
        # would build it, and becomes a row through the broker's own function, with the
        # options the workers declared the actor with (its max_retries and priority, see
        # migration 0014). For an actor declared without a max_retries, the row's limit is
        # the default the workers' Retries middleware takes from the same setting
        # (DRAMATIQ_PG_MAX_ATTEMPTS).
        message = dramatiq.Message(
            queue_name=queue_name,
            actor_name=values["actor_name"],
            args=tuple(values.get("args", ())),
            kwargs=values.get("kwargs", {}),
            options=options,
        )
        try:
            job, _ = job_from_message(
                message,
                delay=delay_ms,
                actor_priority=_int_option(declared, "priority", 0),
                actor_options=_row_options(declared),
                default_max_retries=default_max_retries(self.settings),
                scope=member_scope(user),
            )
        except InvalidMessage as e:
            raise bad_request(str(e)) from None
        # The job and its owner are written together or not at all.
        with self.store.pool.connection() as conn, conn.transaction():
            result = self.store.enqueue(job, conn=conn)
            if result.created:
                self.accounts.record_owner(result.id, user.id, conn=conn)
        try:
            body = self.queries.get_job(result.id, owner_id=owner_scope(user))
        except JobNotFound:
            # A member reused a key of a job they cannot see: say so without showing it.
            raise ApiError(
                409, "idempotency_key is already used by a job you did not create; use another key"
            ) from None
        resp.status = falcon.HTTP_201 if result.created else falcon.HTTP_200
        resp.location = link_to(req, f"/api/jobs/{result.id}")
        resp.media = body

    def _queue_of(self, actor_name: str, requested: str | None) -> tuple[str, dict]:
        """The queue a new job of ``actor_name`` goes to (the queue its workers declared),
        and the options they declared the actor with (empty for an ad-hoc actor).

        Raises:
          ApiError: 400 when no worker declared the actor (unless ad-hoc actors are
            allowed), or when ``requested`` is not its queue.
        """
        with self.store.pool.connection() as conn:
            declaration = actor_declaration(conn, self.store.schema, actor_name)
        if declaration is None:
            if self.settings.admin_adhoc_actors:
                return requested or "default", {}
            raise bad_request(
                f"no worker has declared an actor named {_shown(actor_name)}, so its job would "
                "never run: check the name (GET /api/actors lists the declared actors); "
                "DRAMATIQ_PG_ADMIN_ADHOC_ACTORS=true lets the API create jobs for actors no "
                "worker declared"
            )
        declared, options = declaration
        if requested is not None and requested != declared:
            raise bad_request(
                f"actor {_shown(actor_name)} runs on queue {_shown(declared)}, not "
                f"{_shown(requested)}: leave queue_name out, or give {_shown(declared)}"
            )
        return declared, options


def _row_options(declared: dict) -> dict:
    """The declared options that decide a new row: ``max_retries`` (its max_attempts). The
    others are the worker's to apply, from the actor itself, when the job runs."""
    value = declared.get("max_retries")
    return {"max_retries": value} if _is_int(value) else {}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_option(options: dict, name: str, default: int) -> int:
    value = options.get(name)
    return value if _is_int(value) else default


def _shown(name: str) -> str:
    """A name quoted for an error message, its control and bidirectional characters
    escaped (Python's repr escapes every character that is not printable)."""
    return repr(name if len(name) <= 80 else name[:80] + "...")


class JobDetail:
    """``GET /api/jobs/{id}``, with an ``ETag``: 304 with no body when ``If-None-Match``
    names the job's current tag (see :mod:`admin_api.conditional`). The tag is weak and
    leaves out ``locked_until``: a running job's lease renewals alone do not change it, so
    the dashboard's poll of a running job stays a 304 between its real changes."""

    route = "/api/jobs/{job_id}"

    def __init__(self, queries: JobQueries) -> None:
        self.queries = queries

    @operation(
        roles=READERS,
        scope="members: their jobs",
        summary="One job.",
        description="Its ETag is weak and leaves out locked_until: a running job's lease "
        "renewals alone answer 304 to If-None-Match. Ask without it for the current lease.",
        etag=True,
        responses={200: (responses.Job, "The job."), 404: NO_JOB},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response, job_id: str) -> None:
        self.respond(req, resp, job_id)

    def respond(self, req: falcon.Request, resp: falcon.Response, job_id: str) -> None:
        value = self.read(job_id, owner_scope(req.context.user))
        conditional.respond(req, resp, value, tagged=self.tagged(value))

    def read(self, job_id: str, owner_id: int | None) -> dict:
        return self.queries.get_job(job_id, owner_id=owner_id)

    @staticmethod
    def tagged(job: dict) -> dict:
        """What the job's tag stands for: the job without its lease's end."""
        return {name: value for name, value in job.items() if name != "locked_until"}


class JobEvents(JobDetail):
    """``GET /api/jobs/{id}/events``: the job's timeline, oldest first, with an ``ETag``
    (304 when unchanged, as for the job)."""

    route = "/api/jobs/{job_id}/events"

    @operation(
        roles=READERS,
        scope="members: their jobs",
        summary="A job's timeline, oldest first.",
        etag=True,
        responses={200: (responses.JobTimeline, "The events."), 404: NO_JOB},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response, job_id: str) -> None:
        self.respond(req, resp, job_id)

    def read(self, job_id: str, owner_id: int | None) -> dict:
        return {"job_id": job_id, "results": self.queries.job_events(job_id, owner_id=owner_id)}

    @staticmethod
    def tagged(timeline: dict) -> None:
        """The timeline's tag is its whole body's (strong): no part of it changes without
        meaning something."""
        return None


class JobStats:
    """``GET /api/jobs/stats``; see :meth:`admin_api.queries.JobQueries.stats` for how it
    stays fast."""

    route = "/api/jobs/stats"

    def __init__(self, queries: JobQueries) -> None:
        self.queries = queries

    @operation(
        roles=OBSERVERS,
        summary="Counts by status and queue, expired leases, pending retries, the oldest "
        "queued job.",
        responses={200: (responses.Stats, "The stats.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = self.queries.stats()


def action(summary: str, answers: dict, description: str = ""):
    """The declaration of an operator's action on one job or queue: a POST for operators
    and admins whose body is optional (:class:`ActionRequest`)."""
    return operation(
        roles=OPERATORS,
        summary=summary,
        description=description,
        body=ActionRequest,
        body_required=False,
        responses=answers,
    )


class JobTransition:
    """An operator's transition of one job, through the broker's state machine (its
    :class:`JobStore` method :attr:`change`); 409 for a job in another state. Each
    subclass declares its ``on_post``: :meth:`act` with its :func:`action`."""

    #: The :class:`JobStore` method: ``retry_failed``, ``cancel`` or ``abort``.
    change: str

    def __init__(self, queries: JobQueries, store: JobStore) -> None:
        self.queries = queries
        self.store = store

    def transition(self, job_id: str, by: str, conn) -> dict:
        """Run the transition on ``conn``; the job's row as it left it."""
        return getattr(self.store, self.change)(job_id, by=by, conn=conn)

    def act(self, req: falcon.Request, resp: falcon.Response, job_id: str, body) -> None:
        # The transition and its read-back share one transaction: a worker woken by the
        # transition's NOTIFY (delivered at commit) cannot claim the job before it is
        # read, so the response shows what the operator did, not what happened next (its
        # state too: named from the row as the transition left it).
        with self.store.pool.connection() as conn, conn.transaction():
            row = self.transition(job_id, req.context.user.email, conn)
            queue = queue_control.get(conn, self.store.schema, row["queue_name"])
            now = self.store.server_now(conn=conn)
        job = self.queries.get_job(job_id)
        job.update({name: row[name] for name in JOB_COLUMNS if name != "id"})
        job["state"] = states.state_of(
            row["status"],
            available_at=row["available_at"],
            locked_until=row["locked_until"],
            paused=queue is not None and queue.paused,
            now=now,
        )
        resp.media = job


class RetryJob(JobTransition):
    """``POST /api/jobs/{id}/retry``: failed to queued, attempts from zero."""

    route = "/api/jobs/{job_id}/retry"
    change = "retry_failed"
    on_post = action(
        "Move a failed job back to the queue; attempts start from zero.",
        {
            200: (responses.Job, "The job, queued again."),
            404: NO_JOB,
            409: "The job is not failed.",
        },
    )(JobTransition.act)


class CancelJob(JobTransition):
    """``POST /api/jobs/{id}/cancel``: queued to cancelled."""

    route = "/api/jobs/{job_id}/cancel"
    change = "cancel"
    on_post = action(
        "Cancel a queued job.",
        {200: (responses.Job, "The job, cancelled."), 404: NO_JOB, 409: "The job is not queued."},
    )(JobTransition.act)


class AbortJob(JobTransition):
    """``POST /api/jobs/{id}/abort``: queued to cancelled at once; running: the abort is
    requested, its worker stops the attempt and the job ends cancelled."""

    route = "/api/jobs/{job_id}/abort"
    change = "abort"
    on_post = action(
        "Abort a job: a waiting one is cancelled at once; a running one is stopped by its "
        "worker and ends cancelled, never retried.",
        {
            200: (responses.Job, "The job, cancelled or with the abort requested."),
            404: NO_JOB,
            409: "The job has finished (succeeded, failed or cancelled), or its row was held "
            "for a second by the application's transaction of its complete_in() block (the "
            "message names it; nothing was changed).",
        },
        description="For a running job the answer comes before the worker stops it: the job "
        "is still running, with abort_requested_at and abort_requested_by set; it ends "
        "cancelled within about a second, with an aborted event naming who asked. The request "
        "waits at most a second for the job's row.",
    )(JobTransition.act)


class RequeueJob(JobTransition):
    """``POST /api/jobs/{id}/requeue``: a job whose lease expired (its worker died, hung or
    lost the database) back in its queue now, through the reaper's own transition
    (:meth:`dramatiq_pg_broker.jobs.JobStore.requeue_expired`); a job whose worker holds
    its lease is never taken (409).

    Parameters:
      settings(Settings): the interruption bound and the lease the reaper goes by.
    """

    route = "/api/jobs/{job_id}/requeue"

    def __init__(self, queries: JobQueries, store: JobStore, settings: Settings) -> None:
        super().__init__(queries, store)
        self.settings = settings

    def transition(self, job_id: str, by: str, conn) -> dict:
        # It answers what the reaper's statement did: the row is read back.
        self.store.requeue_expired(job_id, settings=self.settings, by=by, conn=conn)
        return self.store.get(job_id, conn=conn)

    on_post = action(
        "Put a job whose lease expired (its worker died, hung or lost the database) back in "
        "its queue now, as the reaper would take it back.",
        {
            200: (
                responses.Job,
                "The job, runnable again (or failed or cancelled, as the reaper ends a job "
                "whose interruptions reached their bound or whose abort was requested).",
            ),
            404: NO_JOB,
            409: "The job's lease has not expired (its worker holds it), or it is not running.",
        },
        description="Only a job whose lease has expired is taken: a worker that is alive "
        "renews its lease first, so this never races it. An unstarted claim goes back "
        "uncharged; an interrupted attempt counts as an interruption. The event "
        "(timeout_requeued or released) names the operator, and the worker in its data.",
    )(JobTransition.act)
