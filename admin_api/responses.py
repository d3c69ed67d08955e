"""What the API answers with, declared once as pydantic models: the OpenAPI document's
component schemas (:mod:`admin_api.openapi` generates them from these classes; a model's
docstring is its description there). The resources still build plain dicts, so answering
costs nothing more; a test validates real answers against the document.

Where a shape is already declared, it is derived, not written again: a job's fields from
the table's columns (:data:`admin_api.tables.jobs`), a user's, a token's and a queue's
state from the dataclasses the API serializes.

A field that an answer may leave out defaults to ``None``; every other field is required.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing
import uuid
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field, create_model
from sqlalchemy.dialects.postgresql import JSONB, UUID

from dramatiq_pg_broker.control.overview import STATES as QUEUE_STATES
from dramatiq_pg_broker.control.queues import QueueState as QueueStateRecord
from dramatiq_pg_broker.events import ALL as EVENT_TYPES
from dramatiq_pg_broker.events import STATUSES
from dramatiq_pg_broker.health.doctor import LEVELS, SKIPPED, Finding
from dramatiq_pg_broker.jobs.states import FAILED, STATES, UNFINISHED

from . import accounts
from .queries import JOB_COLUMNS, LIST_COLUMNS, PREVIEW_CHARS
from .tables import jobs

Time = dt.datetime
Link = str | None


def _link(description: str) -> Any:
    return Field(json_schema_extra={"format": "uri-reference"}, description=description)


def _column_type(column: sa.Column) -> Any:
    """The Python type of a table column's values as the API shows them."""
    kind = column.type
    if isinstance(kind, JSONB):
        return Any  # any JSON value, null included
    if isinstance(kind, UUID):
        python: Any = uuid.UUID
    elif isinstance(kind, sa.DateTime):
        python = dt.datetime
    elif isinstance(kind, sa.Integer):
        python = int
    elif isinstance(kind, sa.Boolean):
        python = bool
    else:
        python = str
    return python | None if column.nullable else python


def _from_dataclass(cls: type, name: str | None = None, **fields: Any) -> type[BaseModel]:
    """A model with the fields of the dataclass ``cls`` (``fields`` added or replaced)."""
    hints = typing.get_type_hints(cls)
    own = {f.name: (hints[f.name], ...) for f in dataclasses.fields(cls)}
    return create_model(name or cls.__name__, __doc__=cls.__doc__, **{**own, **fields})


def _list_of(model: type[BaseModel]) -> type[BaseModel]:
    """``{"count": n, "results": [...]}`` of ``model``."""
    return create_model(
        f"{model.__name__}List",
        __doc__=f"Every {model.__name__.lower()}, with their count.",
        count=(int, ...),
        results=(list[model], ...),
    )


class Error(BaseModel):
    """Every error's body."""

    error: str = Field(description="A stable code, e.g. bad_request.")
    message: str = Field(description="What was wrong, as a sentence.")


Job = create_model(
    "Job",
    __doc__="A job: its row's columns, its message, who created it and who asked to abort it.",
    **{
        # The row's columns the API shows, typed from the table's definition ...
        **{name: (_column_type(jobs.c[name]), ...) for name in JOB_COLUMNS},
        # ... and what the table does not say.
        "status": (Literal[STATUSES], ...),
        "state": (
            Literal[tuple(STATES)],
            Field(
                description="Where the job is, in the words of the CLI, the dashboard and the "
                "metrics: ready, delayed, paused (its queue is), running, lease_expired (its "
                "worker stopped renewing its lease: waiting for a worker to take it back), "
                "succeeded, failed, cancelled."
            ),
        ),
        "message": (
            dict | None,
            Field(
                description="The Dramatiq message (args, kwargs, options ...); null when it "
                "is stored in a binary encoding."
            ),
        ),
        "message_encoding": (Literal["json", "binary"], ...),
        "owner": (
            str | None,
            Field(description="Email of the user who created the job through the API."),
        ),
        "abort_requested_at": (
            Time | None,
            Field(description="When an operator asked for the job's abort (null: never)."),
        ),
        "abort_requested_by": (str | None, Field(description="Who asked for the job's abort.")),
    },
)

