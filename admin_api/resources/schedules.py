"""``GET /api/schedules``: the periodic schedules the workers run, read-only."""

from __future__ import annotations

import falcon

from dramatiq_pg_broker.history.periodic import list_schedules

from .. import responses
from ..auth import OBSERVERS
from ..operations import operation
from .workers import RegistryList


class ScheduleList(RegistryList):
    """Every schedule with its trigger, missed-tick policy, last tick and next run, as the
    workers registered them (the same rows as ``dramatiq-pg-broker schedules``)."""

    route = "/api/schedules"

    @operation(
        roles=OBSERVERS,
        summary="Periodic schedules: trigger, missed-tick policy, last tick, next run (read-only).",
        responses={200: (responses.ScheduleList, "Every schedule the workers registered.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.respond(resp)

    def read(self, conn, schema: str) -> list[dict]:
        return list_schedules(conn, schema)

    def body(self, rows: list[dict]) -> dict:
        return {"schedules": rows}
