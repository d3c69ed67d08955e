"""Database plumbing: the pools, the named statements, the schema handshake, the
migrations, outage logs, the one LISTEN connection per process and the local
PostgreSQL. It imports the base modules only (errors, config, forks, events, service)."""

from .core import (
    CappedAttempt,
    ProcessPool,
    connect,
    connection_kwargs,
    read_committed,
    resolve_url,
    translate_errors,
)
from .queries import JOB_COLUMNS, Queries, expand_macros, load_fragments, load_queries