JobSummary = create_model(
    "JobSummary",
    __doc__="A job in a list: its fields, but bounded previews instead of its arguments, "
    "result and last error (the job's own endpoint has them whole).",
    # A list row has the job's own fields but its arguments, result and last error.
    **{
        name: (Job.model_fields[name].annotation, Job.model_fields[name])
        for name in (*LIST_COLUMNS, "state", "message_encoding", "owner")
    },
    args_preview=(
        str | None,
        Field(
            max_length=PREVIEW_CHARS,
            description=f"The arguments (args, then kwargs when there are any) as JSON, at "
            f"most {PREVIEW_CHARS} characters, ending with '…' when cut; null for a message "
            "in a binary encoding.",
        ),
    ),
    error_preview=(
        str | None,
        Field(
            max_length=PREVIEW_CHARS,
            description=f"The last error, at most {PREVIEW_CHARS} characters.",
        ),
    ),
)


class JobPage(BaseModel):
    """One page of jobs, with the links to the pages around it."""

    count: int = Field(description="Matching jobs, counted up to 10,000 (see count_exact).")
    count_exact: bool = Field(
        description="False when more than 10,000 jobs match: count is then 10,000."
    )
    next: Link = _link(
        "Older jobs (a keyset cursor link; relative unless DRAMATIQ_PG_PUBLIC_URL is set)."
    )
    previous: Link = _link("Newer jobs (a keyset cursor link).")
    results: list[JobSummary]


class Event(BaseModel):
    """One event of a job's timeline."""

    id: int
    job_id: uuid.UUID
    type: Literal[EVENT_TYPES]
    attempt: int
    actor: str | None = Field(description="Worker or operator.")
    data: Any
    created_at: Time


class JobTimeline(BaseModel):
    """A job's events, oldest first."""

    job_id: uuid.UUID
    results: list[Event]


class EventPage(BaseModel):
    """One page of every job's events, newest first."""

    next: Link = _link("Older events.")
    previous: Link = _link("Newer events.")
    results: list[Event]


class Schedule(BaseModel):
    """A periodic schedule as the workers registered it."""

    name: str
    kind: Literal["actor", "maintenance"]
    actor_name: str | None
    queue_name: str | None
    trigger: str = Field(description="'cron <expr>' or 'every <n><unit>'.")
    timezone: str
    missed: Literal["run_once", "skip"]
    last_tick: Time | None
    next_run: Time | None
    last_job_id: uuid.UUID | None
    last_job_status: str | None
    updated_at: Time


class ScheduleList(BaseModel):
    """Every schedule the workers registered."""

    schedules: list[Schedule]


StatusCounts = create_model(
    "StatusCounts", __doc__="Jobs per status.", **{status: (int, ...) for status in STATUSES}
)


StateCounts = create_model(
    "StateCounts",
    __doc__="Jobs per state (the finished ones as by_status counts them).",
    **{name: (int, Field(description=state.description)) for name, state in STATES.items()},
)


class QueueLoad(BaseModel):
    """A queue's unfinished jobs."""

    queued: int
    running: int


class OldestQueued(BaseModel):
    """The queued job that has waited longest."""

    id: uuid.UUID
    queue_name: str
    actor_name: str
    created_at: Time
    age_seconds: float


class Stats(BaseModel):
    """Counts by status and queue, expired leases, pending retries, the oldest queued job."""

    total: int
    estimated: bool = Field(
        description="total and at least one of succeeded, failed and cancelled are "
        "estimates (that status's history is big)."
    )
    by_status: StatusCounts
    by_state: StateCounts
    by_queue: dict[str, QueueLoad] = Field(description="Unfinished jobs per queue.")
    expired_leases: int = Field(
        description="Running jobs whose lease expired (the reaper will requeue them)."
    )
    retries_pending: int = Field(
        description="Queued jobs waiting for a retry after a failed attempt."
    )
    oldest_queued: OldestQueued | None


class Health(BaseModel):
    """Whether the database answers and has the schema this code needs."""

    status: Literal["ok", "unavailable"]
    database: Literal["ok", "unreachable"]
    schema_: Literal["ok", "missing", "migrations_pending", "code_too_old"] = Field(
        None, alias="schema", description="Absent when the database does not answer."
    )
    detail: str = Field(None, description="Why it is unavailable.")


class Settings(BaseModel):
    """Settings without secrets (see the settings reference)."""

    model_config = ConfigDict(extra="allow")


QueueState = _from_dataclass(QueueStateRecord)


class Worker(BaseModel):
    """A live worker process."""

    id: str = Field(description="host:pid:random, per process start.")
    host: str
    pid: int
    queues: list[str]
    actors: list[str]
    version: str | None
    schema_level: int | None = Field(
        description="The highest migration the process's code ships (null: a build before "
        "migration 0022)."
    )
    started_at: Time
    heartbeat_at: Time
    expires_at: Time = Field(description="Without a heartbeat by then, the process counts as gone.")
    in_flight: int = Field(
        description="Attempts it held at its last heartbeat (prefetched, running or waiting "
        "for their outcome to be written)."
    )
    connections: int | None = Field(
        description="The most connections it opens (its pool_max_size, plus one LISTEN "
        "connection); null for a process of a release that did not record it."
    )


