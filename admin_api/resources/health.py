"""``GET /api/health``: is the database reachable (and migrated)? No credentials."""

from __future__ import annotations

import falcon

from ..queries import JobQueries


class Health:
    """200 ``{"status": "ok", ...}`` or 503 ``{"status": "unavailable", "detail": ...}``."""

    public = True

    def __init__(self, queries: JobQueries) -> None:
        self.queries = queries

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        try:
            self.queries.ping()
        except LookupError as e:
            resp.status = 503
            resp.media = {
                "status": "unavailable",
                "database": "ok",
                "schema": "missing",
                "detail": f"{e}: run `dramatiq-pg-broker migrate`",
            }
            return
        except Exception as e:  # noqa: BLE001 - any failure to answer is "unavailable"
            resp.status = 503
            detail = str(getattr(e, "orig", None) or e).strip().splitlines()
            resp.media = {
                "status": "unavailable",
                "database": "unreachable",
                "detail": detail[0] if detail else type(e).__name__,
            }
            return
        resp.media = {"status": "ok", "database": "ok", "schema": "ok"}
