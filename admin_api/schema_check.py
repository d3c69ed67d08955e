"""The admin API's side of the schema handshake (:mod:`dramatiq_pg_broker.db.handshake`).

No request reaches the database before this process has passed the handshake: the first
request that needs the database runs it (one round trip, once per process; creating the
app does no I/O, so gunicorn boots whatever the schema says). Against a schema this code
does not fit, each such request is answered 503 with the handshake's line, and the line is
logged once per process, not per request; ``/api/health`` says it in its own shape. Once
the schema fits (after ``dramatiq-pg-broker migrate``, say), the next request passes,
without a restart. The dashboard's pages and the API's documentation need no database and
are always served.
"""

from __future__ import annotations

import logging
import threading

import falcon

from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.errors import SchemaVersionError

logger = logging.getLogger(__name__)


class SchemaCheck:
    """Falcon middleware running :meth:`check` before every responder whose operation
    needs the database (all but those declared with ``database=False``: the pages, the
    document, and ``/api/health``, which runs the check itself). Place it before the
    authentication, which reads accounts.

    Parameters:
      pool(ProcessPool): the API's pool; its handshake is the process's.
    """

    def __init__(self, pool: ProcessPool) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._logged: str | None = None

    def check(self) -> None:
        """Pass the handshake (at once, once it has passed).

        Raises:
          SchemaVersionError: this code does not fit the schema; logged once.
          dramatiq.errors.ConnectionError: the database cannot be reached.
        """
        if self.pool.handshake_passed:
            return
        try:
            self.pool.check_schema()
        except SchemaVersionError as e:
            line = str(e)
            with self._lock:
                first = line != self._logged
                self._logged = line
            if first:
                logger.error("The admin API cannot use the database: %s.", line)
            raise

    def process_resource(self, req: falcon.Request, resp: falcon.Response, resource, params):
        method = "get" if req.method == "HEAD" else req.method.lower()
        declared = getattr(getattr(resource, f"on_{method}", None), "operation", None)
        if declared is not None and declared.database:
            self.check()