class Actor(BaseModel):
    """An actor a worker declared, with its queue."""

    actor_name: str
    queue_name: str
    declared_at: Time
    seen_at: Time = Field(description="When a worker last declared it.")
    live_workers: int = Field(description="Live workers declaring it.")


User = _from_dataclass(accounts.User, role=(Literal[accounts.ROLES], ...))
Token = _from_dataclass(
    accounts.Token,
    token=(str, Field(None, description="Only when created; shown once.")),
)


class Login(BaseModel):
    """The account logged in, and how long its session lasts."""

    user: User
    expires_in: int = Field(description="Seconds until the session expires.")


class Caller(BaseModel):
    """The caller's account, and how they authenticated."""

    user: User
    via: Literal["session", "token"]


JobStateCounts = create_model(
    "JobStateCounts",
    __doc__="A queue's jobs in each state (the CLI's, the dashboard's and the metrics' words).",
    **{
        name: (int, Field(ge=0, description=f"{STATES[name].label}: {STATES[name].description}."))
        for name in (*UNFINISHED, FAILED)
    },
)


class WaitingReason(BaseModel):
    """Something that holds a queue's jobs back."""

    reason: Literal["paused", "undeclared", "no_worker", "limit", "lease_expired", "delayed"]
    text: str = Field(description="The same, as a sentence.")


class QueueOverview(BaseModel):
    """A queue: its state, its jobs in each state, its pause, its limit and who set it, its
    live workers, and why its jobs wait."""

    queue_name: str
    state: Literal[QUEUE_STATES] = Field(
        description="paused; undeclared (no worker declared it); no_worker (declared, but no "
        "live worker process consumes it now); or active."
    )
    jobs: JobStateCounts
    oldest_waiting_seconds: float | None = Field(
        description="How long the oldest runnable job (ready or paused) has waited (null: none)."
    )
    next_delayed_at: Time | None = Field(
        description="When the earliest delayed job becomes runnable (null: none is delayed)."
    )
    waiting_because: list[WaitingReason] = Field(
        description="Why its jobs wait, most blocking first (empty: nothing holds them back "
        "but the work ahead of them)."
    )
    declared: bool = Field(
        description="A worker declared the queue (false: jobs wait in a queue no worker consumes)."
    )
    live_workers: int = Field(
        ge=0,
        description="Live worker processes consuming the queue now (0: its jobs wait, "
        "whether or not a worker declared it before).",
    )
    paused: bool = Field(description="An operator paused the queue.")
    paused_at: Time | None
    paused_by: str | None
    resumed_at: Time | None
    resumed_by: str | None
    limit: int | None = Field(
        description="At most this many of its jobs run at once, across every worker "
        "(null: no limit)."
    )
    limit_source: Literal["code", "operator"] | None = Field(
        description="Who set the limit: code (a worker's queue_limits setting) or operator "
        "(the CLI, the API, the dashboard), whose limit wins over code's; null: no limit."
    )
    limit_set_by: str | None
    limit_set_at: Time | None
    queued: int = Field(
        ge=0, deprecated=True, description="Earlier releases' count: ready + paused (runnable now)."
    )
    delayed: int = Field(
        ge=0, deprecated=True, description="Earlier releases' count: jobs.delayed."
    )
    running: int = Field(
        ge=0,
        deprecated=True,
        description="Earlier releases' count: running + lease_expired (claimed).",
    )
    failed: int = Field(ge=0, deprecated=True, description="Earlier releases' count: jobs.failed.")


class QueueThroughputBucket(BaseModel):
    """One minute's finished jobs of a queue."""

    at: Time
    succeeded: int = Field(ge=0)
    failed: int = Field(ge=0)


class QueueThroughput(BaseModel):
    """A queue's finished jobs per minute, oldest first, and their totals."""

    since: Time
    until: Time
    minutes: int
    succeeded: int = Field(ge=0, description="Jobs of the queue that succeeded in the window.")
    failed: int = Field(ge=0, description="Jobs of the queue that failed for good in the window.")
    buckets: list[QueueThroughputBucket]
    truncated: bool = Field(
        description="More jobs finished in the window than one read counts: only the most "
        "recent were."
    )


