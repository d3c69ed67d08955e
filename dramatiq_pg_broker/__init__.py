"""dramatiq-pg-broker: a PostgreSQL broker for Dramatiq."""

from .broker import JobFailed, PostgresBroker
from .config import Settings
from .current import CurrentJob, current_job
from .errors import (
    CodeTooOld,
    ConfigurationError,
    InvalidMessage,
    InvalidTransition,
    JobAlreadyFinished,
    JobNotFound,
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
    "Attempt",
    "CodeTooOld",
    "ConfigurationError",
    "CurrentJob",
    "InvalidMessage",
    "InvalidTransition",
    "JobAlreadyFinished",
    "JobFailed",
    "JobNotFound",
    "JobStore",
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
]

__version__ = "0.1.0"
