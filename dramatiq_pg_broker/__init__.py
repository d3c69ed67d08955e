"""dramatiq-pg-broker: a PostgreSQL broker for Dramatiq."""

from .broker import JobFailed, PostgresBroker
from .config import Settings
from .current import CurrentJob, current_job
from .errors import (
    ConfigurationError,
    InvalidMessage,
    InvalidTransition,
    JobAborted,
    JobAlreadyFinished,
    JobNotFound,
    MigrationChecksumError,
    MigrationError,
    PgBrokerError,
    SchemaMissing,
    TransactionError,
)
from .jobs import Attempt, JobStore
from .periodic import Schedule, periodic
from .retention import RetentionPolicy
from .retries import Retries

__all__ = [
    "Attempt",
    "ConfigurationError",
    "CurrentJob",
    "InvalidMessage",
    "InvalidTransition",
    "JobAborted",
    "JobAlreadyFinished",
    "JobFailed",
    "JobNotFound",
    "JobStore",
    "MigrationChecksumError",
    "MigrationError",
    "PgBrokerError",
    "PostgresBroker",
    "Retries",
    "RetentionPolicy",
    "Schedule",
    "SchemaMissing",
    "TransactionError",
    "Settings",
    "current_job",
    "periodic",
]

__version__ = "0.1.0"
