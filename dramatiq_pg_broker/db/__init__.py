"""Database plumbing: the pools and named statements, the schema handshake, the
migrations, outage logs, the one LISTEN connection per process and the local
PostgreSQL. It imports the base modules only (errors, config, forks, events, service)."""

from .core import (
    JOB_COLUMNS,
    CappedAttempt,
    ProcessPool,
    Queries,
    connect,
    connection_kwargs,
    expand_macros,
    load_fragments,
    load_queries,
    resolve_url,
    translate_errors,
)
