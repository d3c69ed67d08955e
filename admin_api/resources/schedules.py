"""``GET /api/schedules``: the periodic schedules the workers run, read-only."""

from __future__ import annotations

import falcon

from dramatiq_pg_broker.jobs import JobStore
from dramatiq_pg_broker.periodic import list_schedules

from ..auth import OBSERVERS
from ..validation import Query


class ScheduleList:
    """Every schedule with its trigger, missed-tick policy, last tick and next run, as the
    workers registered them (the same rows as ``dramatiq-pg-broker schedules``)."""

    permissions = {"GET": OBSERVERS}

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        Query(req, ())
        with self.store.pool.connection() as conn:
            resp.media = {"schedules": list_schedules(conn, self.store.schema)}
