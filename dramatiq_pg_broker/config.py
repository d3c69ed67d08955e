"""Settings: keyword arguments first, then ``DRAMATIQ_PG_*`` environment variables, then
the defaults documented here.

Every setting has one environment variable, named ``DRAMATIQ_PG_`` plus the upper-case
field name (``lease_seconds`` is ``DRAMATIQ_PG_LEASE_SECONDS``). Booleans accept
``1/0``, ``true/false``, ``yes/no`` and ``on/off``; lists are comma-separated.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigurationError

#: The environment variable prefix.
ENV_PREFIX = "DRAMATIQ_PG_"

_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every knob of the broker, the workers and the admin API.

    Attributes:
      url(str): libpq connection URL. None means "start the embedded PostgreSQL" where the
        caller allows it (the demo and the tests); a deployment always names its server.
      schema(str): schema holding the tables. Defaults to ``dramatiq``.
      lease_seconds(float): how long a claim is valid without renewal.
      heartbeat_seconds(float): how often outstanding leases are renewed; None means a
        third of the lease.
      poll_interval(float): the longest an idle consumer waits before looking again, even
        without a notification.
      listen(bool): wake idle consumers with LISTEN/NOTIFY. Turn it off behind PgBouncer in
        transaction mode; polling then does all the work.
      prepared_statements(bool): let psycopg prepare the statements a connection runs
        often (the default). Turn it off behind PgBouncer in transaction mode (before 1.21,
        or without its ``max_prepared_statements``): a prepared statement lives in one
        server session, and the pooler hands each transaction to any session.
      events(bool): write job events (the audit trail). On by default.
      reaper_interval(float): seconds between two runs of the expired-lease reaper in each
        worker process. A run is skipped while the process's last empty claims report that
        no lease can have expired yet (see :mod:`.leases`).
      reaper_batch(int): the most rows one reaper run touches.
      backoff_base_ms(int): the first retry delay; doubles at every attempt.
      backoff_max_ms(int): the longest retry delay.
      max_attempts(int): attempts of a job whose actor sets no ``max_retries``
        (``max_retries + 1``).
      pool_min_size(int), pool_max_size(int): the per-process connection pool bounds.
      pool_timeout(float): the longest a caller (a ``send()``, say) waits for a pooled
        connection before it gets a connection error; while the server is unreachable the
        pool tries to reconnect at least twice a second.
      max_interruptions(int): how often a job's attempts may be interrupted (its worker
        died, hung or lost its lease) before the reaper fails it. Interruptions are not
        failures: ``max_retries`` does not count them.
      prefetch_growth(int): how far a consumer's claim window may grow beyond the
        prefetch Dramatiq gives it, as a multiple (1: never). It grows only while claims
        come back full and find the workers out of work (short jobs, whose threads would
        otherwise idle through each claim's round trip), and falls back when jobs take
        longer or the queue runs dry.
      enqueue_retries(int): how often a send is retried after a connection error.
      durable_sends(bool): a send returns once its commit is flushed to the server's WAL
        (the default). False: sends commit without waiting for the flush (PostgreSQL's
        ``synchronous_commit = off`` for that transaction only), faster, and a server crash
        can lose the sends of its last moments (see the README). A message's ``durable``
        option overrides it.
      log_level(str): level for the ``dramatiq_pg_broker`` loggers, or None to leave them.
      cors_origins(tuple[str, ...]): origins the admin API allows cross-site requests from.
      cookie_secure(bool): mark the admin session cookie Secure (HTTPS only).
      session_hours(float): admin sessions expire after this many hours.
      retention(bool): workers delete old finished jobs on the maintenance schedule.
      retention_interval(float): seconds between two retention runs (one run per interval
        across all worker processes).
      retention_batch(int): the most jobs one retention transaction deletes.
      retain_succeeded_days(float), retain_failed_days(float),
      retain_cancelled_days(float): how long finished jobs of each status (and their
        events) are kept; 0 keeps them forever.
      scheduler(bool): run periodic schedules (and retention) in worker processes.
      public_url(str): the admin API's public base URL (``https://ops.example.com``). Links
        in responses (pagination, ``Location``) start with it; unset, they are relative
        paths. Never taken from the request's ``Host`` header.
      trusted_proxies(tuple[str, ...]): addresses of reverse proxies in front of the admin
        API; for a request from one of them, the client address (for login throttling) is
        the last one in ``X-Forwarded-For``.
      statement_timeout(float): seconds an admin API query may run before PostgreSQL
        cancels it (the request gets a 503).
      login_concurrency(int): password checks (bcrypt) one admin API process runs at once;
        more logins wait briefly, then get a 429.
      admin_adhoc_actors(bool): let the admin API create jobs for actors no worker has
        declared (on the queue the request names, ``default`` if none). Off by default: a
        job is created only for a declared actor, on that actor's queue, so that nobody
        can invent actors or queues (and with them metric labels) through the API.
    """

    # Not in the repr: a logged Settings must not show the password (see public()).
    url: str | None = dataclasses.field(default=None, repr=False)
    schema: str = "dramatiq"
    lease_seconds: float = 30.0
    heartbeat_seconds: float | None = None
    poll_interval: float = 1.0
    listen: bool = True
    prepared_statements: bool = True
    events: bool = True
    reaper_interval: float = 10.0
    reaper_batch: int = 500
    backoff_base_ms: int = 15_000
    backoff_max_ms: int = 7 * 86_400_000
    max_attempts: int = 21
    pool_min_size: int = 1
    pool_max_size: int = 10
    pool_timeout: float = 30.0
    max_interruptions: int = 10
    prefetch_growth: int = 8
    enqueue_retries: int = 3
    durable_sends: bool = True
    log_level: str | None = None
    cors_origins: tuple[str, ...] = ()
    cookie_secure: bool = False
    session_hours: float = 12.0
    retention: bool = True
    retention_interval: float = 300.0
    retention_batch: int = 1000
    retain_succeeded_days: float = 7.0
    retain_failed_days: float = 30.0
    retain_cancelled_days: float = 7.0
    scheduler: bool = True
    public_url: str | None = None
    trusted_proxies: tuple[str, ...] = ()
    statement_timeout: float = 5.0
    login_concurrency: int = 1
    admin_adhoc_actors: bool = False

    def __post_init__(self) -> None:
        if not _SCHEMA_RE.match(self.schema):
            raise ConfigurationError(
                f"schema {self.schema!r} is not a valid name: use lower-case letters, digits "
                "and underscores, starting with a letter or underscore"
            )
        positive = (
            "lease_seconds",
            "poll_interval",
            "reaper_interval",
            "session_hours",
            "retention_interval",
            "statement_timeout",
            "pool_timeout",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be greater than 0")
        if self.heartbeat_seconds is not None and not (
            0 < self.heartbeat_seconds < self.lease_seconds
        ):
            raise ConfigurationError("heartbeat_seconds must be between 0 and lease_seconds")
        minimum_one = (
            "reaper_batch",
            "max_attempts",
            "pool_min_size",
            "pool_max_size",
            "retention_batch",
            "login_concurrency",
            "max_interruptions",
            "prefetch_growth",
        )
        for name in minimum_one:
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name} must be at least 1")
        if self.pool_max_size < self.pool_min_size:
            raise ConfigurationError("pool_max_size must not be smaller than pool_min_size")
        if self.backoff_base_ms < 0 or self.backoff_max_ms < self.backoff_base_ms:
            raise ConfigurationError("backoff needs 0 <= backoff_base_ms <= backoff_max_ms")
        if self.retention_interval < 1:
            raise ConfigurationError("retention_interval must be at least 1 second")
        for name in ("retain_succeeded_days", "retain_failed_days", "retain_cancelled_days"):
            if getattr(self, name) < 0:
                raise ConfigurationError(f"{name} must not be negative (0 keeps forever)")
        if self.public_url is not None:
            parts = urlsplit(self.public_url)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
                raise ConfigurationError(
                    f"public_url {self.public_url!r} must be an http(s) base URL such as "
                    "https://ops.example.com (no query string)"
                )
        if self.enqueue_retries < 0:
            raise ConfigurationError("enqueue_retries must not be negative")

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two lease renewals: a third of the lease unless configured."""
        return self.heartbeat_seconds or self.lease_seconds / 3

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from keyword arguments, then the environment, then defaults.

        Parameters:
          environ(Mapping): the environment to read; ``os.environ`` by default.
          **overrides: field values; None means "not given".

        Raises:
          ConfigurationError: an unknown keyword or a value that does not parse.
        """
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(overrides) - set(fields)
        if unknown:
            raise ConfigurationError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        for name, field in fields.items():
            if overrides.get(name) is not None:
                values[name] = overrides[name]
                continue
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = _parse(name, field.type, raw)
        return cls(**values)

    def public(self) -> dict[str, Any]:
        """The settings without secrets (the URL's password is masked)."""
        data = dataclasses.asdict(self)
        data["url"] = mask_url(self.url)
        data["heartbeat_seconds"] = self.heartbeat_interval
        data["cors_origins"] = list(self.cors_origins)
        data["trusted_proxies"] = list(self.trusted_proxies)
        return data


