"""``GET /api/health``: is the database reachable, and does this code fit its schema? No
credentials. ``GET /api/health/findings``: the database's health as ``dramatiq-pg-broker
doctor`` examines it, for the dashboard's health panel (observers only: it names sessions,
their queries and clients)."""

from __future__ import annotations

import logging
import threading
import time

import falcon

from dramatiq_pg_broker.errors import MigrationsPending, SchemaVersionError

from .. import responses
from ..auth import OBSERVERS
from ..monitoring import Monitor
from ..operations import PUBLIC, operation
from ..queries import JobQueries
from ..schema_check import SchemaCheck

logger = logging.getLogger(__name__)


class Health:
    """200 ``{"status": "ok", ...}`` or 503 ``{"status": "unavailable", "detail": ...}``.

    ``schema`` is ``missing`` (no jobs table), ``migrations_pending`` (older than this code
    needs) or ``code_too_old`` (it had a breaking migration this code does not ship), with
    the schema handshake's line as ``detail``.
    """

    route = "/api/health"

    def __init__(self, queries: JobQueries, schema_check: SchemaCheck | None = None) -> None:
        self.queries = queries
        self.schema_check = schema_check

    @operation(
        roles=PUBLIC,
        summary="Is the database reachable? No credentials needed.",
        # It runs the schema check itself, to say what it found in its own shape.
        database=False,
        responses={
            200: (responses.Health, "The database answers and is migrated."),
            503: (responses.Health, "It does not; detail says why."),
        },
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        try:
            self.queries.ping()
            if self.schema_check is not None:
                self.schema_check.check()
        except SchemaVersionError as e:
            resp.status = 503
            resp.media = {
                "status": "unavailable",
                "database": "ok",
                "schema": (
                    "migrations_pending" if isinstance(e, MigrationsPending) else "code_too_old"
                ),
                "detail": str(e),
            }
            return
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
            # The driver's message names hosts and users; anyone may call this endpoint, so
            # it gets the kind of failure and the log gets the whole message.
            logger.warning("Health check: the database did not answer: %s", e)
            resp.status = 503
            cause = getattr(e, "orig", None) or e
            resp.media = {
                "status": "unavailable",
                "database": "unreachable",
                "detail": f"the database did not answer ({type(cause).__name__}); "
                "the API log has the driver's message",
            }
            return
        resp.media = {"status": "ok", "database": "ok", "schema": "ok"}


#: Seconds a health report is reused within a process: every open dashboard asks every
#: 15 s, and the checks read the server's statistics views, which change no faster.
FINDINGS_CACHE_SECONDS = 10.0


class HealthFindings:
    """``GET /api/health/findings``: every check of ``dramatiq-pg-broker doctor``, each
    finding with its level, what it found, its details, what to do and its figures (see
    :mod:`dramatiq_pg_broker.health.doctor`), reused for :data:`FINDINGS_CACHE_SECONDS`
    within a process."""

    route = "/api/health/findings"

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self._lock = threading.Lock()
        self._cache: tuple[float, dict] | None = None

    @operation(
        roles=OBSERVERS,
        summary="The database's health as `dramatiq-pg-broker doctor` examines it: each "
        "finding with what to do.",
        responses={200: (responses.HealthReport, "Every check's finding, in order.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        # One examination at a time: concurrent dashboards wait for it instead of
        # running it again.
        with self._lock:
            if self._cache is None or time.monotonic() - self._cache[0] > FINDINGS_CACHE_SECONDS:
                self._cache = (time.monotonic(), self.monitor.health().as_dict())
            resp.media = self._cache[1]
