"""``GET /api/workers`` (the live worker processes) and ``GET /api/actors`` (the actors
workers declared, which the API creates jobs for), from the worker registry
(:mod:`dramatiq_pg_broker.control.workers`)."""

from __future__ import annotations

import falcon

from dramatiq_pg_broker.control.workers import list_actors, list_workers
from dramatiq_pg_broker.jobs import JobStore

from .. import responses
from ..auth import OBSERVERS, READERS
from ..operations import operation


class RegistryList:
    """A list read from what the workers registered (see :meth:`read`), on the store's
    pool: ``{"count": n, "results": [...]}``."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def respond(self, resp: falcon.Response) -> None:
        with self.store.pool.connection() as conn:
            rows = self.read(conn, self.store.schema)
        resp.media = self.body(rows)

    def read(self, conn, schema: str) -> list[dict]:
        raise NotImplementedError

    def body(self, rows: list[dict]) -> dict:
        return {"count": len(rows), "results": rows}


class WorkerList(RegistryList):
    """Every live worker process: host, process id, queues, actors, version, schema level
    (the highest migration its code ships), when it started, its last heartbeat, and the
    attempts it holds (in flight). A process that stopped refreshing for a lease is not
    listed."""

    route = "/api/workers"

    @operation(
        roles=OBSERVERS,
        summary="The live worker processes: host, pid, queues, actors, start, last heartbeat, "
        "jobs in flight.",
        responses={200: (responses.WorkerList, "The live workers, oldest first.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.respond(resp)

    def read(self, conn, schema: str) -> list[dict]:
        return list_workers(conn, schema)


class ActorList(RegistryList):
    """Every declared actor with its queue (what ``POST /api/jobs`` accepts), when a worker
    last declared it, and how many live workers declare it now."""

    route = "/api/actors"

    @operation(
        roles=READERS,
        summary="The actors workers declared, each with its queue: what POST /api/jobs accepts.",
        responses={200: (responses.ActorList, "The declared actors, by name.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.respond(resp)

    def read(self, conn, schema: str) -> list[dict]:
        return list_actors(conn, schema)
