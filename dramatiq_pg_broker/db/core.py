"""Connections: the per-process pool, named SQL, and the one place driver errors are
translated into Dramatiq's connection errors."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

import psycopg
from dramatiq.errors import ConnectionClosed, ConnectionFailed
from psycopg.pq import TransactionStatus

try:  # Dramatiq 2.2 renamed ConnectionError (the old name warns, and goes in 3.0)
    from dramatiq.errors import BrokerConnectionError
except ImportError:  # pragma: no cover - Dramatiq before 2.2
    from dramatiq.errors import ConnectionError as BrokerConnectionError
from psycopg_pool import ConnectionPool, PoolTimeout
from psycopg_pool.base import AttemptWithBackoff
from psycopg_pool.pool import AddConnection

from .. import forks
from ..config import Settings
from ..errors import ConfigurationError, SchemaMissing
from . import outage

logger = logging.getLogger("dramatiq_pg_broker.db")

#: The longest wait between two reconnection tries of the pool.
RECONNECT_CAP_SECONDS = 0.5


def resolve_url(settings: Settings, *, allow_embedded: bool = True) -> str:
    """Return the database URL, starting the embedded PostgreSQL when none is configured.

    Raises:
      ConfigurationError: no URL is configured and the embedded server is not allowed.
    """
    if settings.url:
        return settings.url
    if not allow_embedded:
        raise ConfigurationError(
            "no database configured: set DRAMATIQ_PG_URL (or pass url=) to a PostgreSQL URL"
        )
    from .embedded import embedded_url

    return embedded_url()


#: What the package's connections call themselves in ``pg_stat_activity``, followed by
#: ``/`` and the process id, unless the URL sets an ``application_name`` (libpq's
#: ``fallback_application_name``): so an operator, ``dramatiq-pg-broker doctor`` and the
#: tests can tell them, and each process's, apart.
APPLICATION = "dramatiq-pg-broker"


def application_name(application: str = APPLICATION) -> str:
    """This process's ``application_name``: ``dramatiq-pg-broker/<pid>``."""
    return f"{application}/{forks.pid()}"


def connect(url: str, **kwargs) -> psycopg.Connection:
    """Open one autocommit connection named as the process's (:func:`application_name`),
    translating failures (a failure counts towards the process's outage, see
    :mod:`.outage`)."""
    kwargs.setdefault("fallback_application_name", application_name())
    with translate_errors():
        began = time.monotonic()
        try:
            return psycopg.connect(url, autocommit=True, **kwargs)
        except psycopg.Error as e:
            outage.tracker.connect_failed(e, began)
            raise


def connection_kwargs(settings: Settings, application: str = APPLICATION) -> dict:
    """psycopg connection options for the broker's pooled connections: autocommit, the
    process's name (:func:`application_name`), and no server-side prepared statements
    where a transaction-mode pooler would break them."""
    kwargs: dict = {"autocommit": True, "fallback_application_name": application_name(application)}
    if not settings.prepared_statements:
        kwargs["prepare_threshold"] = None
    return kwargs


def in_hot_standby(conn: psycopg.Connection) -> bool:
    """Whether the server of ``conn`` is a hot standby (in recovery), as the server last
    reported it (PostgreSQL 14 and later report ``in_hot_standby`` at the start and on each
    change, a promotion included): no round trip. False when it is not reported, or the
    connection is closed."""
    try:
        return conn.pgconn.parameter_status(b"in_hot_standby") == b"on"
    except psycopg.Error:
        return False


#: SQLSTATEs that mean the session is gone: the server shut down, crashed or is starting.
_SESSION_LOST = {"57P01", "57P02", "57P03"}


def is_connection_error(error: psycopg.Error) -> bool:
    """Whether a psycopg error means the connection is lost or could not be made (class
    08, a server shutdown, or an error raised by the client with no SQLSTATE), rather than
    an error the server reported on a working connection."""
    if isinstance(error, psycopg.InterfaceError):
        return True
    state = getattr(error, "sqlstate", None)
    if state is None:
        return isinstance(error, psycopg.OperationalError)
    return state.startswith("08") or state in _SESSION_LOST