class RequeuedJobs(BaseModel):
    """What an operator's requeue of a queue's expired leases did, by job id."""

    queue_name: str
    requeued: list[uuid.UUID] = Field(description="Back in the queue, runnable now.")
    failed: list[uuid.UUID] = Field(
        description="Failed: their interruptions reached max_interruptions, as the reaper does."
    )
    cancelled: list[uuid.UUID] = Field(description="Cancelled: their abort had been requested.")


class QueueDetail(QueueOverview):
    """One queue, with its last hour's throughput."""

    throughput: QueueThroughput


class QueueLimit(BaseModel):
    """A queue's limit (every field but the name null when it has none)."""

    queue_name: str
    limit: int | None = Field(
        description="At most this many of its jobs run at once (null: no limit)."
    )
    source: Literal["code", "operator"] | None = Field(
        description="Who set it: a worker's queue_limits setting, or an operator."
    )
    set_by: str | None
    set_at: Time | None


class QueueList(BaseModel):
    """The queues, by name."""

    results: list[QueueOverview]


class ThroughputBucket(BaseModel):
    """One minute's finished attempts."""

    at: Time
    succeeded: int = Field(ge=0)
    failed: int = Field(ge=0)
    retried: int = Field(ge=0)


class Throughput(BaseModel):
    """Finished attempts per minute, oldest first."""

    since: Time
    until: Time
    buckets: list[ThroughputBucket]
    truncated: bool = Field(
        description="The window held more events than one read takes; the oldest minutes "
        "are incomplete."
    )


HealthFinding = _from_dataclass(
    Finding,
    "HealthFinding",
    level=(Literal[(*LEVELS, SKIPPED)], ...),
    details=(list[str], ...),
    figures=(dict[str, Any], Field(description="The numbers behind it (the metrics' gauges).")),
)


class HealthReport(BaseModel):
    """The database's health as ``dramatiq-pg-broker doctor`` examines it."""

    level: Literal[LEVELS] = Field(description="The worst finding's level.")
    exit_code: int = Field(description="The command's exit status: 0 ok, 1 warning, 2 problem.")
    checked_at: Time
    findings: list[HealthFinding]


WorkerList = _list_of(Worker)
ActorList = _list_of(Actor)
UserList = _list_of(User)
TokenList = _list_of(Token)


WorkflowStatus = Literal["running", "succeeded", "failed", "cancelled"]
StepStatus = Literal["pending", "running", "succeeded", "failed", "cancelled"]


class WorkflowSteps(BaseModel):
    """How many of a workflow's steps (nodes: one job each) are in each status."""

    pending: int
    running: int
    succeeded: int
    failed: int
    cancelled: int


class WorkflowSummary(BaseModel):
    """A workflow as a list shows it."""

    id: uuid.UUID
    name: str | None
    status: WorkflowStatus
    created_by: str | None = Field(description="Who ran it (a user id), when it was given.")
    created_at: Time
    updated_at: Time
    finished_at: Time | None
    error: str | None = Field(description="The error of the step's job that failed it.")
    nodes: int = Field(description="Its steps' jobs, spawned children included.")
    steps: WorkflowSteps


class WorkflowPage(BaseModel):
    """Workflows, newest first."""

    results: list[WorkflowSummary]


class WorkflowNode(BaseModel):
    """One step's job: a message of the workflow, or a child a step spawned."""

    id: uuid.UUID = Field(description="The node's id (a retried node keeps it).")
    step: int = Field(description="The top-level step it belongs to, from 0.")
    position: int = Field(description="Its place in the workflow's order.")
    parent: uuid.UUID | None = Field(description="The node whose actor spawned it.")
    status: StepStatus
    waiting_for: int = Field(description="How many nodes it still waits for.")
    open: int = Field(description="Its own job and its spawned children not done yet.")
    dependents: list[uuid.UUID] = Field(description="The nodes that wait for it.")
    job_id: uuid.UUID = Field(description="Its current job (a new one after a retry).")
    queue_name: str
    actor_name: str
    job_status: Literal[STATUSES] | None = Field(description="Its job's status; null: not sent.")
    attempts: int | None
    last_error: str | None
    input: Any = Field(description="How its piped input is made: null, {one: node} or "
                       "{list: [...]}.")  # fmt: skip
    updated_at: Time


class WorkflowDetail(BaseModel):
    """A workflow and every step, in order."""

    id: uuid.UUID
    name: str | None
    status: WorkflowStatus
    created_by: str | None
    created_at: Time
    updated_at: Time
    finished_at: Time | None
    ended_by_job: uuid.UUID | None = Field(description="The job whose failure ended it.")
    error: str | None
    cancelled_by: str | None
    remaining: int = Field(description="Its last steps not done yet.")
    nodes: list[WorkflowNode]