#: Connection parameters that are secrets (libpq's names): masked wherever a connection
#: string is shown.
SECRET_PARAMETERS = ("password", "sslpassword")
#: What a connection string libpq cannot parse is shown as (its text may hold a password).
UNPARSEABLE = "(a connection string libpq cannot parse)"


def mask_url(url: str | None) -> str | None:
    """Return a connection string that is safe to show: ``url`` parsed by libpq's own
    parser (``psycopg.conninfo``), so every form libpq accepts is understood (a URL with or
    without a user name, query parameters, ``key=value`` pairs, quoted values, passwords
    holding ``@`` or ``/``), with each secret parameter replaced by ``***``.

    The result is in ``key=value`` form, whatever form ``url`` had. A string libpq cannot
    parse is replaced whole by :data:`UNPARSEABLE`: libpq's own error message would quote
    part of it.
    """
    if not url:
        return url
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        params = conninfo_to_dict(url)
    except Exception:  # psycopg.ProgrammingError, or a string with a NUL byte
        return UNPARSEABLE
    for name in SECRET_PARAMETERS:
        if params.get(name) is not None:
            params[name] = "***"
    return make_conninfo("", **params)


def _parse(name: str, type_: Any, raw: str) -> Any:
    env = ENV_PREFIX + name.upper()
    text = str(type_)
    try:
        if "bool" in text:
            lowered = raw.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError(raw)
        if "tuple" in text:
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        if "float" in text:
            return float(raw)
        if "int" in text:
            return int(raw)
    except ValueError:
        raise ConfigurationError(f"{env}={raw!r} is not a valid value for {name}") from None
    return raw.strip() or None