class CappedAttempt(AttemptWithBackoff):
    """psycopg_pool's reconnection backoff, with the wait between two tries capped, so that
    a pool resumes within about a second of the server's return however long it was gone
    (the stock delay doubles without a bound)."""

    INITIAL_DELAY = 0.1

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, RECONNECT_CAP_SECONDS)


#: The names of this package's pools start with it (their log lines are told apart by it).
POOL_NAME_PREFIX = "dramatiq-pg-broker-"


def opening_began(conn: psycopg.Connection) -> float | None:
    """Monotonic time at which a :class:`ReconnectingPool` began to open ``conn``; None
    for a connection of another pool."""
    return getattr(conn, "_dpb_opening_began", None)


class ReconnectingPool(ConnectionPool):
    """A psycopg ConnectionPool whose reconnection attempts are at most
    :data:`RECONNECT_CAP_SECONDS` apart, and whose failed attempts count towards the
    process's outage (:mod:`.outage`) instead of each logging a warning of its own.

    When one of its connections meets a server that refuses to write (:meth:`refused`),
    every connection whose opening began before that moment is replaced before it is
    handed out again: the idle ones at once, the ones in use or still being opened when
    they come to the pool. They were all led to where the name pointed then (a standby,
    say), and would each refuse in turn after the name moved.
    """

    def __init__(self, *args, **kwargs) -> None:
        outage.quiet_pool_logs(POOL_NAME_PREFIX)
        #: Monotonic time of the last refusal to write met by a connection of the pool.
        self.refused_at = -math.inf
        super().__init__(*args, **kwargs)

    def _connect(self, timeout: float | None = None) -> psycopg.Connection:
        began = time.monotonic()
        try:
            conn = super()._connect(timeout)
        except psycopg.Error as e:
            outage.tracker.connect_failed(e, began)
            raise
        conn._dpb_opening_began = began
        return conn

    def opened_before_refusal(self, conn: psycopg.Connection) -> bool:
        """Whether the opening of ``conn`` began before the pool's last refusal to write."""
        began = opening_began(conn)
        return began is not None and began <= self.refused_at

    def refused(self, conn: psycopg.Connection) -> bool:
        """``conn``, one of the pool's, met a server that refuses to write: close it, and
        replace every connection opened before now (see the class docstring).

        Returns whether ``conn`` itself was opened before an earlier refusal: its refusal
        then tells nothing new (that refusal was told), even if the database answered in
        between on the connections that replaced it.
        """
        echo = self.opened_before_refusal(conn)
        self.refused_at = time.monotonic()
        conn.close()
        with self._lock:
            idle = list(self._pool)
            self._pool.clear()
        for stale in idle:
            self._close_connection(stale)
            self.run_task(AddConnection(self))
        return echo

    def _add_to_pool(self, conn: psycopg.Connection) -> None:
        # A new connection whose opening began before a refusal, or one given back that
        # was taken before it: replaced, not kept (no statement needed, so the normal case
        # costs no round trip).
        if not self._closed and self.opened_before_refusal(conn):
            self._close_connection(conn)
            self.run_task(AddConnection(self))
            return
        super()._add_to_pool(conn)

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        if attempt is None:
            attempt = CappedAttempt(timeout=self.reconnect_timeout)
        with outage.quiet_pool():
            super()._add_connection(attempt, growing)

    def check(self) -> None:
        with outage.quiet_pool():
            super().check()

    def putconn(self, conn: psycopg.Connection) -> None:
        with outage.quiet_pool():
            super().putconn(conn)


