"""``GET /api/workers`` (the live worker processes) and ``GET /api/actors`` (the actors
workers declared, which the API creates jobs for), from the worker registry
(:mod:`dramatiq_pg_broker.workers`)."""

from __future__ import annotations

import falcon

from dramatiq_pg_broker.jobs import JobStore
from dramatiq_pg_broker.workers import list_actors, list_workers

from ..auth import OBSERVERS, READERS
from ..validation import Query


class WorkerList:
    """Every live worker process: host, process id, queues, actors, version, when it
    started, its last heartbeat, and the attempts it holds (in flight). A process that
    stopped refreshing for a lease is not listed."""

    permissions = {"GET": OBSERVERS}

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        Query(req, ())
        with self.store.pool.connection() as conn:
            rows = list_workers(conn, self.store.schema)
        resp.media = {"count": len(rows), "results": rows}


class ActorList:
    """Every declared actor with its queue (what ``POST /api/jobs`` accepts), when a worker
    last declared it, and how many live workers declare it now."""

    permissions = {"GET": READERS}

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        Query(req, ())
        with self.store.pool.connection() as conn:
            rows = list_actors(conn, self.store.schema)
        resp.media = {"count": len(rows), "results": rows}
