"""The dashboard: its pages and static files, and the two API endpoints only it needed.

The pages are static shells with no data in them (so they need no credentials, like the
docs page): the script in ``admin_api/dashboard/`` logs in through ``/api/auth/login`` and
reads everything through the API with the session cookie, so the dashboard shows what the
caller's role may see and nothing else, and every change it makes passes the API's role
and cross-site checks. Nothing is loaded from other sites; there is no build step.

- ``/`` redirects to ``/dashboard``: the overview (counts per queue with each queue's
  state and, for operators, Pause and Resume; charts of the last hour; the live worker
  processes), refreshed every few seconds.
- ``/dashboard/jobs``: the job list with the API's filters, in the page's query string,
  with previews of each job's arguments and last error.
- ``/dashboard/jobs/{job_id}``: one job, its timeline, Retry, Cancel, Abort and, for a job
  whose worker died (lease expired), Requeue.
- ``/dashboard/queues/{name}``: one queue: its jobs in each state, why they wait, its
  pause and limit with who set them, the last hour; Pause, Resume, set or clear the
  limit, requeue the jobs whose worker died.

Any other address under ``/dashboard/`` answers 404 with the same shell, whose script says
the page does not exist (a page, not the API's JSON error); ``/favicon.ico`` is the icon.

Names, arguments and errors are shown as text with control and bidirectional characters
escaped (see ``visible()`` in ``dashboard.js``), long names cut with the whole on hover.
"""

from __future__ import annotations

import threading
import time
from importlib import resources

import falcon
from pydantic import Field

from .. import responses
from ..auth import OBSERVERS
from ..monitoring import Monitor
from ..operations import ANY_QUERY, PUBLIC, operation
from ..pagination import link_to
from ..validation import Params, QueryInt

#: How the pages are declared: no credentials, no database, any query string (the script
#: reads the page's), not in the OpenAPI document.
page = operation(
    roles=PUBLIC,
    summary="A page of the dashboard.",
    query=ANY_QUERY,
    database=False,
    documented=False,
    responses={200: "HTML, or one of its files."},
)

#: The dashboard's files, read once: name -> (content type, bytes).
STATIC_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

#: Only this page's own files, from this origin; no inline script; no framing.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)


def _files() -> dict[str, tuple[str, bytes]]:
    folder = resources.files("admin_api").joinpath("dashboard")
    found = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if suffix in STATIC_TYPES:
            found[entry.name] = (STATIC_TYPES[suffix], entry.read_bytes())
    return found


FILES = _files()
PAGE = resources.files("admin_api").joinpath("dashboard", "index.html").read_bytes()


class Root:
    """``/``: to the dashboard."""

    route = "/"

    @page
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        # Relative (or under DRAMATIQ_PG_PUBLIC_URL): never built from the Host header.
        raise falcon.HTTPFound(link_to(req, "/dashboard"))


class DashboardPage:
    """``/dashboard``, ``/dashboard/jobs``, ``/dashboard/jobs/{job_id}`` and
    ``/dashboard/queues/{name}``, ``/dashboard/workflows`` and
    ``/dashboard/workflows/{id}``: one shell; the script reads the path. As
    :class:`NotFoundPage`, any other address under ``/dashboard/``, answered 404."""

    routes = (
        "/dashboard",
        "/dashboard/jobs",
        "/dashboard/jobs/{job_id}",
        "/dashboard/queues/{queue_name}",
        "/dashboard/workflows",
        "/dashboard/workflows/{workflow_id}",
    )
    status = falcon.HTTP_200

    @page
    def on_get(self, req: falcon.Request, resp: falcon.Response, **_: str) -> None:
        resp.status = self.status
        resp.content_type = falcon.MEDIA_HTML
        resp.set_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        resp.set_header("X-Content-Type-Options", "nosniff")
        resp.set_header("Cache-Control", "no-cache")
        resp.data = PAGE


class NotFoundPage(DashboardPage):
    """A mistyped dashboard address: the shell, whose script says there is no such page,
    with a 404."""

    routes = ("/dashboard/{rest:path}",)
    status = falcon.HTTP_404


class Favicon:
    """``/favicon.ico``: the dashboard's icon, for the tools that ask there."""

    route = "/favicon.ico"

    @page
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type, resp.data = FILES["icon.svg"]
        resp.set_header("X-Content-Type-Options", "nosniff")
        resp.set_header("Cache-Control", "max-age=86400")


class StaticFile:
    """``/dashboard/static/{name}``: the script, the style sheet and the icon."""

    route = "/dashboard/static/{name}"

    @page
    def on_get(self, req: falcon.Request, resp: falcon.Response, name: str) -> None:
        found = FILES.get(name)
        if found is None:
            raise falcon.HTTPNotFound(description=f"The dashboard has no file named {name!r}.")
        resp.content_type, resp.data = found
        resp.set_header("X-Content-Type-Options", "nosniff")
        resp.set_header("Cache-Control", "no-cache")


class Queues:
    """``GET /api/queues``: every queue as the broker's overview reads it (the CLI's
    ``stats``): its state, its jobs in each state (ready, delayed, paused, running,
    lease_expired, failed), how long the oldest runnable one has waited, its pause, its
    limit and who set it, the live worker processes that consume it, and why its jobs wait
    (see :mod:`dramatiq_pg_broker.control.overview`)."""

    route = "/api/queues"

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    @operation(
        roles=OBSERVERS,
        summary="Per queue: its state, its jobs in each state (ready, delayed, paused, "
        "running, lease_expired, failed), the age of the oldest runnable job, its pause, its "
        "limit and who set it, its live workers and why its jobs wait. Every declared queue "
        "is listed; another queue while it has such jobs or a limit.",
        responses={200: (responses.QueueList, "The queues, by name.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"results": [queue.as_dict() for queue in self.monitor.queues().values()]}


#: The longest window of ``GET /api/throughput``, in minutes.
MAX_THROUGHPUT_MINUTES = 24 * 60


#: Seconds a throughput answer is reused: every open dashboard asks every 15 s, and a
#: busy hour's events take a while to count; per-minute bars gain nothing from fresher data.
THROUGHPUT_CACHE_SECONDS = 10.0


class ThroughputParams(Params):
    """The window of ``GET /api/throughput``."""

    minutes: QueryInt = Field(
        60, ge=1, le=MAX_THROUGHPUT_MINUTES, description="The window, in minutes."
    )


class Throughput:
    """``GET /api/throughput?minutes=60``: succeeded, failed and retried attempts per
    minute (see :meth:`Monitor.throughput`), reused for :data:`THROUGHPUT_CACHE_SECONDS`
    within a process."""

    route = "/api/throughput"

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self._lock = threading.Lock()
        self._cache: dict[int, tuple[float, dict]] = {}

    @operation(
        roles=OBSERVERS,
        summary="Succeeded, failed and retried attempts per minute.",
        query=ThroughputParams,
        responses={200: (responses.Throughput, "One bucket per minute, oldest first.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response, query: ThroughputParams) -> None:
        minutes = query.minutes
        # One reader at a time: concurrent dashboards wait for the answer being counted
        # instead of counting it again.
        with self._lock:
            at, answer = self._cache.get(minutes, (0.0, None))
            if answer is None or time.monotonic() - at > THROUGHPUT_CACHE_SECONDS:
                answer = self.monitor.throughput(minutes=minutes)
                self._cache[minutes] = (time.monotonic(), answer)
        resp.media = answer
