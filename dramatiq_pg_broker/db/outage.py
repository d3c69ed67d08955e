"""The process's one account of a database outage, for the people reading its log.

Every connection holder of a process (its connection pools, its LISTEN connection, which
the consumers and the results and rate-limiter waiters share) reports here what it sees: a
connection that could not be made, a connection lost, a statement the database answered.
From that, the process logs at WARNING, whatever number of pools and threads it runs:

- one line when the database becomes unreachable, with the error;
- one reminder every :attr:`Outage.reminder_seconds` (a minute unless the
  ``outage_reminder_seconds`` setting says otherwise) while it stays so, with the latest
  error;
- one line when the database answers again, saying how long it was gone;

and nothing per reconnection attempt: the holders log their retries at DEBUG only, and
psycopg_pool's warning per failed attempt of this package's pools is lowered to DEBUG
too (:class:`QuietPoolLogs`).

What counts as an outage:

- a connection attempt that fails, or a server that refuses to write (a standby, or a
  primary made read-only), starts it at once: a worker starting while the database is
  down says so within its first attempt;
- a connection lost on its way (a server shutting down, a terminated backend, a pooler
  that lost its server) starts it only if lost connections go on for
  :data:`GRACE_SECONDS` without a statement succeeding in between: one terminated backend,
  which the next connection replaces, is no outage;
- the first statement the database answers ends it. Its length is counted from the first
  sign of it. A pooled connection's answer from a hot standby ends none (the broker
  cannot write there; the pool tells, see :func:`.core.in_hot_standby`), nor does, for
  :data:`GRACE_SECONDS` after a failed connection attempt, the answer of a pooled
  connection opened before that attempt: a server shutting down refuses new connections
  at once but may still answer a statement or two on a connection it has not closed yet
  (seen on a loaded machine, where the shutdown then read as three outages in 60 ms). A
  connection opened since, or the grace passing (a connection attempt that failed for a
  moment, while the pool's connections kept working), ends it. A refusal to write holds
  back no answer this way: it came over a connection the server accepted, and the
  standby's own answers are already set aside (a pool led back to the primary once ran
  its job within the second after the listener's last refusal, and its end went untold);
- a connection attempt that began before the last outage ended and fails after it starts
  none: it says only that the database was down when the attempt began (on a loaded
  machine, an attempt begun while the server was starting up was refused as "starting up"
  after another connection had already been answered);
- a refusal to write on a pooled connection opened before an earlier refusal (one that
  was in use, or being opened, when the pool replaced its connections) is the same
  failover, not a new outage: it is not counted again.

All three lines are warnings, so that a log filtered at WARNING tells the whole story.
The state belongs to the process: a forked child starts with none of its parent's.

A server that refuses a connection for want of connection slots (``too many clients``,
SQLSTATE 53300, or a pooler out of client connections) is not down: it is saturated, and
the connections already open keep working. Such refusals start no outage and end none;
they are counted, and told in one warning per :data:`SATURATION_NOTICE_SECONDS` with
their number (:meth:`Outage.connect_failed`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator

import psycopg

from .. import forks

logger = logging.getLogger("dramatiq_pg_broker.outage")

#: Seconds between two reminders while the database stays unreachable, unless the
#: ``outage_reminder_seconds`` setting says otherwise.
REMINDER_SECONDS = 60.0

#: How long connections must keep being lost, with no statement succeeding, before that
#: counts as an outage (a failed connection attempt counts at once).
GRACE_SECONDS = 1.0


#: Seconds between two warnings about connections refused for want of slots.
SATURATION_NOTICE_SECONDS = 60.0

#: The SQLSTATE of a connection refused for want of slots (``too_many_connections``).
TOO_MANY_CONNECTIONS = "53300"
#: What the server (or PgBouncer) says when it refuses a connection for want of slots; a
#: refused connection attempt carries no SQLSTATE in libpq, only this text.
_SATURATION_RE = re.compile(
    r"too many clients|too many connections|remaining connection slots are reserved"
    r"|no more connections allowed",
    re.IGNORECASE,
)


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors behind it: Dramatiq's connection errors hold the driver's
    error as their argument, and this package raises them from it."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        cause = pending.pop()
        if id(cause) in seen:
            continue
        seen.add(id(cause))
        yield cause
        pending.extend(e for e in (cause.__cause__, *cause.args) if isinstance(e, BaseException))


def is_saturation(error: BaseException) -> bool:
    """Whether ``error`` (or the driver error behind it) is a connection refused because
    the server, or a pooler in front of it, has no free connection slot."""
    return any(
        getattr(cause, "sqlstate", None) == TOO_MANY_CONNECTIONS
        or (isinstance(cause, psycopg.Error) and _SATURATION_RE.search(str(cause)))
        for cause in _causes(error)
    )


def refuses_to_write(error: BaseException) -> bool:
    """Whether ``error`` (or the driver error behind it) is a server refusing to write
    (``ReadOnlySqlTransaction``: a standby, or a primary made read-only)."""
    return any(isinstance(c, psycopg.errors.ReadOnlySqlTransaction) for c in _causes(error))


def describe(error: BaseException) -> str:
    """The driver's error behind ``error`` (a Dramatiq connection error keeps it as its
    cause), on one line: libpq's messages span several."""
    cause = error
    while not isinstance(cause, psycopg.Error) and cause.__cause__ is not None:
        cause = cause.__cause__
    if not isinstance(cause, psycopg.Error):
        cause = error
    text = " ".join(part.strip() for part in str(cause).splitlines() if part.strip())
    return text or type(cause).__name__