def read_committed_session(conn: psycopg.Connection, settings: Settings) -> None:
    """Make READ COMMITTED the default of the broker's own pooled connection ``conn`` when
    the server's default is another level: one SHOW per new connection, and a SET when it
    differs. Every statement the broker runs on its pool (claims, heartbeats, outcomes, the
    reaper, an operator's transitions) is written for READ COMMITTED, where a statement
    that waited for a lock takes its snapshot after the wait: at REPEATABLE READ a
    statement that met the emptying of a lane of jobs (0028) would see the lane empty and
    miss the job's row. Not behind a transaction-mode pooler (``prepared_statements``
    off): a SET there would change the server sessions the pooler hands to other clients;
    the tuning guide says what to do then."""
    if not settings.prepared_statements:
        return
    level = conn.execute("SHOW default_transaction_isolation").fetchone()[0]
    if level != "read committed":
        conn.execute("SET default_transaction_isolation TO 'read committed'")


def read_committed(conn: psycopg.Connection) -> psycopg.Connection:
    """``conn``, whose next transaction begins READ COMMITTED (its ``BEGIN`` says so: no
    round trip) whatever the server's ``default_transaction_isolation``, unless a
    transaction is already open on it (the caller's, left as it is). For the broker's own
    transactions that lock a row and then read what the holder they waited for committed
    (a limited claim's room, a workflow's steps at its abort): at REPEATABLE READ or
    SERIALIZABLE their snapshot would be taken before the wait."""
    if conn.info.transaction_status == TransactionStatus.IDLE:
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    return conn


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Turn psycopg's connection failures into Dramatiq's connection errors.

    Dramatiq's worker knows how to survive ``ConnectionError``s (it restarts the consumer
    and retries acks), so they are the only errors a lost server may surface as. The
    original error is kept as ``__cause__``, and counts towards the process's outage
    (:mod:`.outage`).

    A server that refuses to write (``ReadOnlySqlTransaction``: a standby that a
    connection reached before the failover finished, through a virtual IP or DNS name not
    yet moved, or a primary made read-only) is, for the broker, a server it cannot use:
    it surfaces as a lost connection too, and the caller retries on a new one.
    """
    try:
        yield
    except psycopg.errors.ReadOnlySqlTransaction as e:
        outage.tracker.connect_failed(e)
        raise ConnectionClosed(e) from e
    except psycopg.errors.UndefinedTable as e:
        raise SchemaMissing(
            f"{e.diag.message_primary}: the broker's tables are missing; run "
            "`dramatiq-pg-broker migrate` with the same DRAMATIQ_PG_URL and DRAMATIQ_PG_SCHEMA"
        ) from e
    except psycopg.OperationalError as e:
        if not is_connection_error(e):
            # A deadlock, a cancelled statement, a lock timeout...: the database answered.
            # Reporting it as a lost connection would make callers wait for a server that
            # is there, and hide the real error.
            raise
        # The server went away mid-statement, or could not be reached at all. (A pool
        # timeout says only that no connection came: the pool reports its own failures.)
        if not isinstance(e, PoolTimeout):
            outage.tracker.connection_lost(e)
        raise ConnectionClosed(e) from e
    except psycopg.InterfaceError as e:
        # The connection object was already closed (e.g. a broken pooled connection).
        outage.tracker.connection_lost(e)
        raise ConnectionClosed(e) from e
    except psycopg.errors.AdminShutdown as e:  # pragma: no cover - a subclass of the above
        raise ConnectionClosed(e) from e
    except OSError as e:
        outage.tracker.connection_lost(e)
        raise ConnectionFailed(e) from e


class ProcessPool:
    """A connection pool that opens on first use, once per process.

    The ``dramatiq`` CLI forks its worker processes after importing the broker module, so a
    pool opened in the parent must never be used in a child: the pool remembers its
    process id and a child opens its own.

    The first connection a process takes from it runs the schema handshake
    (:mod:`.handshake`) before handing one over: every kind of process passes here before
    its first statement, so this is the one place the check lives.

    While a ``dramatiq-pg-broker migrate`` runs (it holds the schema's migration lock) and
    is to apply migrations this code needs, the handshake waits for it up to
    ``migration_wait`` seconds instead of refusing at once: the broker gives its sends
    ``settings.migration_wait_seconds``; other users (the CLI, the admin API) wait for
    nothing. One thread of the process waits on one connection (the release wakes it);
    the others wait for that thread without holding a connection.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        pool: ConnectionPool | None = None,
        configure: Callable[[psycopg.Connection], None] | None = None,
        migration_wait: float = 0.0,
        application: str = APPLICATION,
    ) -> None:
        self.settings = settings
        #: What its connections are called, before ``/<pid>`` (see :func:`application_name`).
        self.application = application
        # The process's outage lines remind at the interval its settings ask for (one
        # tracker per process: every pool of a process normally has the same settings).
        outage.tracker.reminder_seconds = settings.outage_reminder_seconds
        #: Seconds the handshake waits for a running migration (see the class docstring).
        self.migration_wait = migration_wait
        self._migration_waiter = threading.Lock()
        #: Called with each new connection of the pool (psycopg_pool's ``configure``).
        self.configure = configure
        self._given = pool
        self._pools: forks.PerProcess[ConnectionPool] = (
            forks.PerProcess(self._open) if pool is None else forks.PerProcess(self._open, pool)
        )
        self._url: str | None = None
        #: Builds the URL on first use when the settings name none, instead of the embedded
        #: server: the Django integration reads the project's DATABASES then.
        self.conninfo: Callable[[], str] | None = None
        #: The pool (one per process) whose connections passed the schema handshake.
        self._checked: ConnectionPool | None = None
        #: What the handshake read (:class:`~.handshake.SchemaState`), once it passed.
        self.schema_state = None

    @property
    def url(self) -> str:
        if self._url is None:
            if self._given is not None and not self.settings.url:
                # Dedicated connections (LISTEN) go where the given pool goes.
                self._url = self._given.conninfo
            elif not self.settings.url and self.conninfo is not None:
                self._url = self.conninfo()
            else:
                self._url = resolve_url(self.settings)
        return self._url

    def get(self) -> ConnectionPool:
        return self._pools.get()

    def _configure(self, conn: psycopg.Connection) -> None:
        """Each new pooled connection: READ COMMITTED by default (see
        :func:`read_committed_session`), then the caller's ``configure``."""
        read_committed_session(conn, self.settings)
        if self.configure is not None:
            self.configure(conn)

    def _open(self) -> ConnectionPool:
        if self._given is not None:
            logger.warning("A pool passed to the broker is used after a fork.")
        pool = ReconnectingPool(
            self.url,
            min_size=self.settings.pool_min_size,
            max_size=self.settings.pool_max_size,
            kwargs=connection_kwargs(self.settings, self.application),
            configure=self._configure,
            name=f"{POOL_NAME_PREFIX}{forks.pid()}",
            open=False,
            timeout=self.settings.pool_timeout,
        )
        with translate_errors():
            pool.open(wait=False)
        return pool

    @contextlib.contextmanager
    def connection(self, *, wait_for_migration: bool = True) -> Iterator[psycopg.Connection]:
        """Borrow an autocommit connection; connection errors become Dramatiq's. A block
        that ends without one tells the process's outage tracker that the database
        answered (:mod:`.outage`).

        Parameters:
          wait_for_migration(bool): False: a handshake that finds migrations pending
            refuses at once, even while a migration runs (the worker's gate waits its own
            way).
        """
        pool = self.get()
        try:
            with translate_errors():
                if self._checked is not pool:
                    self._handshake(pool, wait_for_migration)
                with pool.connection() as conn:
                    try:
                        yield conn
                    except psycopg.errors.ReadOnlySqlTransaction as e:
                        # A server that refuses to write (a standby reached through a
                        # virtual IP or DNS name that a failover has not moved yet): every
                        # connection of the pool may be there. Replace them all; new ones
                        # go where the name points now.
                        if isinstance(pool, ReconnectingPool):
                            if pool.refused(conn):
                                # Opened before an earlier refusal, which was told: the
                                # same failover, not a new outage.
                                raise ConnectionClosed(e) from e
                            raise
                        conn.close()
                        drain = getattr(pool, "drain", None)  # psycopg_pool 3.3
                        if drain is not None:
                            drain()
                        raise
                    # During an outage, a standby that answered a read ends nothing: the
                    # broker cannot write there (no statement asked: the server says it).
                    standby = outage.tracker.troubled and in_hot_standby(conn)
        except (ConnectionClosed, ConnectionFailed):
            # A server that dropped one connection (restart, failover, terminated backends)
            # has usually dropped every idle one too, and the pool would hand them out one
            # by one, each failing a caller's bounded retry. Check them all now instead.
            self._discard_broken(pool)
            raise
        if not standby:
            outage.tracker.answered(opening_began(conn))

    def _handshake(self, pool: ConnectionPool, wait_for_migration: bool) -> None:
        from ..errors import MigrationsPending
        from .handshake import check, running_migration

        schema = self.settings.schema
        with pool.connection() as conn:
            try:
                self.schema_state = check(conn, schema)
                self._checked = pool
                return
            except MigrationsPending:
                if not wait_for_migration or self.migration_wait <= 0:
                    raise
                if running_migration(conn, schema) is None:
                    raise
        self._wait_for_migration(pool)

    def _wait_for_migration(self, pool: ConnectionPool) -> None:
        """Wait for the running migration, then pass the handshake; at most
        :attr:`migration_wait` seconds."""
        from ..errors import MigrationsPending
        from .handshake import check, running_migration, wait_for_migration_lock, waited_message

        schema = self.settings.schema
        deadline = time.monotonic() + self.migration_wait
        if not self._migration_waiter.acquire(timeout=self.migration_wait):
            # Another thread of this process waited all that time on our behalf.
            if self._checked is pool:
                return
            with pool.connection() as conn:
                return self._recheck(conn, pool)
        try:
            said = False
            while True:
                if self._checked is pool:
                    return
                with pool.connection() as conn:
                    try:
                        self.schema_state = check(conn, schema)
                        self._checked = pool
                        if said:
                            logger.info("The migration finished: sends proceed.")
                        return
                    except MigrationsPending as e:
                        refusal = e
                    run = running_migration(conn, schema)
                    if run is None:
                        # The migration ended without applying what this code needs (it
                        # failed, or was another release's): the refusal stands.
                        raise refusal
                    remaining = deadline - time.monotonic()
                    if not said:
                        logger.warning(
                            "Sends wait up to %.3g s for %s to apply the migrations this "
                            "code needs: %s.",
                            max(remaining, 0.0),
                            run.describe(),
                            refusal,
                        )
                        said = True
                    if remaining <= 0 or not wait_for_migration_lock(conn, schema, remaining):
                        raise MigrationsPending(
                            waited_message(refusal, self.migration_wait, run)
                        ) from None
        finally:
            self._migration_waiter.release()

    def _recheck(self, conn: psycopg.Connection, pool: ConnectionPool) -> None:
        """The handshake once more, after a wait; a refusal says that it waited."""
        from ..errors import MigrationsPending
        from .handshake import check, running_migration, waited_message

        schema = self.settings.schema
        try:
            self.schema_state = check(conn, schema)
        except MigrationsPending as e:
            run = running_migration(conn, schema)
            if run is None:
                raise
            raise MigrationsPending(waited_message(e, self.migration_wait, run)) from None
        self._checked = pool

    @property
    def handshake_passed(self) -> bool:
        """Whether this process passed the schema handshake."""
        checked = self._checked
        return checked is not None and checked is self._pools.peek()

    def check_schema(self, *, wait_for_migration: bool = True) -> None:
        """Run the schema handshake now, unless this process passed it already (see
        :meth:`connection` for ``wait_for_migration``).

        Raises:
          SchemaVersionError: this code does not fit the schema (see :mod:`.handshake`).
          dramatiq.errors.ConnectionError: the database cannot be reached.
        """
        if not self.handshake_passed:
            with self.connection(wait_for_migration=wait_for_migration):
                pass

    @contextlib.contextmanager
    def use(self, conn: psycopg.Connection | None = None) -> Iterator[psycopg.Connection]:
        """The connection a caller handed in (its own transaction, say), or a pooled one;
        either way connection errors become Dramatiq's. The handshake runs on a pooled
        connection, never in the caller's transaction."""
        if conn is not None:
            self.check_schema()
            with translate_errors():
                yield conn
        else:
            with self.connection() as pooled:
                yield pooled

    @staticmethod
    def _discard_broken(pool: ConnectionPool) -> None:
        try:
            pool.check()
        except Exception as e:  # the original error is what the caller must see
            logger.debug("Checking the pooled connections failed: %s", e)

    def close(self) -> None:
        """Close this process's pool (a pool passed in is left open: its owner closes it).
        The next use opens a new one."""
        pool = self._pools.peek()
        if pool is not None and pool is not self._given:
            pool.close()
            self._pools.clear()


