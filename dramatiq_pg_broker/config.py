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

from .errors import ConfigurationError, InvalidQueueLimit, InvalidQueueName
from .queue_rules import check_limit, check_queue_name
from .urls import check_url, mask_url

#: The environment variable prefix.
ENV_PREFIX = "DRAMATIQ_PG_"

_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


#: The values of the ``notify_sends`` setting (see :mod:`.sending.notifier`).
NOTIFY_SENDS = ("coalesced", "statement", "off")

#: The groups settings are listed in, in order (the docs' settings reference has one table
#: per group).
GROUPS = (
    "Database",
    "Workers",
    "Retries and recovery",
    "Sending",
    "Periodic jobs and retention",
    "Admin API",
    "Logging",
)


def _setting(default: Any, doc: str, *, group: str, shown: str | None = None, **kwargs: Any):
    """A settings field that carries its own documentation.

    Parameters:
      default: the default value.
      doc(str): what the setting does, in a sentence or two (MyST Markdown: backticks for
        code). The docs' settings table is generated from it.
      group(str): one of :data:`GROUPS`.
      shown(str): the default as the docs show it, when the value alone would not say it
        (None meaning "a third of the lease", say).
    """
    assert group in GROUPS, group
    metadata = {"doc": doc, "group": group, "default": shown}
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every knob of the broker, the workers, the CLI and the admin API.

    Each field's documentation is in its metadata (``doc``, ``group``), read by
    :func:`describe` and the docs' settings table; ``Settings.load()`` reads keyword
    arguments first, then ``DRAMATIQ_PG_<FIELD NAME>``, then the defaults.
    """

    # Not in the repr: a logged Settings must not show the password (see public()).
    url: str | None = _setting(
        None,
        "libpq URL of the database (`postgresql://`, `postgres://` or a `key=value` "
        "string; SQLAlchemy's `postgresql+psycopg://` and the like are read as "
        "`postgresql://`); a URL libpq cannot read is refused when the settings are built. "
        "Unset, the demo, the tests and the CLI start a local "
        "PostgreSQL from the `pgserver` package (the `embedded` extra); a deployment always "
        "sets it.",
        group="Database",
        shown="(embedded server)",
        repr=False,
    )
    schema: str = _setting(
        "dramatiq",
        "Schema holding the tables (`jobs`, `job_events`, `schema_migrations`, ...). No "
        "table collides with the older `dramatiq-pg` project's `dramatiq.queue`.",
        group="Database",
    )
    pool_min_size: int = _setting(
        1, "Connections each process's pool keeps open.", group="Database"
    )
    pool_max_size: int = _setting(10, "Most connections of each process's pool.", group="Database")
    pool_timeout: float = _setting(
        30.0,
        "Seconds a caller (a `send()`, say) waits for a pooled connection before it gets a "
        "connection error; while the server is unreachable the pool tries to reconnect at "
        "least twice a second.",
        group="Database",
    )
    listen: bool = _setting(
        True,
        "Wake idle consumers (and blocked result readers) with LISTEN/NOTIFY. `false` "
        "behind PgBouncer in transaction mode: consumers then poll every `poll_interval`.",
        group="Database",
    )
    prepared_statements: bool = _setting(
        True,
        "Let psycopg prepare the statements a connection runs often. `false` behind "
        "PgBouncer in transaction mode (before 1.21, or without its "
        "`max_prepared_statements`): a prepared statement lives in one server session, "
        "and the pooler hands each transaction to any session.",
        group="Database",
    )
    lease_seconds: float = _setting(
        30.0,
        "How long a claim is valid without renewal: a dead worker's jobs go back to their "
        "queues within this and `reaper_interval`, and its places under queue limits "
        "come back within this alone.",
        group="Workers",
    )
    heartbeat_seconds: float | None = _setting(
        None,
        "How often a worker process renews the leases of its outstanding messages.",
        group="Workers",
        shown="lease / 3",
    )
    poll_interval: float = _setting(
        1.0,
        "Longest an idle consumer waits (seconds) before it looks again without a notification.",
        group="Workers",
    )
    prefetch_growth: int = _setting(
        8,
        "How far a consumer's claim window may grow beyond Dramatiq's prefetch "
        "(`dramatiq_queue_prefetch`, twice the threads by default), as a multiple. It grows "
        "only while claims come back full and find the worker threads out of work (short "
        "jobs) and falls back otherwise; `1` keeps the prefetch exactly.",
        group="Workers",
    )
    queue_limits: tuple[tuple[str, int], ...] = _setting(
        (),
        "Queues whose running jobs are limited across every worker, as `name=N` pairs "
        "separated by commas (`partner_api=5,reports=2`; in code, "
        '`queue_limits={"partner_api": 5}`), each N from 1 to 1,000,000. Each worker '
        "process writes them before its first claim; a limit an operator set "
        "(`dramatiq-pg-broker queues limit`, the admin API) wins. "
        "See [queue limits](../guides/queue-limits.md).",
        group="Workers",
    )
    events: bool = _setting(
        True,
        "Write job events (the audit trail). Operator actions always write theirs.",
        group="Workers",
    )
    reaper_interval: float = _setting(
        10.0,
        "Seconds between two runs of the expired-lease reaper in each worker process. An "
        "idle process skips a run while its last empty claims report that no lease can "
        "have expired yet. A limited queue's claim does not wait for it: a job whose "
        "lease ran out holds no place.",
        group="Retries and recovery",
    )
    reaper_batch: int = _setting(
        500, "Most expired rows one reaper run handles.", group="Retries and recovery"
    )
    lane_max_moved: int = _setting(
        2_000,
        "Most rows a lane of the jobs table may have left for the workers to empty it in "
        "its turn (copy them to the long lane, then TRUNCATE it; migration 0028). A lane "
        "with more is left to VACUUM for that turn: the copy holds a lock every statement "
        "on jobs waits for. 0: the workers never empty lanes.",
        group="Workers",
    )
    backoff_base_ms: int = _setting(
        15_000,
        "Dramatiq's `min_backoff` for actors and messages that set none: the base of the "
        "exponential retry backoff, in milliseconds.",
        group="Retries and recovery",
    )
    backoff_max_ms: int = _setting(
        7 * 86_400_000,
        "Dramatiq's `max_backoff` for actors and messages that set none: the longest "
        "retry delay, in milliseconds (7 days).",
        group="Retries and recovery",
    )
    max_attempts: int = _setting(
        21,
        "Attempts of a job when neither its actor nor the Retries middleware says "
        "(`max_retries + 1`).",
        group="Retries and recovery",
    )
    max_interruptions: int = _setting(
        10,
        "Interrupted attempts (the worker died, hung or lost its lease) after which the "
        "reaper fails a job. Interruptions are not failures: `max_retries` does not count "
        "them.",
        group="Retries and recovery",
    )
    enqueue_retries: int = _setting(
        3,
        "Retries of a send after a connection error (safe: the message id makes the insert "
        "idempotent).",
        group="Sending",
    )
    durable_sends: bool = _setting(
        True,
        "A send returns once its commit is flushed to the server's WAL. `false`: single "
        "sends commit without waiting for the flush (`synchronous_commit = off` for that "
        "transaction only), faster, and a server crash can lose the last 3 × "
        "`wal_writer_delay` of them. A message's `durable` option wins.",
        group="Sending",
    )
    notify_sends: str = _setting(
        "coalesced",
        "How the broker's own sends (through its pool) wake idle workers. `coalesced`: "
        "the send commits without a NOTIFY, and a thread of the process notifies each "
        "queue filled, at once after a quiet moment, then at most once every 5 ms "
        "(PostgreSQL serializes the commits of transactions that notified: under "
        "concurrent sends, a NOTIFY in each one's commit costs most of their rate). "
        "`statement`: each send notifies in its own statement, at its commit. `off`: no "
        "notification; workers find the jobs at their next poll. A send in the "
        "application's transaction always notifies at that transaction's commit.",
        group="Sending",
    )
    migration_wait_seconds: float = _setting(
        60.0,
        "Seconds a send waits for a running `dramatiq-pg-broker migrate` to apply the "
        "migrations this code needs, instead of raising `MigrationsPending` at once (a "
        "worker waits as long as it takes). `0`: no wait.",
        group="Sending",
    )
    scheduler: bool = _setting(
        True,
        "Run periodic schedules (and retention) in the worker processes.",
        group="Periodic jobs and retention",
    )
    retention: bool = _setting(
        True,
        "Workers delete old finished jobs on the maintenance schedule.",
        group="Periodic jobs and retention",
    )
    retention_interval: float = _setting(
        300.0,
        "Seconds between two retention runs (one run per interval across all worker processes).",
        group="Periodic jobs and retention",
    )
    retention_batch: int = _setting(
        1000,
        "Most rows one retention transaction deletes from a DEFAULT partition of history "
        "(whole days go by dropping their partition).",
        group="Periodic jobs and retention",
    )
    retain_succeeded_days: float = _setting(
        7.0,
        "Days succeeded jobs are kept; `0` keeps them forever. History is partitioned by "
        "UTC day, so a job goes with its day's partition: between this age and one day "
        "more.",
        group="Periodic jobs and retention",
    )
    retain_failed_days: float = _setting(
        30.0,
        "Days failed jobs (the dead letters) are kept; `0` keeps them forever (dropped by "
        "day, as succeeded jobs are).",
        group="Periodic jobs and retention",
    )
    retain_cancelled_days: float = _setting(
        7.0,
        "Days cancelled jobs are kept; `0` keeps them forever (dropped by day, as succeeded "
        "jobs are).",
        group="Periodic jobs and retention",
    )
    history_partitions_ahead: int = _setting(
        7,
        "Days ahead for which each retention run creates the daily partitions of history "
        "and events. Rows of a day without its partition go to a DEFAULT partition, which "
        "retention empties in batches instead of dropping.",
        group="Periodic jobs and retention",
    )
    public_url: str | None = _setting(
        None,
        "The admin API's public base URL (`https://ops.example.com`). Links in responses "
        "(pagination, `Location`) start with it (unset: relative links), and it is the "
        "API's own origin for the CSRF check. Never taken from the request's `Host` header.",
        group="Admin API",
    )
    cors_origins: tuple[str, ...] = _setting(
        (),
        "Comma-separated origins allowed to call the admin API from a browser (CORS with "
        "credentials); none means same-origin only.",
        group="Admin API",
    )
    cookie_secure: bool = _setting(
        False,
        "Mark the admin session cookie Secure: set it whenever the API is served over HTTPS.",
        group="Admin API",
    )
    session_hours: float = _setting(12.0, "Hours an admin session lasts.", group="Admin API")
    trusted_proxies: tuple[str, ...] = _setting(
        (),
        "Comma-separated addresses of reverse proxies in front of the admin API; for a "
        "request from one of them, the client address (for login throttling) is the last "
        "one in `X-Forwarded-For`.",
        group="Admin API",
    )
    statement_timeout: float = _setting(
        5.0,
        "Seconds an admin API query may run before PostgreSQL stops it; the request gets "
        "a 503 that says so.",
        group="Admin API",
    )
    login_concurrency: int = _setting(
        1,
        "Password checks (bcrypt) one admin API process runs at once; more logins wait up "
        "to 2 s, then get a 429.",
        group="Admin API",
    )
    admin_adhoc_actors: bool = _setting(
        False,
        "Let the admin API create jobs for actors no worker has declared (on the queue the "
        "request names, `default` if none). Off: a job is created only for a declared "
        "actor, on that actor's queue, so that nobody can invent actors or queues (and "
        "with them metric labels) through the API.",
        group="Admin API",
    )
    outage_reminder_seconds: float = _setting(
        60.0,
        "Seconds between two reminders while the database stays unreachable: a process "
        "logs one line when an outage starts, a reminder per interval while it lasts and "
        "one line when it ends (see the high-availability guide). One interval per "
        "process: its connection pool's settings set it.",
        group="Logging",
    )
    log_level: str | None = _setting(
        None,
        "Level of the `dramatiq_pg_broker` loggers (`DEBUG`, `INFO`, ...); unset leaves "
        "them as the application configured them.",
        group="Logging",
        shown="(unchanged)",
    )

    def __post_init__(self) -> None:
        if self.url is not None and self.url.strip():
            # Frozen: the one place a field is rewritten, to libpq's spelling of the URL.
            object.__setattr__(self, "url", check_url(self.url))
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
            "outage_reminder_seconds",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be greater than 0")
        if self.migration_wait_seconds < 0:
            raise ConfigurationError("migration_wait_seconds must be 0 or more")
        if self.lane_max_moved < 0:
            raise ConfigurationError("lane_max_moved must be 0 or more")
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
            "history_partitions_ahead",
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
        object.__setattr__(self, "queue_limits", _queue_limits(self.queue_limits))
        if self.enqueue_retries < 0:
            raise ConfigurationError("enqueue_retries must not be negative")
        if self.notify_sends not in NOTIFY_SENDS:
            raise ConfigurationError(
                f"notify_sends {self.notify_sends!r} is not one of {', '.join(NOTIFY_SENDS)}"
            )

    @property
    def connection_budget(self) -> int:
        """The most server connections a worker process of these settings opens, whatever
        its threads and queues: its pool's ``pool_max_size``, plus the process's one
        LISTEN connection unless ``listen`` is off, plus, when its scheduler runs
        retention, the connection a maintenance run holds its turn at the partition steps
        on (for the run's length; the maintenance tick goes to one process of the
        deployment at a time). A results or rate-limiter backend built with ``broker=``
        shares them; one built with its own ``url=`` has a pool of its own (see the tuning
        guide)."""
        maintenance = self.scheduler and self.retention
        return self.pool_max_size + (1 if self.listen else 0) + (1 if maintenance else 0)

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
        data["queue_limits"] = dict(self.queue_limits)
        data["url"] = mask_url(self.url)
        data["heartbeat_seconds"] = self.heartbeat_interval
        data["cors_origins"] = list(self.cors_origins)
        data["trusted_proxies"] = list(self.trusted_proxies)
        return data


@dataclasses.dataclass(frozen=True)
class SettingDoc:
    """One row of the settings reference."""

    #: The keyword argument (the field's name); None for an environment-only variable.
    name: str | None
    #: The environment variable.
    variable: str
    #: The default as the docs show it.
    default: str
    #: What it does (MyST Markdown).
    doc: str
    #: One of :data:`GROUPS`.
    group: str


#: Variables read from the environment only (not :class:`Settings` fields): where the
#: package finds things on the machine it runs on.
ENVIRONMENT_ONLY = (
    SettingDoc(
        None,
        ENV_PREFIX + "MIGRATIONS_DIR",
        "(the package's `migrations/`)",
        "Folder of the migration files `dramatiq-pg-broker migrate` applies.",
        "Database",
    ),
    SettingDoc(
        None,
        ENV_PREFIX + "EMBEDDED_DIR",
        "`.pgdata/data` beside the project's virtualenv",
        "Data directory of the embedded server. Unset: `.pgdata/data` in the folder "
        "holding the running virtualenv when that folder is a project (a `pyproject.toml`, "
        "`setup.cfg`, `setup.py`, `manage.py` or `.git` in it), so that each checkout has "
        "its own server; else `~/.local/share/dramatiq-pg-broker/pgdata` (`$XDG_DATA_HOME` "
        "replaces `~/.local/share` when set).",
        "Database",
    ),
)


def _shown(value: Any) -> str:
    if value is None or value == ():
        return "(none)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def describe() -> list[SettingDoc]:
    """Every setting and environment variable, documented, in :data:`GROUPS` order (fields
    in their declaration order within a group): what the docs' settings table shows."""
    rows = [
        SettingDoc(
            field.name,
            ENV_PREFIX + field.name.upper(),
            field.metadata.get("default") or _shown(field.default),
            field.metadata.get("doc", ""),
            field.metadata.get("group", ""),
        )
        for field in dataclasses.fields(Settings)
    ]
    rows.extend(ENVIRONMENT_ONLY)
    return sorted(rows, key=lambda row: GROUPS.index(row.group) if row.group in GROUPS else 99)


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