def duration(seconds: float) -> str:
    """``4.2s``, ``3m05s``, ``2h01m``: an outage's length as a person reads it."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Outage:
    """Whether this process's database is unreachable, and the log lines that say so. See
    the module docstring; one instance per process (:data:`tracker`).

    Parameters:
      clock(callable): monotonic seconds (tests pass their own).
      reminder_seconds(float): seconds between two reminders while an outage lasts. The
        process's connection pool sets it from its settings (``outage_reminder_seconds``),
        so that the interval is one setting like the others rather than a constant.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        reminder_seconds: float = REMINDER_SECONDS,
    ) -> None:
        self._clock = clock
        self.reminder_seconds = reminder_seconds
        self._lock = threading.Lock()
        self._pid = forks.pid()
        #: Monotonic time of the first sign of trouble; None while all is well.
        self._since: float | None = None
        #: Whether the outage was announced (and its end must be).
        self._announced = False
        #: Monotonic time of the latest failed connection attempt (not for want of slots).
        self._connect_failed_at = -math.inf
        #: Monotonic time at which the last outage (announced or not) ended.
        self._ended_at = -math.inf
        self._last_notice = 0.0
        #: Connections refused for want of slots since the last saturation warning.
        self._refused = 0
        #: Monotonic time of the last saturation warning; None before the first.
        self._saturation_notice: float | None = None

    @property
    def unreachable(self) -> bool:
        """Whether an outage was announced and has not ended."""
        return self._announced and self._pid == forks.pid()

    @property
    def troubled(self) -> bool:
        """Whether trouble was seen that no answer has ended yet (announced or not). A
        plain read, cheap enough for every statement."""
        return self._since is not None

    def connect_failed(self, error: BaseException, began_at: float | None = None) -> None:
        """A connection attempt that began at ``began_at`` (monotonic seconds; None: not
        known) failed, or the server refused to write. A refusal for want of connection
        slots is saturation, not an outage (see :meth:`saturated`); an attempt that began
        before the last outage ended tells nothing new."""
        if is_saturation(error):
            self.saturated(error)
            return
        if began_at is not None and began_at <= self._ended_at:
            return
        if not refuses_to_write(error):
            # A refusal to write came over a connection that was made: the server is up
            # (a standby), and the pooled connections' answers from a standby end nothing
            # anyway. Only a failed attempt holds back older connections' answers.
            self._connect_failed_at = self._clock()
        self._failed(error, at_once=True)

    def saturated(self, error: BaseException) -> None:
        """The server refused a connection for want of slots: counted, and told at most once
        per :data:`SATURATION_NOTICE_SECONDS`, with the number refused since the last
        warning. The outage state is left as it is."""
        now = self._clock()
        with self._lock:
            self._check_fork()
            self._refused += 1
            last = self._saturation_notice
            if last is not None and now - last < SATURATION_NOTICE_SECONDS:
                return
            refused, self._refused = self._refused, 0
            self._saturation_notice = now
        if last is None:
            logger.warning(
                "The database refused a connection: it has no free connection slot (%s). "
                "It is saturated, not down: this process goes on with the connections it "
                "has and retries quietly (a line every %s while refusals go on). Raise the "
                "server's max_connections, or lower the processes' pool_max_size, or put "
                "PgBouncer in front.",
                describe(error),
                duration(SATURATION_NOTICE_SECONDS),
            )
        else:
            logger.warning(
                "The database refused %d more connection(s) for want of connection slots "
                "in the last %s: %s",
                refused,
                duration(now - last),
                describe(error),
            )

    def connection_lost(self, error: BaseException) -> None:
        """An established connection broke."""
        self._failed(error, at_once=False)

    def answered(self, opened_at: float | None = None) -> None:
        """The database answered a statement, on a connection whose opening began at
        ``opened_at`` (monotonic seconds; None: not known). Cheap while all is well (the
        claim path calls it for every statement). An answer on a connection opened before
        the latest failed connection attempt ends nothing within :data:`GRACE_SECONDS` of
        that attempt (see the module docstring)."""
        if self._since is None:
            return
        now = self._clock()
        failed_at = self._connect_failed_at
        if opened_at is not None and opened_at <= failed_at and now - failed_at < GRACE_SECONDS:
            return
        with self._lock:
            self._check_fork()
            since, announced = self._since, self._announced
            self._since, self._announced = None, False
            if since is not None:
                self._ended_at = now
        if since is not None and announced:
            logger.warning(
                "The database is reachable again; it was unreachable for %s.",
                duration(now - since),
            )

    def _failed(self, error: BaseException, *, at_once: bool) -> None:
        now = self._clock()
        with self._lock:
            self._check_fork()
            if self._since is None:
                self._since = now
            since = self._since
            if not self._announced:
                if not at_once and now - since < GRACE_SECONDS:
                    return
                self._announced = True
                self._last_notice = now
                reminder = False
            elif now - self._last_notice >= self.reminder_seconds:
                self._last_notice = now
                reminder = True
            else:
                return
        if reminder:
            logger.warning(
                "The database is still unreachable, for %s now: %s",
                duration(now - since),
                describe(error),
            )
        else:
            logger.warning(
                "The database is unreachable (retrying quietly: a reminder every %s while "
                "it lasts, a line when it is back): %s",
                duration(self.reminder_seconds),
                describe(error),
            )

    def _check_fork(self) -> None:
        """Called with the lock held: a forked child forgets its parent's outage."""
        if self._pid != forks.pid():
            self._pid = forks.pid()
            self._since = None
            self._announced = False
            self._connect_failed_at = -math.inf
            self._ended_at = -math.inf
            self._refused = 0
            self._saturation_notice = None