def backend_connections(
    *,
    url: str | None,
    schema: str | None,
    pool: ConnectionPool | None,
    broker: object | None,
    listen: bool | None,
) -> tuple[ProcessPool, Settings]:
    """Where a results or rate-limiter backend gets its connections: the broker's pool and
    schema when a :class:`~dramatiq_pg_broker.PostgresBroker` is given (keyword arguments
    still win for the schema), else its own pool from ``url``/``schema`` or the
    ``DRAMATIQ_PG_*`` settings.

    Raises:
      ConfigurationError: ``broker`` is not a PostgresBroker, or a URL or pool is given
        together with it.
    """
    if broker is not None:
        broker_pool = getattr(broker, "pool", None)
        broker_settings = getattr(broker, "settings", None)
        if not isinstance(broker_pool, ProcessPool) or not isinstance(broker_settings, Settings):
            raise ConfigurationError(
                "broker= must be a PostgresBroker; for another broker pass url= (and schema=)"
            )
        if url is not None or pool is not None:
            raise ConfigurationError("give broker= or url=/pool=, not both")
        import dataclasses

        settings = dataclasses.replace(
            broker_settings,
            **{k: v for k, v in {"schema": schema, "listen": listen}.items() if v is not None},
        )
        return broker_pool, settings
    settings = Settings.load(url=url, schema=schema, listen=listen)
    return ProcessPool(settings, pool=pool), settings


