"""dramatiq-pg-broker: a PostgreSQL broker for Dramatiq."""

from .async_sending import send_async, send_with_options_async
from .broker import JobFailed, PostgresBroker
from .config import Settings
from .current import CurrentJob, current_job
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
    JobNotFound,
    LiveWorkFound,
    LostOwnership,
    MessageSkipped,
    MigrationChecksumError,
    MigrationError,
    MigrationsPending,
    PgBrokerError,
    SchemaMissing,
    SchemaVersionError,
    TransactionError,
)
from .jobs import Attempt, JobStore
from .periodic import Schedule, periodic
from .retention import RetentionPolicy
from .retries import Retries

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
    "JobFailed",
    "JobNotFound",
    "JobStore",
    "LiveWorkFound",
    "LostOwnership",
    "MessageSkipped",
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
    "Settings",
    "current_job",
    "periodic",
    "send_async",
    "send_with_options_async",
]

#: The package version, in one place: setup.cfg reads it (``attr:``), and so do the admin
#: API's OpenAPI document and ``dramatiq-pg-broker --version``.
__version__ = "0.2.0.dev0"