#: The process's outage state.
tracker = Outage()


# -- psycopg_pool's own log lines --------------------------------------------------------

#: psycopg_pool's warnings that repeat for every failed attempt or broken connection.
POOL_NOISE = frozenset(
    {
        "error connecting in %r: %s",
        "reconnection attempt in pool %r failed after %s sec",
        "discarding broken connection: %s",
        "discarding closed connection: %s",
    }
)

_quiet = threading.local()


@contextlib.contextmanager
def quiet_pool() -> Iterator[None]:
    """Within the block, this thread's psycopg_pool warnings in :data:`POOL_NOISE` are
    lowered to DEBUG (the pool calls made for this package's pools)."""
    depth = getattr(_quiet, "depth", 0)
    _quiet.depth = depth + 1
    try:
        yield
    finally:
        _quiet.depth = depth


class QuietPoolLogs(logging.Filter):
    """Lowers psycopg_pool's per-attempt warnings about this package's pools to DEBUG
    (dropped unless the ``psycopg.pool`` logger shows DEBUG): the process's outage lines
    tell the story once. A pool's own thread names start with its name; other calls are
    marked by :func:`quiet_pool`. Other pools of the application are left alone.

    Parameters:
      prefix(str): the names of this package's pools start with it.
    """

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.msg not in POOL_NOISE:
            return True
        if not self._ours(record):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True

    def _ours(self, record: logging.LogRecord) -> bool:
        if getattr(_quiet, "depth", 0):
            return True
        if threading.current_thread().name.startswith(self.prefix):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        return bool(args) and isinstance(args[0], str) and args[0].startswith(self.prefix)


_filter_lock = threading.Lock()


def quiet_pool_logs(prefix: str) -> None:
    """Install :class:`QuietPoolLogs` for pools named ``prefix...`` on psycopg_pool's
    logger (once)."""
    pool_logger = logging.getLogger("psycopg.pool")
    with _filter_lock:
        if not any(
            isinstance(f, QuietPoolLogs) and f.prefix == prefix for f in pool_logger.filters
        ):
            pool_logger.addFilter(QuietPoolLogs(prefix))
