"""dramatiq-pg-broker: a PostgreSQL broker for Dramatiq."""

from .attempt.current import CurrentJob, current_job
from .attempt.retries import Retries
from .broker import JobFailed, PostgresBroker
from .config import Settings
from .errors import (
    AmbiguousJobId,
    CodeTooOld,
    ConfigurationError,
    DuplicateJobId,
    InvalidDatabaseURL,
    InvalidJobId,
    InvalidMessage,
    InvalidTransition,
    JobAborted,
    JobAlreadyFinished,
    JobBusy,
    JobNotFound,
    LiveWorkFound,
    LostOwnership,
    MigrationChecksumError,
    MigrationError,
    MigrationsPending,
    NotAWorkflowStep,
    PgBrokerError,
    SchemaMissing,
    SchemaVersionError,
    TransactionError,
    WorkflowInvalidTransition,
    WorkflowNotFound,
    WorkflowResultNotEncodable,
    WorkflowTimeout,
)
from .history.retention import RetentionPolicy
from .jobs.rows import Attempt
from .jobs.store import JobStore

# Through the old module path, on purpose: the decorator has the module's name, and the
# first import of the module dramatiq_pg_broker.periodic would set this package's
# attribute periodic to that module; loaded here first, the decorator below replaces it.
from .periodic import Schedule, periodic
from .sending.async_sending import send_async, send_with_options_async
from .version import __version__  # noqa: F401
from .workflows import Workflow, WorkflowRun, workflow

__all__ = [
    "AmbiguousJobId",
    "Attempt",
    "CodeTooOld",
    "ConfigurationError",
    "CurrentJob",
    "DuplicateJobId",
    "InvalidDatabaseURL",
    "InvalidJobId",
    "InvalidMessage",
    "InvalidTransition",
    "JobAborted",
    "JobAlreadyFinished",
    "JobBusy",
    "JobFailed",
    "JobNotFound",
    "JobStore",
    "LiveWorkFound",
    "LostOwnership",
    "MigrationChecksumError",
    "MigrationError",
    "MigrationsPending",
    "PgBrokerError",
    "PostgresBroker",
    "Retries",
    "RetentionPolicy",
    "Schedule",
    "SchemaMissing",
    "SchemaVersionError",
    "TransactionError",
    "NotAWorkflowStep",
    "WorkflowResultNotEncodable",
    "Workflow",
    "WorkflowInvalidTransition",
    "WorkflowNotFound",
    "WorkflowRun",
    "WorkflowTimeout",
    "Settings",
    "current_job",
    "periodic",
    "workflow",
    "send_async",
    "send_with_options_async",
]