class Reclaimer:
    """Opportunistic, bounded deletion of expired rows by the processes that write them, so a
    table with expiring rows stays bounded without a retention job.

    :meth:`maybe_run` (called after a write) runs ``prune(batch)`` at most once every
    ``interval`` seconds, or at every call while passes come back full (expiries outpacing
    the interval). Never two passes at once in one process; a failed pass is logged, not
    raised, since the write it follows has succeeded: at debug level when the server was
    lost (the outage is told once by :mod:`.outage`), as a warning otherwise.
    """

    def __init__(self, prune, *, batch: int, interval: float, what: str) -> None:
        if batch < 1 or interval <= 0:
            raise ConfigurationError("prune_batch must be at least 1 and prune_interval above 0")
        self._prune = prune
        self.batch = batch
        self.interval = interval
        self._what = what
        self._lock = threading.Lock()
        #: Monotonic time before which :meth:`maybe_run` runs no pass. Set by each pass;
        #: a test sets it to ``math.inf`` (no pass at all) or 0 (a pass at the next call).
        self.next_run = 0.0

    def maybe_run(self) -> None:
        now = time.monotonic()
        if now < self.next_run or not self._lock.acquire(blocking=False):
            return
        try:
            deleted = self._prune(self.batch)
            self.next_run = now if deleted >= self.batch else now + self.interval
        except Exception as e:
            self.next_run = now + self.interval
            if isinstance(e, BrokerConnectionError) or (
                isinstance(e, psycopg.Error) and is_connection_error(e)
            ):
                # A lost server: the process's outage lines tell it, once (outage.py), not
                # each opportunistic pass that met it.
                logger.debug("Reclaiming expired %s failed: %s", self._what, e)
            else:
                logger.warning("Reclaiming expired %s failed: %s", self._what, e)
        finally:
            self._lock.release()
