"""dramatiq-pg-broker: a PostgreSQL broker for Dramatiq."""

from .broker import JobFailed, PostgresBroker
from .config import Settings
from .current import CurrentJob, current_job
from .errors import (
    ConfigurationError,
    InvalidTransition,
    JobNotFound,
    MigrationChecksumError,
    MigrationError,
    PgBrokerError,
    SchemaMissing,
)
from .jobs import Attempt, JobStore
from .retries import Retries

__all__ = [
    "Attempt",
    "ConfigurationError",
    "CurrentJob",
    "InvalidTransition",
    "JobFailed",
    "JobNotFound",
    "JobStore",
    "MigrationChecksumError",
    "MigrationError",
    "PgBrokerError",
    "PostgresBroker",
    "Retries",
    "SchemaMissing",
    "Settings",
    "current_job",
]

__version__ = "0.1.0"
