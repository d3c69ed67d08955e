"""``GET /api/schedules``: the periodic schedules the workers run, read-only."""

from __future__ import annotations

from dramatiq_pg_broker.history.periodic import list_schedules

from ..auth import OBSERVERS
from .workers import RegistryList


class ScheduleList(RegistryList):
    """Every schedule with its trigger, missed-tick policy, last tick and next run, as the
    workers registered them (the same rows as ``dramatiq-pg-broker schedules``)."""

    permissions = {"GET": OBSERVERS}

    def read(self, conn, schema: str) -> list[dict]:
        return list_schedules(conn, schema)

    def body(self, rows: list[dict]) -> dict:
        return {"schedules": rows}
