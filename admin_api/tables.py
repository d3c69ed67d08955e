"""SQLAlchemy Core definitions of the tables, mirroring ``migrations/`` exactly.

The migrations are the source of truth; these definitions only let the admin API compose
its read queries (lists, filters, stats) with SQLAlchemy. A test compares them with a
freshly migrated schema, column by column. They carry no schema name: the engine's
``schema_translate_map`` points them at the configured schema.

No table is ever created from here.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    Table,
    Text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TIMESTAMP, UUID

metadata = MetaData()

#: A timestamp with time zone, as every timestamp of the schema is.
Timestamp = TIMESTAMP(timezone=True)


def _job_columns(*, primary_key: bool) -> list[Column]:
    """The columns of a job row, in the order of the migrations' tables."""
    return [
        Column("id", UUID(as_uuid=False), primary_key=primary_key, nullable=False),
        Column("queue_name", Text, nullable=False),
        Column("actor_name", Text, nullable=False),
        Column("message", JSONB),
        Column("message_bytes", LargeBinary),
        Column("status", Text, nullable=False),
        Column("priority", Integer, nullable=False),
        Column("available_at", Timestamp, nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("max_attempts", Integer, nullable=False),
        Column("idempotency_key", Text),
        Column("locked_by", Text),
        Column("locked_until", Timestamp),
        Column("last_error", Text),
        Column("result", JSONB),
        Column("created_at", Timestamp, nullable=False),
        Column("updated_at", Timestamp, nullable=False),
        Column("started_at", Timestamp),
        Column("finished_at", Timestamp),
        # Whether the current claim's actor started; failed attempts; interrupted attempts;
        # claims whose lease expired before a start was recorded.
        Column("started", Boolean, nullable=False),
        Column("failures", Integer, nullable=False),
        Column("interruptions", Integer, nullable=False),
        Column("idempotency_scope", Text, nullable=False),
        Column("abandoned_claims", Integer, nullable=False),
        # Who asked for the job's abort, and when (0011).
        Column("abort_requested_at", Timestamp),
        Column("abort_requested_by", Text),
        # The workflow step the job runs (0025; null for a job outside a workflow).
        Column("workflow_node", UUID(as_uuid=False)),
    ]


#: Unfinished jobs, partitioned into lanes (0028): the primary key is (id, lane), an id
#: is stored once (the sends look it up), ``lane`` says which lane holds the row.
jobs = Table(
    "jobs",
    metadata,
    *_job_columns(primary_key=True),
    Column("lane", SmallInteger, primary_key=True, nullable=False),
)

#: Finished jobs (migration 0012): the same columns, partitioned by status and day; no
#: primary key (a partitioned table's keys must hold the partition key), ids are indexed.
jobs_history = Table("jobs_history", metadata, *_job_columns(primary_key=False))
jobs_history.c.finished_at.nullable = False

#: The views of the schema, apart from the tables (the schema test compares both).
views = MetaData()

#: Every job, unfinished (jobs) or finished (jobs_history): what the admin API reads.
all_jobs = Table("all_jobs", views, *_job_columns(primary_key=False))

job_events = Table(
    "job_events",
    metadata,
    Column("id", BigInteger, primary_key=True),
    # No foreign key: events live in daily partitions of their own (0012) and go when
    # retention drops their day.
    Column("job_id", UUID(as_uuid=False), nullable=False),
    Column("type", Text, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("actor", Text),
    Column("data", JSONB),
    # Part of the primary key: the table is partitioned by it (0012).
    Column("created_at", Timestamp, nullable=False, primary_key=True),
)

users = Table(
    "users",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("email", Text, nullable=False),
    Column("password_hash", Text, nullable=False),
    Column("role", Text, nullable=False),
    Column("active", Boolean, nullable=False),
    Column("created_at", Timestamp, nullable=False),
)

sessions = Table(
    "sessions",
    metadata,
    Column("id_hash", Text, primary_key=True),
    Column("user_id", BigInteger, ForeignKey("users.id"), nullable=False),
    Column("expires_at", Timestamp, nullable=False),
    Column("created_at", Timestamp, nullable=False),
)

api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("token_hash", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("user_id", BigInteger, ForeignKey("users.id"), nullable=False),
    Column("created_at", Timestamp, nullable=False),
    Column("last_used_at", Timestamp),
    Column("revoked", Boolean, nullable=False),
)

job_owners = Table(
    "job_owners",
    metadata,
    # No foreign key since 0012: a job's row moves between jobs and jobs_history.
    Column("job_id", UUID(as_uuid=False), primary_key=True),
    Column("user_id", BigInteger, ForeignKey("users.id"), nullable=False),
    # The job's created_at (0012): a member's job list walks the owner rows in its order.
    Column("created_at", Timestamp, nullable=False),
)

results = Table(
    "results",
    metadata,
    Column("key", Text, primary_key=True),
    Column("message_id", Text, nullable=False),
    Column("value", LargeBinary, nullable=False),
    Column("failed", Boolean, nullable=False),
    Column("expires_at", Timestamp, nullable=False),
    Column("stored_at", Timestamp, nullable=False),
)

# Operator control (0011): declared queues and their pause, declared actors, live workers.
queues = Table(
    "queues",
    metadata,
    Column("queue_name", Text, primary_key=True),
    Column("paused", Boolean, nullable=False),
    Column("paused_at", Timestamp),
    Column("paused_by", Text),
    Column("resumed_at", Timestamp),
    Column("resumed_by", Text),
    Column("declared_at", Timestamp, nullable=False),
)

# Queue limits (0015): at most max_running jobs of a queue run at once.
queue_limits = Table(
    "queue_limits",
    metadata,
    Column("queue_name", Text, primary_key=True),
    Column("max_running", Integer, nullable=False),
    Column("source", Text, nullable=False),
    Column("set_by", Text, nullable=False),
    Column("set_at", Timestamp, nullable=False),
)

actors = Table(
    "actors",
    metadata,
    Column("actor_name", Text, primary_key=True),
    Column("queue_name", Text, nullable=False),
    Column("declared_at", Timestamp, nullable=False),
    Column("seen_at", Timestamp, nullable=False),
    # The options the actor was declared with (0014).
    Column("options", JSONB, nullable=False),
)

workers = Table(
    "workers",
    metadata,
    Column("id", Text, primary_key=True),
    Column("host", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("queues", ARRAY(Text), nullable=False),
    Column("actors", ARRAY(Text), nullable=False),
    Column("version", Text),
    Column("started_at", Timestamp, nullable=False),
    Column("heartbeat_at", Timestamp, nullable=False),
    Column("expires_at", Timestamp, nullable=False),
    Column("in_flight", Integer, nullable=False),
    # The highest migration the worker's code ships (migration 0022).
    Column("schema_level", Integer),
    # The worker's connection budget (migration 0023).
    Column("connections", Integer),
)
