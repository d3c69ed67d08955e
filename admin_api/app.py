"""The application factory: ``create_app(settings)`` builds the Falcon app and everything
it talks to. Building it does no I/O; connections open on the first request, per process.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

import falcon
import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.db import ProcessPool, resolve_url
from dramatiq_pg_broker.db.core import application_name
from dramatiq_pg_broker.jobs import JobStore

from . import media
from .accounts import AccountStore
from .auth import Authentication, SecurityHeaders
from .errors import add_error_handlers
from .metrics import Metrics
from .monitoring import Monitor
from .operations import operations, routes
from .queries import JobQueries
from .resources.dashboard import (
    DashboardPage,
    Favicon,
    NotFoundPage,
    Queues,
    Root,
    StaticFile,
    Throughput,
)
from .resources.docs import DocsPage, OpenApiDocument
from .resources.events import EventFeed
from .resources.health import Health, HealthFindings
from .resources.jobs import (
    AbortJob,
    CancelJob,
    JobDetail,
    JobEvents,
    JobList,
    JobStats,
    RequeueJob,
    RetryJob,
)
from .resources.metrics import MetricsPage
from .resources.queues import (
    PauseQueue,
    QueueDetail,
    QueueLimit,
    RequeueExpired,
    ResumeQueue,
)
from .resources.schedules import ScheduleList
from .resources.sessions import Login, Logout, Me
from .resources.settings import Config
from .resources.users import TokenDetail, UserDetail, UserList, UserTokens
from .resources.workers import ActorList, WorkerList
from .resources.workflows import AbortWorkflow, RetryWorkflow, WorkflowDetail, WorkflowList
from .schema_check import SchemaCheck
from .throttle import LoginThrottle

logger = logging.getLogger(__name__)

#: Seconds a request waits for a database connection before it is answered with a 503.
#: Well under gunicorn's worker timeout, so that a database outage gets a JSON error rather
#: than a killed worker.
DATABASE_WAIT_SECONDS = 5


#: The API's resources, in the OpenAPI document's order. Each says where it is served
#: (``route``) and declares its operations on its responders (:mod:`admin_api.operations`):
#: the router, the authorization and the document are derived from those declarations.
API = (
    Health,
    HealthFindings,
    Config,
    JobList,
    JobStats,
    ScheduleList,
    JobDetail,
    JobEvents,
    RetryJob,
    CancelJob,
    AbortJob,
    RequeueJob,
    QueueDetail,
    PauseQueue,
    ResumeQueue,
    QueueLimit,
    RequeueExpired,
    WorkflowList,
    WorkflowDetail,
    AbortWorkflow,
    RetryWorkflow,
    WorkerList,
    ActorList,
    EventFeed,
    Login,
    Logout,
    Me,
    UserList,
    UserDetail,
    UserTokens,
    TokenDetail,
    OpenApiDocument,
    DocsPage,
    Queues,
    Throughput,
)
#: What the app serves besides the API (HTML and Prometheus text): declared the same way,
#: left out of the document.
PAGES = (Root, DashboardPage, StaticFile, NotFoundPage, Favicon, MetricsPage)


@dataclasses.dataclass(frozen=True)
class Parts:
    """What the resources are built with: a resource's constructor takes the parts it
    uses, by these names (see :func:`build`)."""

    settings: Settings
    store: JobStore
    accounts: AccountStore
    queries: JobQueries
    monitor: Monitor
    metrics: Metrics
    throttle: LoginThrottle
    schema_check: SchemaCheck


def build(resource: type, parts: Parts) -> object:
    """An instance of ``resource``, given the parts its constructor names, answering HEAD
    as it answers GET (see :func:`with_head`).

    Raises:
      TypeError: a responder declares no operation, or the constructor takes something
        that is not one of the :class:`Parts`.
    """
    operations(resource)
    names = inspect.signature(resource).parameters
    return with_head(resource(**{name: getattr(parts, name) for name in names}))


def statement_timeout_ms(settings: Settings) -> int:
    return max(1, round(settings.statement_timeout * 1000))


#: What the admin API's connections call themselves in ``pg_stat_activity``, followed by
#: ``/`` and the process id (see :func:`dramatiq_pg_broker.db.core.application_name`).
APPLICATION = "dramatiq-pg-admin"


class ApiPool(ProcessPool):
    """The broker's per-process pool, waiting at most :data:`DATABASE_WAIT_SECONDS` for a
    connection (the broker's workers wait longer: they have no client waiting), and whose
    connections stop any statement after ``settings.statement_timeout``.

    An admin API process opens at most ``2 × pool_max_size`` connections whatever its
    threads: this pool (the changes, the accounts, the login throttle) and the read
    engine's (:func:`create_engine`), each of ``pool_max_size``. A request that finds its
    pool taken waits up to :data:`DATABASE_WAIT_SECONDS`, then gets a 503."""

    def __init__(self, settings: Settings) -> None:
        timeout = statement_timeout_ms(settings)

        def configure(conn: psycopg.Connection) -> None:
            conn.execute("SELECT set_config('statement_timeout', %s, false)", (f"{timeout}ms",))

        super().__init__(settings, configure=configure, application=APPLICATION)

    def get(self):
        pool = super().get()
        pool.timeout = DATABASE_WAIT_SECONDS
        return pool


def create_engine(url: str, settings: Settings) -> Engine:
    """A SQLAlchemy engine for the read queries, over psycopg 3.

    Connections come from ``psycopg.connect(url)`` so that any libpq connection string
    works (a URL or ``key=value`` pairs), exactly as for the broker. Each one stops any
    statement that runs longer than ``settings.statement_timeout`` (PostgreSQL's
    ``statement_timeout``, set once per connection): no request, whatever its filters,
    holds the database longer; the client gets a 503 that says so.

    The connections also turn off PostgreSQL's JIT compilation (``jit``): the reads are
    short index walks, but over dozens of partitions of history the planner's cost of one
    passes ``jit_above_cost``, and compiling it took longer than running it (about a
    second on top of a member's event feed of 0.3 s, at 1,000,000 jobs).
    """
    timeout = statement_timeout_ms(settings)

    def connect() -> psycopg.Connection:
        conn = psycopg.connect(
            url,
            connect_timeout=DATABASE_WAIT_SECONDS,
            autocommit=True,
            fallback_application_name=application_name(APPLICATION),
        )
        conn.execute(
            "SELECT set_config('statement_timeout', %s, false), set_config('jit', 'off', false)",
            (f"{timeout}ms",),
        )
        conn.autocommit = False
        return conn

    return sa.create_engine(
        "postgresql+psycopg://",
        creator=connect,
        pool_size=settings.pool_max_size,
        max_overflow=0,
        pool_pre_ping=True,
        pool_timeout=DATABASE_WAIT_SECONDS,
    )


def create_app(
    settings: Settings | None = None,
    *,
    store: JobStore | None = None,
    accounts: AccountStore | None = None,
    engine: Engine | None = None,
    throttle: LoginThrottle | None = None,
) -> falcon.App:
    """Build the admin API.

    Parameters:
      settings(Settings): database URL, schema, CORS origins, cookie and session settings.
        Default: :meth:`Settings.load` (``DRAMATIQ_PG_*`` variables).
      store(JobStore): the job state machine to change jobs with. Default: one on a new
        per-process pool.
      accounts(AccountStore): users, sessions and tokens. Default: one on the store's pool.
      engine(Engine): the SQLAlchemy engine for reads. Default: one on the same URL.
      throttle(LoginThrottle): the login throttle. Default: one on the accounts' pool.

    Returns:
      falcon.App: the WSGI application.
    """
    settings = settings or Settings.load()
    url: str | None = None

    def database_url() -> str:
        nonlocal url
        if url is None:
            url = resolve_url(settings)
        return url

    if store is None:
        store = JobStore(ApiPool(settings), settings.schema, events=settings.events)
    if accounts is None:
        accounts = AccountStore(
            store.pool, settings.schema, hash_concurrency=settings.login_concurrency
        )
    if throttle is None:
        throttle = LoginThrottle(accounts.pool, settings.schema)
    if engine is None:
        engine = create_engine(settings.url or database_url(), settings)
    monitor = Monitor(
        engine,
        settings.schema,
        lease_seconds=settings.lease_seconds,
        statement_timeout_ms=statement_timeout_ms(settings),
    )
    # Before the authentication, which reads accounts: see schema_check.py.
    schema_check = SchemaCheck(store.pool)
    parts = Parts(
        settings=settings,
        store=store,
        accounts=accounts,
        queries=JobQueries(engine, settings.schema),
        monitor=monitor,
        metrics=Metrics(monitor),
        throttle=throttle,
        schema_check=schema_check,
    )

    middleware: list[Any] = []
    if settings.cors_origins:
        origins = list(settings.cors_origins)
        middleware.append(falcon.CORSMiddleware(allow_origins=origins, allow_credentials=origins))
    middleware.append(SecurityHeaders(settings))
    middleware.append(schema_check)
    middleware.append(Authentication(accounts, settings))
    app = falcon.App(middleware=middleware)
    media.install(app)
    add_error_handlers(app)
    # "/api/jobs/" and "/api/jobs" are the same resource.
    app.req_options.strip_url_path_trailing_slash = True
    for resource in (*API, *PAGES):
        instance = build(resource, parts)
        for path in routes(resource):
            app.add_route(path, instance)
    return app


def with_head(resource: object) -> object:
    """The resource, answering HEAD as it answers GET: the same status and headers, no
    body (Falcon sends none for HEAD). For every GET route, the pages and /metrics too:
    monitoring probes and link checkers send HEAD."""
    if hasattr(resource, "on_get") and not hasattr(resource, "on_head"):
        resource.on_head = resource.on_get  # type: ignore[attr-defined]
    return resource
