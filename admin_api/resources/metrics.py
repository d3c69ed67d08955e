"""``GET /metrics``: Prometheus' text format (see :mod:`admin_api.metrics`).

Two ways to reach it:

- on the admin API, with the credentials of a ``viewer`` (the read-only role; an API token
  of a viewer account is what a Prometheus server should use), ``operator`` or ``admin``;
- on a separate bind with no credentials: :func:`create_metrics_app` serves ``/metrics``
  alone, for a listener only the monitoring network can reach::

      gunicorn --workers 1 --bind 10.0.0.5:9808 'admin_api.metrics_wsgi:app'
"""

from __future__ import annotations

import falcon

from dramatiq_pg_broker.config import Settings

from ..auth import OBSERVERS
from ..metrics import Metrics
from ..monitoring import Monitor
from ..operations import PUBLIC, operation

#: The classic text format (what ``generate_latest`` writes), which every Prometheus reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsPage:
    """``GET /metrics`` on the admin API: viewer, operator or admin."""

    route = "/metrics"

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    @operation(
        roles=OBSERVERS,
        summary="Prometheus' text format.",
        documented=False,
        responses={200: "The metrics."},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.respond(resp)

    def respond(self, resp: falcon.Response) -> None:
        resp.content_type = CONTENT_TYPE
        resp.data = self.metrics.render()


class OpenMetricsPage(MetricsPage):
    """``GET /metrics`` of the metrics-only app: no credentials (guard it by where it
    listens)."""

    @operation(
        roles=PUBLIC,
        summary="Prometheus' text format.",
        documented=False,
        responses={200: "The metrics."},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.respond(resp)


def create_metrics_app(settings: Settings | None = None, *, engine=None) -> falcon.App:
    """A WSGI app that serves ``/metrics`` only, without credentials.

    Parameters:
      settings(Settings): database URL and schema. Default: :meth:`Settings.load`.
      engine(Engine): the SQLAlchemy engine. Default: one on the settings' URL.

    Returns:
      falcon.App: the WSGI application.
    """
    from dramatiq_pg_broker.db import ProcessPool, resolve_url

    from ..app import create_engine, statement_timeout_ms, with_head
    from ..errors import add_error_handlers
    from ..schema_check import SchemaCheck

    settings = settings or Settings.load()
    if engine is None:
        engine = create_engine(settings.url or resolve_url(settings), settings)
    # The schema handshake, as for the whole API (its pool serves only that check).
    app = falcon.App(middleware=[SchemaCheck(ProcessPool(settings))])
    add_error_handlers(app)
    monitor = Monitor(
        engine,
        settings.schema,
        lease_seconds=settings.lease_seconds,
        statement_timeout_ms=statement_timeout_ms(settings),
    )
    app.add_route("/metrics", with_head(OpenMetricsPage(Metrics(monitor))))
    return app