def _queue_limits(value: Any) -> tuple[tuple[str, int], ...]:
    """The ``queue_limits`` setting as sorted ``(queue, limit)`` pairs, from a mapping, from
    pairs, or from ``name=N`` strings (the environment variable's comma-separated form).

    Raises:
      ConfigurationError: a pair that is not a queue name and a limit, as
        :mod:`.queue_rules` defines them (the CLI's and the admin API's bounds).
    """
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    items = value.items() if isinstance(value, Mapping) else value
    limits: dict[str, int] = {}
    for item in items:
        if isinstance(item, str):
            name, sep, raw = item.partition("=")
            try:
                limit: Any = int(raw) if sep else None
            except ValueError:
                limit = raw
            pair = (name.strip(), limit)
        else:
            pair = tuple(item)
        if len(pair) != 2:
            raise ConfigurationError(
                f"queue_limits: {item!r} is not a queue name and a limit "
                "(write name=N, e.g. partner_api=5)"
            )
        try:
            limits[check_queue_name(pair[0])] = check_limit(pair[1])
        except (InvalidQueueName, InvalidQueueLimit) as e:
            raise ConfigurationError(
                f"queue_limits: {item!r}: {e} (write name=N, e.g. partner_api=5)"
            ) from None
    return tuple(sorted(limits.items()))
