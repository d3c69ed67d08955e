"""Reading a job in tests through the job store's own API (so that the tests follow the
tables wherever the store keeps them), on the store's pooled connections: only committed
rows are seen."""

from __future__ import annotations

from dramatiq_pg_broker.errors import JobNotFound
from dramatiq_pg_broker.jobs import JobStore


def status_of(store: JobStore, job_id: str) -> str | None:
    """A job's status, None if there is no such job."""
    try:
        return store.get(job_id)["status"]
    except JobNotFound:
        return None


def event_types(store: JobStore, job_id: str) -> list[str]:
    """A job's event types, oldest first."""
    return [event["type"] for event in store.events_of(job_id)]
