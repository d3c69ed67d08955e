"""The job state machine: one method per transition, all SQL behind it.

The broker, the consumer, the heartbeat, the reaper and the admin API all change jobs only
through :class:`JobStore`. Transitions out of ``running`` take :class:`Attempt` references
(job id, lease owner, attempt number) and return the ids they changed: an id missing from
the result means the caller no longer owns that attempt (its lease expired and another
worker claimed the job), never an exception.

::

    queued  -> running      claim
    running -> succeeded    complete
    running -> running      start (the claimed message's actor is about to run)
    running -> queued       reschedule (retry), reap (lease expired), release (shutdown)
    running -> failed       fail, or reap with interruptions exhausted
    failed  -> queued       retry_failed (operator)
    queued  -> cancelled    cancel (operator), abort (operator)
    running -> running      abort (operator): the attempt is marked, its worker stops it
    running -> cancelled    abort_attempts (the worker stopped an aborted attempt), or
                            reschedule / reap of an attempt whose abort was requested
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import hashlib
import json
import math
import struct
import uuid
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg.copy import LibpqWriter
from psycopg.types.json import Jsonb

from ..db.core import ProcessPool, Queries
from ..errors import (
    AmbiguousJobId,
    DuplicateJobId,
    InvalidJobId,
    InvalidTransition,
    JobAlreadyFinished,
    JobNotFound,
)
from ..history.probe import HistoryProbe


class Attempt(NamedTuple):
    """One claimed attempt of a job: what every guarded transition must match."""

    id: str
    owner: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class ClaimedJob:
    """A job row just claimed, with what the consumer needs to rebuild the message."""

    id: str
    priority: int
    attempts: int
    max_attempts: int
    message: dict[str, Any] | None
    message_bytes: bytes | None
    #: Earlier attempts of this job that failed (exception or time limit).
    failures: int = 0
    #: Earlier claims of this job whose lease expired before a start was recorded.
    abandoned_claims: int = 0
    #: An operator asked for this job's abort (a worker of the previous release requeued
    #: it anyway): it must be cancelled, not run.
    abort_requested: bool = False


@dataclasses.dataclass(frozen=True)
class Claim:
    """What one claim statement returned: the jobs claimed or, when there were none, when
    the queue's earliest waiting job becomes runnable."""

    jobs: list[ClaimedJob]
    #: None unless nothing was claimed and a job waits: its available_at (server clock).
    next_available_at: dt.datetime | None = None
    #: Seconds, by the server's clock, until then (0 or less: runnable now).
    seconds_until_available: float | None = None
    #: None unless nothing was claimed: seconds until the earliest lease of any running job
    #: (any queue, any worker) expires (0 or less: one has expired; ``math.inf``: no job
    #: runs). The reaper has nothing to do before then (:meth:`.LeaseKeeper.leases_report`).
    lease_seconds_left: float | None = None
    #: True when nothing was claimed because an operator paused the queue (no wait is
    #: reported then: nothing there becomes runnable by itself).
    paused: bool = False
    #: The queue's limit as a limited claim read it (:meth:`JobStore.claim_limited`; None:
    #: no limit, or a plain claim).
    queue_limit: int | None = None
    #: True when a limited claim found the queue at its limit and claimed nothing.
    at_limit: bool = False


# Not frozen: a frozen dataclass's __init__ costs three times as much, which a bulk enqueue
# of 100,000 messages pays 100,000 times. Nothing changes a NewJob once built.
@dataclasses.dataclass(slots=True)
class NewJob:
    """What :meth:`JobStore.enqueue` stores: one encoded message and its scheduling.

    Build it with :func:`dramatiq_pg_broker.messages.job_from_message`, which validates
    and encodes. ``message_bytes`` is what workers decode; ``message`` is the jsonb view
    for display (or, with ``message_view_from_bytes``, the server parses the bytes into
    it). A job with only ``message`` is an older row's form, still readable.
    """

    id: str
    queue_name: str
    actor_name: str
    message: Any = None
    message_bytes: bytes | None = None
    priority: int = 0
    delay_ms: int = 0
    #: The limit :func:`~dramatiq_pg_broker.messages.max_attempts_for` derives: required,
    #: so that every writer of a row states it (the column's default is never relied on).
    max_attempts: int = dataclasses.field(kw_only=True)
    idempotency_key: str | None = None
    message_view_from_bytes: bool = False
    idempotency_scope: str = ""
    #: False: the send's own commit does not wait for its WAL flush (see
    #: ``Settings.durable_sends``); ignored in a transaction the caller holds.
    durable: bool = True
    #: The message's timestamp (Dramatiq's ``message_timestamp``, milliseconds since the
    #: epoch): its job cannot have finished before it, so the send's probe of the history
    #: for the same id reads only the partitions from then on. None probes them all.
    sent_at_ms: int | None = None


class EnqueueResult(NamedTuple):
    """The stored job: ``created`` is False when an existing job (same message id or
    idempotency key) was returned instead; ``rescheduled`` is True when a waiting or
    running job with the same id was moved back to queued with the new message."""

    id: str
    created: bool
    status: str
    message: Any
    message_bytes: bytes | None
    rescheduled: bool = False


class ReapedJob(NamedTuple):
    """A job the reaper failed: its interruptions reached the bound."""

    id: str
    queue_name: str
    actor_name: str
    message: dict[str, Any] | None
    message_bytes: bytes | None
    failures: int
    interruptions: int
    error: str


class ReapResult(NamedTuple):
    """What one reaper run did: ``requeued`` interrupted attempts, ``released`` claims that
    never started (uncharged), ``failed`` jobs whose interruptions reached the bound,
    ``aborted`` jobs whose abort was requested (cancelled instead of requeued)."""

    requeued: list[str]
    failed: list[str]
    released: list[str] = []
    failed_jobs: list[ReapedJob] = []
    aborted: list[str] = []


class Renewal(NamedTuple):
    """What a lease renewal found: the attempts still ``owned``, and those of them whose
    abort an operator requested (``abort_requested``)."""

    owned: set[str]
    abort_requested: set[str]


#: The NOTIFY payload that asks the holder of a job's attempt to abort it:
#: ``abort:<job id>`` on the job's queue channel. The payload-free NOTIFY of an enqueue
#: only says "look"; a pause says ``pause``.
ABORT_PAYLOAD_PREFIX = "abort:"
#: The NOTIFY payload of a queue that was just paused (its consumers give back what they
#: prefetched).
PAUSE_PAYLOAD = "pause"


#: What a send writes of a :class:`NewJob`, in one order, each value with the type it is
#: sent as: the parameters of ``insert_job``, ``find_existing`` and ``reenqueue_job``, the
#: arrays of ``insert_jobs`` and the columns of the staging table (a unit test holds the
#: statements to this list). :func:`send_values` gives the values; the binary COPY of
#: :meth:`JobStore._copy_new` writes the stored row the server computes from them
#: (``available_at`` from ``delay_ms``, the jsonb view from ``view_from_bytes``).
SEND_FIELDS: tuple[tuple[str, str], ...] = (
    ("id", "text"),
    ("queue_name", "text"),
    ("actor_name", "text"),
    ("message", "jsonb"),
    ("message_bytes", "bytea"),
    ("view_from_bytes", "bool"),
    ("priority", "int4"),
    ("delay_ms", "int8"),
    ("max_attempts", "int4"),
    ("idempotency_key", "text"),
    ("idempotency_scope", "text"),
    ("sent_at_ms", "int8"),
)
SEND_NAMES = tuple(name for name, _ in SEND_FIELDS)


def send_values(job: NewJob) -> tuple:
    """The values of :data:`SEND_FIELDS` for ``job``: the one encoder of a job for every
    statement that writes it (its jsonb view wrapped for psycopg, its delay never below
    zero)."""
    return (
        job.id,
        job.queue_name,
        job.actor_name,
        Jsonb(job.message) if job.message is not None else None,
        job.message_bytes,
        job.message_view_from_bytes,
        job.priority,
        _delay_ms(job),
        job.max_attempts,
        job.idempotency_key,
        job.idempotency_scope,
        job.sent_at_ms,
    )


def _delay_ms(job: NewJob) -> int:
    return max(0, int(job.delay_ms))


#: How the error the reaper records for an expired lease begins (``reap_expired``); the
#: monitoring tells a lost lease from an actor's failure by it.
LEASE_EXPIRED = "lease expired:"


@dataclasses.dataclass
class QueueCounts:
    """One queue's unfinished and failed jobs (see :meth:`JobStore.queue_counts`).

    Attributes:
      queued(int): waiting and runnable now (``available_at`` has passed).
      delayed(int): waiting for a later ``available_at`` (a delay, an eta, a retry backoff).
      running(int): claimed by a worker.
      failed(int): in the dead-letter state.
      oldest_waiting_seconds(float): how long the oldest runnable job has been runnable
        (since its ``available_at``), by the server's clock; None when none waits.
      declared(bool): a worker declared the queue (see :mod:`dramatiq_pg_broker.queues`);
        False for a queue that only has jobs (sent to a queue no worker consumes), and
        where only the counts were read.
      paused(bool), paused_at(datetime), paused_by(str): whether an operator paused it,
        when and who (where the queue's state was read).
      limit(int): at most this many of its jobs run at once, across every worker (None:
        no limit, or only the counts were read; see :mod:`dramatiq_pg_broker.limits`).
    """

    queued: int = 0
    delayed: int = 0
    running: int = 0
    failed: int = 0
    oldest_waiting_seconds: float | None = None
    declared: bool = False
    paused: bool = False
    paused_at: dt.datetime | None = None
    paused_by: str | None = None
    limit: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def queue_counts_of(rows: Iterable[Sequence[Any]]) -> dict[str, QueueCounts]:
    """The rows of the ``count_by_queue`` statement, as counts per queue."""
    return {
        queue_name: QueueCounts(
            queued=int(queued),
            delayed=int(delayed),
            running=int(running),
            failed=int(failed),
            oldest_waiting_seconds=None if oldest is None else round(max(0.0, oldest), 3),
        )
        for queue_name, queued, delayed, running, failed, oldest in rows
    }


def _claim_of(rows: list[tuple]) -> Claim:
    """The rows of the claim statement as a :class:`Claim`."""
    if len(rows) == 1 and rows[0][0] is None:
        left = rows[0][11]
        return Claim(
            [], rows[0][9], rows[0][8], math.inf if left is None else left, bool(rows[0][13])
        )
    return Claim([ClaimedJob(str(r[0]), *r[1:8], abort_requested=r[12]) for r in rows])


@functools.cache
def _limit_queries(schema: str) -> Queries:
    return Queries(schema, "limits.sql")


def channel_name(schema: str, queue_name: str) -> str:
    """The LISTEN/NOTIFY channel of a queue: ``schema.queue``, hashed when longer than
    PostgreSQL's 63-byte identifier limit."""
    name = f"{schema}.{queue_name}"
    if len(name.encode()) <= 63:
        return name
    digest = hashlib.sha1(queue_name.encode()).hexdigest()
    return f"{schema}.{digest}"[:63]


def abort_payload(job_id: str) -> str:
    """The NOTIFY payload asking the holder of ``job_id``'s attempt to abort it."""
    return ABORT_PAYLOAD_PREFIX + str(job_id)


def clean_text(text: str | None) -> str | None:
    """Text PostgreSQL can store: a NUL character or a lone surrogate (``os.listdir``
    returns those for names that are not UTF-8) would make the whole statement fail, so
    they are written as backslash escapes."""
    if text is None:
        return None
    text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


# -- binary COPY rows (PostgreSQL's documented COPY BINARY format) ---------------------------

#: The header of a binary COPY: signature, flags, header extension length.
_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" * 2
#: The end of a binary COPY: a field count of -1.
_COPY_TRAILER = b"\xff\xff"
_NULL_FIELD = b"\xff\xff\xff\xff"
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
_LENGTH = struct.Struct(">i")
#: 12 fields, then the 16 bytes of the uuid.
_JOB_ROW_START = struct.Struct(">hi").pack(12, 16)
#: priority, available_at, max_attempts.
_JOB_ROW_MIDDLE = struct.Struct(">iiiqii")
_TIMESTAMP = struct.Struct(">iq")
#: 4 fields, then the 16 bytes of the uuid.
_EVENT_ROW_START = struct.Struct(">hi").pack(4, 16)
#: type 'created', attempt 0, then created_at.
_CREATED_EVENT_MIDDLE = _LENGTH.pack(7) + b"created" + struct.Struct(">ii").pack(4, 0)


def _text_field(text: str) -> bytes:
    data = text.encode("utf-8")
    return _LENGTH.pack(len(data)) + data


def _timestamp_us(value: dt.datetime) -> int:
    """A timestamptz as binary COPY holds it: microseconds since 2000-01-01 UTC."""
    return (value - _PG_EPOCH) // dt.timedelta(microseconds=1)


#: What the server raises for a row it refuses (a constraint, a value it cannot store), as
#: opposed to a lost connection.
_REFUSED = (psycopg.DataError, psycopg.IntegrityError, psycopg.ProgrammingError)

#: The isolation levels (``transaction_isolation``) whose snapshot is taken once for the
#: whole transaction: a send's look-up of history can then miss a job that was sent, run
#: and finished after it (see :meth:`JobStore._confirm_new`).
SNAPSHOT_LEVELS = frozenset({"repeatable read", "serializable"})


#: The fewest hex characters a job id prefix must have: the 8 the demo and the CLI print.
#: With a million jobs, about a hundred pairs of ids share their first 8 characters; the
#: resolver then lists the candidates.
MIN_ID_PREFIX = 8
#: The most jobs an ambiguous prefix lists.
MAX_ID_CANDIDATES = 10

_HEX = frozenset("0123456789abcdef")


def id_prefix_range(text: str) -> str | tuple[str, str]:
    """Read a job id or a prefix of one.

    Returns:
      str | tuple[str, str]: the canonical id for a whole UUID; for a prefix, the lowest
      and highest ids that start with it (the prefix padded with ``0`` and with ``f``).

    Raises:
      InvalidJobId: neither a UUID nor a prefix of at least :data:`MIN_ID_PREFIX` hex
        characters.
    """
    given = text.strip()
    digits = given.lower().replace("-", "")
    if len(digits) == 32 and set(digits) <= _HEX:
        return str(uuid.UUID(digits))
    try:
        return str(uuid.UUID(given))  # {braces} and urn:uuid: forms
    except ValueError:
        pass
    if not digits or not set(digits) <= _HEX or len(digits) > 32:
        raise InvalidJobId(
            f"{given!r} is not a job id: give the UUID, or at least its first "
            f"{MIN_ID_PREFIX} hex characters"
        )
    if len(digits) < MIN_ID_PREFIX:
        raise InvalidJobId(
            f"job id prefix {given!r} is too short: give at least {MIN_ID_PREFIX} hex characters"
        )
    low = uuid.UUID(digits.ljust(32, "0"))
    high = uuid.UUID(digits.ljust(32, "f"))
    return str(low), str(high)


#: One cursor per pooled connection, reused by the statements a send, a claim or an outcome
#: runs on it: a new cursor per statement looks up the adapters of every parameter and
#: result column afresh (about 40 µs of a send's Python on a 15-parameter statement). A
#: pooled connection is used by one thread at a time, and each statement's rows are read
#: before it goes back to the pool; the entry goes with the connection.
_cursors: weakref.WeakKeyDictionary[psycopg.Connection, psycopg.Cursor] = (
    weakref.WeakKeyDictionary()
)


def _execute(c: Any, query: str, params: dict[str, Any], pooled: bool) -> Any:
    """``c.execute(query, params)``, on the connection's reused cursor when ``c`` is one of
    the pool's connections (``pooled``); a connection a caller holds (an application's
    transaction, which other threads of the application may share) gets a new cursor."""
    if not pooled or type(c) is not psycopg.Connection:
        return c.execute(query, params)
    cursor = _cursors.get(c)
    if cursor is None or cursor.closed:
        cursor = _cursors[c] = c.cursor()
    return cursor.execute(query, params)


def _nothing() -> None:
    pass


def _buffering_writer(cursor: psycopg.Cursor) -> Any:
    """A COPY writer that hands the data to libpq without waiting for it to reach the
    server (psycopg's default waits for a full flush after every megabyte): the direct
    bulk path then encodes the next chunk at once, and pushes the buffered data out as it
    goes (see :attr:`JobStore.COPY_PUMP_ROWS`); the COPY's end waits for all of it. None
    (psycopg's default writer) where this psycopg has no flush threshold."""
    try:
        return LibpqWriter(cursor, flush_threshold=1 << 62)
    except TypeError:  # pragma: no cover - psycopg without flush_threshold
        return None


class _RepeatedId(Exception):
    """Two jobs of one bulk enqueue share an id: the staged path resolves it."""


class JobStore:
    """The job-store API over one schema.

    Parameters:
      pool(ProcessPool): where connections come from.
      schema(str): the schema of the job tables.
      events(bool): write job events (the audit trail). Operator actions always write
        theirs.

    Every method accepts ``conn=`` to run on a connection the caller holds (for example
    inside the application's own transaction) instead of the pool, and ``now=`` to inject a
    clock in tests.
    """

    def __init__(self, pool: ProcessPool, schema: str, *, events: bool = True) -> None:
        self.pool = pool
        self.schema = schema
        self.events = events
        self.queries = Queries(schema)
        self.history = HistoryProbe(schema)

    # -- plumbing ------------------------------------------------------------------------

    def _fetch(self, name: str, params: dict[str, Any], conn=None) -> list[tuple]:
        params.setdefault("now", None)
        params.setdefault("events", self.events)
        with self.pool.use(conn) as c:
            return _execute(c, self.queries[name], params, conn is None).fetchall()

    @staticmethod
    def _attempt_params(attempts: Sequence[Attempt]) -> dict[str, Any]:
        # In id order, so that two statements updating overlapping rows (the heartbeat and
        # the outcome writer) lock them in the same order and do not deadlock.
        attempts = sorted(attempts, key=lambda a: a.id)
        return {
            "ids": [a.id for a in attempts],
            "owners": [a.owner for a in attempts],
            "attempts": [a.attempt for a in attempts],
        }

    def channel(self, queue_name: str) -> str:
        return channel_name(self.schema, queue_name)

    # -- transitions -------------------------------------------------------------------

    def enqueue(
        self,
        job: NewJob,
        *,
        conn: psycopg.Connection | None = None,
        now: dt.datetime | None = None,
        again: bool = True,
    ) -> EnqueueResult:
        """Store a message as a queued job (with its ``created`` event) and wake consumers.

        - A job with the same idempotency key (same actor and scope) exists: nothing is
          written and that job is returned with ``created=False``.
        - A job with the same id is waiting or running (the message is enqueued again, as
          a snooze does): it is moved back to ``queued`` with the new message, priority and
          delay, and returned with ``rescheduled=True``. A running attempt loses its
          ownership (its later outcome matches nothing).
        - ``again=False`` (a retry of a send whose first try may have committed) returns a
          job with the same id as it is.

        Raises:
          JobAlreadyFinished: a job with the same id already finished.
        """
        params = self._new_job_params(job, now)
        if conn is not None:
            # The caller's transaction: its commit is the caller's to make durable or not.
            params["durable"] = True
        with self.pool.use(conn) as c:
            return self._insert_one(c, job, params, again, pooled=conn is None)

    def _insert_one(
        self,
        c: psycopg.Connection,
        job: NewJob,
        params: dict[str, Any],
        again: bool,
        *,
        pooled: bool = False,
    ) -> EnqueueResult:
        row = self._probing(c, "insert_job", params, job.sent_at_ms, pooled).fetchone()
        if row is not None:
            self._confirm_new(c, [job], row[2], pooled)
            return EnqueueResult(job.id, True, "queued", job.message, job.message_bytes)
        return self._not_inserted(c, job, params, again, pooled)

    def _probing(
        self,
        c: psycopg.Connection,
        name: str,
        params: dict[str, Any],
        sent_at_ms: int | None,
        pooled: bool = True,
    ) -> Any:
        """Execute the send statement ``name``, its history probe on the partitions of the
        message's days (see :mod:`.history_probe`). A partition it names that was dropped
        by hand makes a pooled send forget them and probe the parent instead."""
        text = self.queries[name]
        if params.get("now") is None:
            text = self.history.statement(c, name, text, sent_at_ms)
        try:
            return _execute(c, text, params, pooled)
        except psycopg.errors.UndefinedTable:
            if not pooled or text is self.queries[name]:
                raise
            self.history.forget()
            return _execute(c, self.queries[name], params, pooled)

    def send_many(self, sends: Sequence[tuple[NewJob, bool]]) -> list[EnqueueResult | Exception]:
        """Single sends of several threads written together (group commit): one autocommit
        statement inserts them all, with their ``created`` events, and wakes their queues;
        a send whose job conflicts with a stored one is then handled alone, as
        :meth:`enqueue` handles it. ``sends`` pairs each job with its ``again`` (see
        :meth:`enqueue`). The commit is durable unless no send in the group asked for it.

        Returns:
          list: in the order of ``sends``, each send's result, or the error that only this
          send raised (``JobAlreadyFinished``, or the server refusing its row).

        Raises:
          dramatiq.errors.ConnectionError: the statement could not be written; whether it
            committed is unknown, so every send of the group is retried as a whole.
        """
        jobs = [job for job, _ in sends]
        params = self._bulk_params(jobs, None)
        params["channels"] = sorted({self.channel(job.queue_name) for job in jobs})
        params["durable"] = any(job.durable for job in jobs)
        stamps = [job.sent_at_ms for job in jobs]
        stamp = None if None in stamps else min(stamps)
        results: list[EnqueueResult | Exception] = []
        with self.pool.use() as c:
            try:
                inserted = {str(r[0]) for r in self._probing(c, "insert_jobs", params, stamp)}
            except _REFUSED:
                # One send's row is refused by the server: none of the group was written
                # (one statement), and each send now learns its own fate alone.
                inserted = set()
            for job, again in sends:
                if job.id in inserted:
                    inserted.discard(job.id)  # the same id sent twice at once inserts once
                    results.append(
                        EnqueueResult(job.id, True, "queued", job.message, job.message_bytes)
                    )
                    continue
                try:
                    alone = self._new_job_params(job, None)
                    results.append(self._insert_one(c, job, alone, again, pooled=True))
                except (JobAlreadyFinished, *_REFUSED) as e:
                    results.append(e)
        return results

    def _confirm_new(
        self, c: Any, jobs: Sequence[NewJob], isolation: str | None, pooled: bool
    ) -> None:
        """Refuse the sends of ``jobs``, just inserted on ``c``, whose id is in history.

        The send statements look for the id in jobs and in history with their snapshot. A
        worker's move to history is one transaction, so under READ COMMITTED (a snapshot
        per statement) a send sees the id in one table or the other. An application's
        transaction under REPEATABLE READ or SERIALIZABLE keeps the snapshot of its first
        statement: a job sent, run and finished since is in neither table for it, and the
        primary key does not stop the insert (the old row is gone). History is then read
        again on one of the pool's connections, whose snapshot is new; an id found there
        makes the send abort the application's transaction with a serialization failure
        (SQLSTATE 40001), as PostgreSQL itself does when a snapshot cannot be kept: the
        application retries its transaction, which then sees the finished job.

        The broker's own sends (``pooled``) are single autocommit statements or
        transactions begun READ COMMITTED: nothing to do.

        Raises:
          psycopg.errors.SerializationFailure: an id of ``jobs`` is in history.
        """
        if pooled or isolation not in SNAPSHOT_LEVELS or not jobs:
            return
        stamps = [job.sent_at_ms for job in jobs]
        params = {
            "ids": [job.id for job in jobs],
            "sent_at_ms": None if None in stamps else min(stamps),
        }
        with self.pool.connection() as other:
            found = sorted(str(r[0]) for r in other.execute(self.queries["finished_among"], params))
        if not found:
            return
        try:
            c.execute(self.queries["refuse_send"])
        except psycopg.errors.SerializationFailure as e:
            raise psycopg.errors.SerializationFailure(
                f"job {', '.join(found)} finished after this {isolation} transaction's "
                "snapshot was taken, so sending its message again would give the id a "
                "second row: nothing was sent; retry the transaction"
            ) from e
        raise AssertionError("refuse_send did not raise")  # pragma: no cover

    def _not_inserted(
        self,
        c: psycopg.Connection,
        job: NewJob,
        params: dict[str, Any],
        again: bool,
        pooled: bool = False,
    ) -> EnqueueResult:
        """What a send whose insert was a no-op gets: the job with its idempotency key, or
        the job with its id rescheduled (see :meth:`enqueue`)."""
        existing = c.execute(self.queries["find_existing"], params).fetchone()
        if existing is None and job.idempotency_key is not None and not params.get("_again"):
            # The key's job was deleted by hand (not by retention or flush, which free its
            # key): free the key and send once more.
            c.execute(self.queries["release_stale_key"], params)
            retried = c.execute(self.queries["insert_job"], params).fetchone()
            if retried is not None:
                self._confirm_new(c, [job], retried[2], pooled)
                return EnqueueResult(job.id, True, "queued", job.message, job.message_bytes)
            return self._not_inserted(c, job, {**params, "_again": True}, again, pooled)
        if existing is None:  # pragma: no cover - deleted between the two statements
            raise JobNotFound(f"job {job.id} conflicted with a job that no longer exists")
        job_id, status, message, message_bytes = existing
        job_id = str(job_id)
        if job_id != job.id or not again:
            return EnqueueResult(job_id, False, status, message, message_bytes)
        if status in ("queued", "running"):
            moved = c.execute(self.queries["reenqueue_job"], params).fetchone()
            if moved is not None:
                return EnqueueResult(job.id, False, "queued", job.message, job.message_bytes, True)
            current = c.execute(self.queries["get_job"], {"id": job.id}).fetchone()
            if current is None:  # pragma: no cover - deleted meanwhile
                raise JobNotFound(f"job {job.id} was deleted while it was enqueued again")
            # A waiting or running job whose abort was requested is never enqueued again.
            status = "being aborted" if current[23] is not None else current[5]
        raise JobAlreadyFinished(job.id, status)

    #: Rows per bulk insert statement: bounds the size of one statement's parameters.
    BULK_CHUNK = 10_000
    #: From this many rows, a bulk insert goes through COPY into a staging table (two more
    #: round trips, far cheaper per row than array parameters).
    BULK_COPY_MIN = 200
    #: The staging table's columns: the send's fields, then the position in the batch.
    _STAGED_TYPES = (*(kind for _, kind in SEND_FIELDS), "int8")

    def enqueue_many(
        self,
        jobs: Sequence[NewJob],
        *,
        conn: psycopg.Connection | None = None,
        now: dt.datetime | None = None,
        again: bool = True,
    ) -> list[EnqueueResult]:
        """Store many messages in one transaction (a savepoint inside the caller's, on
        ``conn``): all of them or, if anything fails, none. Each job is handled as
        :meth:`enqueue` handles one; results are in the order of ``jobs``.

        From :attr:`BULK_COPY_MIN` jobs on, the rows are first copied straight into the
        tables (:meth:`_copy_new`); a batch with a conflict is then written again by
        :meth:`_insert_resolving`, as a smaller batch always is.

        Raises:
          JobAlreadyFinished: a job's id is a job that already finished (its index is in
            the message); nothing was written.
        """
        if not jobs:
            return []
        pooled = conn is None
        with self.pool.use(conn) as c:
            if not pooled:
                with c.transaction():
                    return self._enqueue_many(c, jobs, now, again, pooled)
            # The broker's own transaction begins READ COMMITTED whatever the server's
            # default_transaction_isolation: each statement's snapshot then sees every move
            # to history committed before it (see _confirm_new). The pooled connection gets
            # its setting back (a pool passed in is the application's).
            previous = c.isolation_level
            c.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
            try:
                with c.transaction():
                    return self._enqueue_many(c, jobs, now, again, pooled)
            finally:
                with contextlib.suppress(psycopg.Error):
                    c.isolation_level = previous

    def _enqueue_many(
        self,
        c: Any,
        jobs: Sequence[NewJob],
        now: dt.datetime | None,
        again: bool,
        pooled: bool,
    ) -> list[EnqueueResult]:
        """:meth:`enqueue_many` inside its transaction (or savepoint) on ``c``."""
        if (
            self.DIRECT_COPY
            and len(jobs) >= self.BULK_COPY_MIN
            and self._copy_new(c, jobs, now, pooled)
        ):
            queues = {job.queue_name for job in jobs}
            channels = sorted(self.channel(q) for q in queues)
            c.execute(self.queries["notify_queues"], {"channels": channels})
            return [
                EnqueueResult(job.id, True, "queued", job.message, job.message_bytes)
                for job in jobs
            ]
        return self._insert_resolving(c, jobs, now, again, pooled)

    def _insert_resolving(
        self,
        c: psycopg.Connection,
        jobs: Sequence[NewJob],
        now: dt.datetime | None,
        again: bool,
        pooled: bool = False,
    ) -> list[EnqueueResult]:
        """The bulk path that resolves conflicts row by row (ON CONFLICT DO NOTHING, then
        each job not inserted as :meth:`enqueue` does)."""
        results: list[EnqueueResult | None] = [None] * len(jobs)
        queues: set[str] = set()
        new: list[NewJob] = []
        isolation = None
        for start in range(0, len(jobs), self.BULK_CHUNK):
            chunk = jobs[start : start + self.BULK_CHUNK]
            if len(chunk) >= self.BULK_COPY_MIN:
                rows = self._insert_staged(c, chunk, now)
            else:
                rows = c.execute(
                    self.queries["insert_jobs"], self._bulk_params(chunk, now)
                ).fetchall()
            inserted = {str(r[0]) for r in rows}
            if rows:
                isolation = rows[0][1]
            for offset, job in enumerate(chunk):
                if job.id in inserted:
                    inserted.discard(job.id)  # a repeated id inserts once
                    results[start + offset] = EnqueueResult(
                        job.id, True, "queued", job.message, job.message_bytes
                    )
                    queues.add(job.queue_name)
                    new.append(job)
        self._confirm_new(c, new, isolation, pooled)
        for index, job in enumerate(jobs):
            if results[index] is not None:
                continue
            params = self._new_job_params(job, now)
            try:
                results[index] = result = self._not_inserted(c, job, params, again, pooled)
            except JobAlreadyFinished as e:
                e.args = (f"message {index} of the batch: {e}",)
                raise
            if result.rescheduled:
                queues.add(job.queue_name)
        if queues:
            channels = sorted(self.channel(q) for q in queues)
            c.execute(self.queries["notify_queues"], {"channels": channels})
        return results  # type: ignore[return-value]

    #: Whether a batch of :attr:`BULK_COPY_MIN` jobs or more is first copied straight into
    #: the tables (the direct bulk path). False sends every batch down the path a batch
    #: with a conflict takes (:meth:`_insert_resolving`): the tests compare the two.
    DIRECT_COPY = True
    #: Rows per COPY statement of the direct bulk path (measured on 100,000 messages: 2,500
    #: and 5,000 were alike, 10,000 slower, since the first and last chunks are not
    #: overlapped with encoding).
    COPY_CHUNK = 5_000
    #: How much of the next chunk is encoded while the server inserts the current chunk's
    #: jobs, in percent; the rest is encoded while it inserts their events. Measured: the
    #: job rows take longer (five indexes and the jsonb view) than the events.
    COPY_SPLIT = 80
    #: While the next chunk is encoded, whatever of the current one libpq still holds is
    #: pushed to the server every this many rows (a non-blocking flush), so the server
    #: keeps inserting while this process encodes.
    COPY_PUMP_ROWS = 200

    def _copy_new(
        self,
        c: psycopg.Connection,
        jobs: Sequence[NewJob],
        now: dt.datetime | None,
        pooled: bool = False,
    ) -> bool:
        """Write ``jobs`` with COPY straight into the jobs table and their ``created`` events
        into job_events, in a savepoint. Returns False, with nothing written, when a job
        conflicts with a stored one or with another job of the batch (the caller then
        resolves the conflicts with :meth:`_insert_resolving`).

        This is the cheap path of a bulk enqueue: no staging table, no ON CONFLICT probe,
        and the server inserts rows while this process is still encoding the next ones.
        ``jobs`` may build its items on first access (the broker's checks and encoding):
        each COPY statement is sent first, then the next chunk is built while the server
        works on it, so the two cores of a small machine are both busy.
        """
        now_us = _timestamp_us(c.execute(self.queries["bulk_now"], {"now": now}).fetchone()[0])
        cur = c.cursor()
        # A psycopg cursor: libpq's non-blocking flush, which sends what the socket takes
        # now and never waits (an application's asyncio connection runs its COPY its way).
        direct = isinstance(cur, psycopg.Cursor)
        pump = cur.connection.pgconn.flush if direct else _nothing
        copy_options = (lambda: {"writer": _buffering_writer(cur)}) if direct else dict
        pump_rows = self.COPY_PUMP_ROWS
        fields: dict[str, bytes] = {}
        seen: set[str] = set()
        total = len(jobs)

        def build(start: int, stop: int, job_rows: list[bytes], event_rows: list[bytes]):
            updated = _TIMESTAMP.pack(8, now_us)
            for position in range(start, stop):
                if not position % pump_rows:
                    pump()
                job = jobs[position]
                if job.id in seen:
                    raise _RepeatedId(job.id)
                seen.add(job.id)
                uid = bytes.fromhex(job.id.replace("-", ""))
                queue_field = fields.get(job.queue_name)
                if queue_field is None:
                    queue_field = fields[job.queue_name] = _text_field(job.queue_name)
                actor = fields.get(job.actor_name)
                if actor is None:
                    actor = fields[job.actor_name] = _text_field(job.actor_name)
                scope = fields.get(job.idempotency_scope)
                if scope is None:
                    scope = fields[job.idempotency_scope] = _text_field(job.idempotency_scope)
                data = job.message_bytes
                if job.message is not None:
                    view = b"\x01" + json.dumps(job.message).encode()
                    view = _LENGTH.pack(len(view)) + view
                elif job.message_view_from_bytes and data is not None:
                    # The bytes are JSON that jsonb holds as it is (see messages.encode).
                    view = _LENGTH.pack(len(data) + 1) + b"\x01" + data
                else:
                    view = _NULL_FIELD
                created = _TIMESTAMP.pack(8, now_us + position)
                job_rows.append(
                    b"".join(
                        (
                            _JOB_ROW_START,
                            uid,
                            queue_field,
                            actor,
                            view,
                            _NULL_FIELD if data is None else _LENGTH.pack(len(data)) + data,
                            _JOB_ROW_MIDDLE.pack(
                                4,
                                job.priority,
                                8,
                                now_us + _delay_ms(job) * 1000,
                                4,
                                job.max_attempts,
                            ),
                            _NULL_FIELD
                            if job.idempotency_key is None
                            else _text_field(job.idempotency_key),
                            scope,
                            created,
                            updated,
                        )
                    )
                )
                event_rows.append(_EVENT_ROW_START + uid + _CREATED_EVENT_MIDDLE + created)

        def block(rows: list[bytes]) -> bytes:
            return b"".join((_COPY_HEADER, *rows, _COPY_TRAILER))

        try:
            with c.transaction():
                job_rows: list[bytes] = []
                event_rows: list[bytes] = []
                start = 0
                build(0, min(self.COPY_CHUNK, total), job_rows, event_rows)
                while job_rows:
                    stop = min(start + self.COPY_CHUNK, total)
                    following = min(stop + self.COPY_CHUNK, total)
                    split = stop + (following - stop) * self.COPY_SPLIT // 100
                    next_jobs: list[bytes] = []
                    next_events: list[bytes] = []
                    with cur.copy(self.queries["copy_jobs"], **copy_options()) as copy:
                        copy.write(block(job_rows))
                        # Encoded while the server inserts the rows just sent.
                        build(stop, split if self.events else following, next_jobs, next_events)
                    if self.events:
                        with cur.copy(
                            self.queries["copy_created_events"], **copy_options()
                        ) as copy:
                            copy.write(block(event_rows))
                            build(split, following, next_jobs, next_events)
                    job_rows, event_rows, start = next_jobs, next_events, stop
                in_history, isolation = self._copied_in_history(c, jobs)
                if in_history:
                    raise _RepeatedId("a job's id or idempotency key is in history")
                self._confirm_new(c, jobs, isolation, pooled)
        except (psycopg.errors.UniqueViolation, _RepeatedId):
            return False
        return True

    def _copied_in_history(self, c: psycopg.Connection, jobs: Sequence[NewJob]) -> tuple[bool, str]:
        """Register the idempotency keys of the jobs :meth:`_copy_new` wrote (a key already
        held raises a unique violation), and say whether one of their ids is in history
        (with the transaction's isolation level): a statement each for the whole bulk (COPY
        cannot probe as it inserts)."""
        keyed = [job for job in jobs if job.idempotency_key is not None]
        if keyed:
            c.execute(
                self.queries["copy_keys"],
                {
                    "key_actors": [job.actor_name for job in keyed],
                    "key_scopes": [job.idempotency_scope for job in keyed],
                    "keys": [job.idempotency_key for job in keyed],
                    "key_ids": [job.id for job in keyed],
                },
            )
        stamps = [job.sent_at_ms for job in jobs]
        params = {
            "ids": [job.id for job in jobs],
            "sent_at_ms": None if None in stamps else min(stamps, default=None),
        }
        found, isolation = c.execute(self.queries["copied_in_history"], params).fetchone()
        return found, isolation

    def _insert_staged(
        self, c: psycopg.Connection, jobs: Sequence[NewJob], now: dt.datetime | None
    ) -> list[tuple]:
        c.execute(self.queries["stage_jobs"])
        with c.cursor().copy(self.queries["copy_staged_jobs"]) as copy:
            copy.set_types(self._STAGED_TYPES)
            for position, job in enumerate(jobs, 1):
                copy.write_row((*send_values(job), position))
        rows = c.execute(
            self.queries["insert_staged_jobs"], {"now": now, "events": self.events}
        ).fetchall()
        c.execute(self.queries["drop_staged_jobs"])
        return rows

    def _bulk_params(self, jobs: Sequence[NewJob], now: dt.datetime | None) -> dict[str, Any]:
        """The parameters of ``insert_jobs``: one array per send field."""
        columns = zip(*map(send_values, jobs)) if jobs else ([] for _ in SEND_NAMES)
        params: dict[str, Any] = {name: list(column) for name, column in zip(SEND_NAMES, columns)}
        params.update(channels=[], durable=True, now=now, events=self.events)
        return params

    def _new_job_params(self, job: NewJob, now: dt.datetime | None) -> dict[str, Any]:
        """The parameters of ``insert_job`` (and of ``find_existing``, ``reenqueue_job``)."""
        params: dict[str, Any] = dict(zip(SEND_NAMES, send_values(job)))
        params.update(
            channel=self.channel(job.queue_name), durable=job.durable, now=now, events=self.events
        )
        return params

    def server_now(self, *, conn=None) -> dt.datetime:
        """The database server's clock (``now()``)."""
        return self._fetch("server_now", {}, conn)[0][0]

    def claim(
        self,
        queue_name: str,
        limit: int,
        owner: str,
        lease_seconds: float,
        *,
        conn: psycopg.Connection | None = None,
        now: dt.datetime | None = None,
    ) -> list[ClaimedJob]:
        """queued -> running for up to ``limit`` runnable jobs of a queue, in claim order
        (priority, available_at, created_at, id). Each gets ``attempts + 1``, the owner and
        a lease, and a ``claimed`` event."""
        return self.claim_or_wait(queue_name, limit, owner, lease_seconds, conn=conn, now=now).jobs

    def claim_or_wait(
        self,
        queue_name: str,
        limit: int,
        owner: str,
        lease_seconds: float,
        *,
        conn: psycopg.Connection | None = None,
        now: dt.datetime | None = None,
    ) -> Claim:
        """:meth:`claim`, and when it claims nothing, when the queue's earliest waiting job
        becomes runnable, in the same statement (an idle poll is one round trip)."""
        return _claim_of(self._claim_rows(queue_name, limit, owner, lease_seconds, now, conn))

    def _claim_rows(self, queue_name, limit, owner, lease_seconds, now, conn) -> list[tuple]:
        """The plain claim statement, limited or not: its rows."""
        params = {"queue_name": queue_name, "limit": limit, "owner": owner, "now": now}
        return self._fetch("claim_jobs", {**params, "lease_ms": _ms(lease_seconds)}, conn)

    def claim_limited(
        self,
        queue_name: str,
        limit: int,
        owner: str,
        lease_seconds: float,
        *,
        conn: psycopg.Connection | None = None,
        now: dt.datetime | None = None,
    ) -> Claim:
        """:meth:`claim_or_wait` for a queue with a limit (see :mod:`.limits`): at most
        ``limit`` jobs, and never so many that more of the queue's jobs would be running
        than its limit allows, however many workers claim at once on however many hosts.

        One transaction: an advisory lock of the transaction on the queue (claims of the
        queue take turns until it commits), then the room left under the limit, read with
        a snapshot taken after the lock was granted, then the plain claim statement for at
        most that many jobs. The returned claim carries the limit read (``queue_limit``;
        None: the queue has no limit any more and the claim was not bounded by one) and,
        when the queue was at its limit, ``at_limit``.
        """
        queries = _limit_queries(self.schema)
        with self.pool.use(conn) as c, c.transaction():
            c.execute(queries["lock_limited_queue"], {"key": f"{self.schema}.{queue_name}"})
            max_running, room = c.execute(
                queries["limited_queue_room"], {"queue_name": queue_name}
            ).fetchone()
            if max_running is not None:
                limit = min(limit, room)
            if limit <= 0:
                return Claim([], queue_limit=max_running, at_limit=True)
            rows = self._claim_rows(queue_name, limit, owner, lease_seconds, now, c)
        claim = _claim_of(rows)
        return dataclasses.replace(claim, queue_limit=max_running)

    def limited_room(self, queue_name: str, *, conn=None) -> int:
        """How many more jobs of a limited queue may run now, by a read that takes no lock
        (a hint: :meth:`claim_limited` decides). A large number for a queue without a
        limit."""
        with self.pool.use(conn) as c:
            max_running, room = c.execute(
                _limit_queries(self.schema)["limited_queue_room"], {"queue_name": queue_name}
            ).fetchone()
        return room if max_running is not None else 1 << 30

    def queue_limits(self, *, conn=None) -> dict[str, int]:
        """Every queue's limit, by queue name (see :mod:`.limits`)."""
        with self.pool.use(conn) as c:
            rows = c.execute(_limit_queries(self.schema)["queue_limits"]).fetchall()
        return {row[0]: row[1] for row in rows}

    def next_available_at(self, queue_name: str, *, conn=None) -> dt.datetime | None:
        """When the earliest waiting job of a queue becomes runnable, or None."""
        return self._peek(queue_name, conn).next_available_at

    def seconds_until_available(self, queue_name: str, *, conn=None) -> float | None:
        """Seconds, by the server's clock, until the earliest waiting job of a queue
        becomes runnable (0 or less: it is runnable now), or None if none waits."""
        return self._peek(queue_name, conn).seconds_until_available

    def _peek(self, queue_name: str, conn) -> Claim:
        # The claim statement with no room claims nothing and reports the next due time.
        return self.claim_or_wait(queue_name, 0, "", 0, conn=conn)

    def start(
        self, attempts: Sequence[Attempt], lease_seconds: float | None, *, conn=None, now=None
    ) -> set[str]:
        """Claimed attempts whose actors run or are about to: from now on each is charged as
        an attempt. With ``lease_seconds`` its lease starts afresh; with None it is left as
        it is (a cheaper, HOT update). Returns the ids still owned; a message whose id is
        missing must not run (or, already running, is no longer this worker's)."""
        if not attempts:
            return set()
        lease_ms = None if lease_seconds is None else _ms(lease_seconds)
        params = {**self._attempt_params(attempts), "lease_ms": lease_ms, "now": now}
        return {str(r[0]) for r in self._fetch("start_jobs", params, conn)}

    def complete(self, attempts: Sequence[Attempt], *, conn=None, now=None) -> set[str]:
        """running -> succeeded. Returns the ids changed (the attempts still owned)."""
        if not attempts:
            return set()
        rows = self._fetch("complete_jobs", {**self._attempt_params(attempts), "now": now}, conn)
        return {str(r[0]) for r in rows}

    def complete_in_transaction(self, attempt: Attempt, conn, *, now=None) -> str | None:
        """running -> succeeded for one attempt, in the transaction open on ``conn`` (an
        application's connection): the job succeeds when that transaction commits. Returns
        the transaction's id (for :meth:`completion_status`), or None if the attempt is no
        longer owned (or its abort was requested)."""
        params = {"id": attempt.id, "owner": attempt.owner, "attempt": attempt.attempt}
        rows = self._fetch("complete_in_transaction", {**params, "now": now}, conn)
        return str(rows[0][1]) if rows else None

    def completion_status(self, attempt: Attempt, xid: str, *, conn=None) -> tuple[str, bool]:
        """How the transaction ``xid`` that ran :meth:`complete_in_transaction` for
        ``attempt`` ended (``committed``, ``aborted``, ``in progress``), and whether the
        row is still that attempt's (running, owned)."""
        params = {"id": attempt.id, "owner": attempt.owner, "attempt": attempt.attempt, "xid": xid}
        status, running = self._fetch("completion_status", params, conn)[0]
        return status, bool(running)

    def fail(
        self, attempts: Sequence[Attempt], errors: Sequence[str | None], *, conn=None, now=None
    ) -> set[str]:
        """running -> failed (dead letter), keeping each attempt's error."""
        if not attempts:
            return set()
        pairs = sorted(zip(attempts, errors), key=lambda pair: pair[0].id)
        params = {
            **self._attempt_params([attempt for attempt, _ in pairs]),
            "errors": [clean_text(error) for _, error in pairs],
            "now": now,
        }
        return {str(r[0]) for r in self._fetch("fail_jobs", params, conn)}

    def reschedule(
        self,
        attempt: Attempt,
        queue_name: str,
        delay_ms: int,
        error: str | None,
        *,
        message: dict[str, Any] | None = None,
        message_bytes: bytes | None = None,
        max_attempts: int | None = None,
        conn=None,
        now=None,
    ) -> bool:
        """running -> queued, runnable after ``delay_ms`` (a retry). The attempt stays
        charged. Passing ``message`` or ``message_bytes`` replaces the stored message;
        ``max_attempts`` (from :func:`~dramatiq_pg_broker.messages.max_attempts_for`), the
        row's limit."""
        replace = message is not None or message_bytes is not None
        rows = self._fetch(
            "reschedule_job",
            {
                "id": attempt.id,
                "owner": attempt.owner,
                "attempt": attempt.attempt,
                "delay_ms": max(0, int(delay_ms)),
                "error": clean_text(error),
                "replace_message": replace,
                "message": Jsonb(message) if message is not None else None,
                "message_bytes": message_bytes,
                "max_attempts": max_attempts,
                "channel": self.channel(queue_name),
                "now": now,
            },
            conn,
        )
        return bool(rows)

    def release(self, attempts: Sequence[Attempt], *, conn=None, now=None) -> set[str]:
        """running -> queued at once for claimed messages that never started; the attempt
        is given back and the queues' consumers are woken. Used at worker shutdown."""
        if not attempts:
            return set()
        rows = self._fetch("release_jobs", {**self._attempt_params(attempts), "now": now}, conn)
        self._notify({r[1] for r in rows}, conn)
        return {str(r[0]) for r in rows}

    def _notify(self, queue_names, conn=None) -> None:
        """Wake the consumers of these queues, in one statement."""
        if not queue_names:
            return
        channels = sorted({self.channel(queue_name) for queue_name in queue_names})
        with self.pool.use(conn) as c:
            c.execute(self.queries["notify_queues"], {"channels": channels})

    def renew(
        self,
        attempts: Sequence[Attempt],
        lease_seconds: float,
        *,
        record: bool = False,
        conn=None,
        now=None,
    ) -> set[str]:
        """Extend the leases of attempts still owned. ``record`` writes ``lease_renewed``
        events (explicit renewals; the heartbeat renews silently)."""
        return self.renew_leases(attempts, lease_seconds, record=record, conn=conn, now=now).owned

    def renew_leases(
        self,
        attempts: Sequence[Attempt],
        lease_seconds: float,
        *,
        record: bool = False,
        conn=None,
        now=None,
    ) -> Renewal:
        """:meth:`renew`, also reporting which of the attempts still owned have an abort
        requested (what the heartbeat needs when no NOTIFY reaches the worker)."""
        if not attempts:
            return Renewal(set(), set())
        params = {
            **self._attempt_params(attempts),
            "lease_ms": _ms(lease_seconds),
            "record": record,
            "now": now,
        }
        rows = self._fetch("renew_leases", params, conn)
        return Renewal({str(r[0]) for r in rows}, {str(r[0]) for r in rows if r[1]})

    def progress(
        self, attempt: Attempt, data: Any, lease_seconds: float, *, conn=None, now=None
    ) -> bool:
        """Record a ``progress`` event for a running attempt and renew its lease. Returns
        False if the attempt is no longer owned."""
        params = {
            "id": attempt.id,
            "owner": attempt.owner,
            "attempt": attempt.attempt,
            "data": Jsonb(data),
            "lease_ms": _ms(lease_seconds),
            "now": now,
        }
        return bool(self._fetch("record_progress", params, conn))

    def reap(
        self,
        *,
        batch: int,
        backoff_ms: Sequence[int],
        max_interruptions: int,
        lease_seconds: float,
        conn=None,
        now=None,
    ) -> ReapResult:
        """Give back running jobs whose lease expired, at most ``batch`` of them.

        A claim that never started is released uncharged. A started attempt was interrupted:
        the job is requeued after ``backoff_ms[interruptions - 1]`` (the last entry for
        later ones), or failed once its interruptions reach ``max_interruptions``. A job
        whose abort was requested is cancelled instead (``aborted``). A lease only counts
        as expired once the server has been up for ``lease_seconds``.
        """
        if not backoff_ms:
            raise ValueError("backoff_ms needs at least one delay")
        rows = self._fetch(
            "reap_expired",
            {
                "batch": batch,
                "backoff_ms": [int(ms) for ms in backoff_ms],
                "max_interruptions": max_interruptions,
                "lease_expired": LEASE_EXPIRED,
                "lease_ms": _ms(lease_seconds),
                "now": now,
            },
            conn,
        )
        requeued = [str(r[0]) for r in rows if r[1] == "queued" and r[3]]
        released = [str(r[0]) for r in rows if r[1] == "queued" and not r[3]]
        failed_jobs = [
            ReapedJob(str(r[0]), r[2], r[4], r[5], r[6], r[7], r[8], r[9])
            for r in rows
            if r[1] == "failed"
        ]
        aborted = [str(r[0]) for r in rows if r[1] == "cancelled"]
        self._notify({r[2] for r in rows if r[1] == "queued"}, conn)
        return ReapResult(requeued, [j.id for j in failed_jobs], released, failed_jobs, aborted)

    def retry_failed(self, job_id: str, *, by: str | None = None, conn=None, now=None) -> dict:
        """failed -> queued by an operator; attempts start again from zero.

        Raises:
          JobNotFound: no job has this id.
          InvalidTransition: the job is not failed.
          DuplicateJobId: the job's id has a second row (see :meth:`retry_all_failed`).
        """
        rows = self._retry_failed({"ids": [job_id], "limit": 1, "by": by, "now": now}, conn)
        if not rows:
            self._raise_for(job_id, "failed", "retried", conn)
        if rows[0][3]:
            raise DuplicateJobId(job_id)
        return self.get(job_id, conn=conn)

    def retry_all_failed(
        self,
        *,
        queue_name: str | None = None,
        by: str | None = None,
        batch: int = 1000,
        now: dt.datetime | None = None,
        skipped: list[str] | None = None,
    ) -> Iterator[list[str]]:
        """failed -> queued by an operator for every job (of ``queue_name`` when given) that
        failed before the call, oldest failure first, in batches of at most ``batch``: each
        batch is one statement (the transition :meth:`retry_failed` runs) and its own
        commit, so neither memory nor a transaction grows with the number of failed jobs.
        A job that fails again while the batches run is not retried a second time.

        A failed job whose id has another row (queued or running in jobs, or a second row
        in history, which earlier releases could leave when a message was sent again while
        its job finished) is skipped: moving it back would give the id two rows in jobs.
        Its id is appended to ``skipped`` when a list is given (the operator's to sort
        out, see :class:`~dramatiq_pg_broker.errors.DuplicateJobId`).

        Yields:
          list[str]: the ids each batch retried, once it is committed.
        """
        failed_before = now if now is not None else self.server_now()
        after: tuple[Any, Any] = (None, None)
        reported: set[str] = set()
        while True:
            params = {
                "queue_name": queue_name,
                "failed_before": failed_before,
                "after_finished_at": after[0],
                "after_id": after[1],
                "limit": batch,
                "by": by,
                "now": now,
            }
            rows = self._retry_failed(params, None)
            if not rows:
                return
            after = max((r[2], r[0]) for r in rows)
            for row in rows:
                # An id twice in history is met once per row: reported once.
                if row[3] and skipped is not None and str(row[0]) not in reported:
                    reported.add(str(row[0]))
                    skipped.append(str(row[0]))
            yield [str(r[0]) for r in rows if not r[3]]

    def _retry_failed(self, params: dict[str, Any], conn) -> list[tuple]:
        """The ``retry_failed`` statement, then the wake-up of the queues it made runnable."""
        for name in ("ids", "queue_name", "failed_before", "after_finished_at", "after_id"):
            params.setdefault(name, None)
        rows = self._fetch("retry_failed", params, conn)
        self._notify({r[1] for r in rows if not r[3]}, conn)
        return rows

    def cancel(self, job_id: str, *, by: str | None = None, conn=None, now=None) -> dict:
        """queued -> cancelled by an operator.

        Raises:
          JobNotFound: no job has this id.
          InvalidTransition: the job is not queued.
        """
        if not self._fetch("cancel_job", {"id": job_id, "by": by, "now": now}, conn):
            self._raise_for(job_id, "queued", "cancelled", conn)
        return self.get(job_id, conn=conn)

    def abort(self, job_id: str, *, by: str | None = None, conn=None, now=None) -> dict:
        """An operator aborts a job.

        - queued (delayed included) -> cancelled at once, with an ``aborted`` event;
        - running: the attempt is marked (``abort_requested_at``, ``abort_requested_by``;
          a second request keeps the first one's) with an ``abort_requested`` event, and the
          worker holding it is told (a NOTIFY on the job's queue, delivered at commit; its
          lease heartbeat tells it too when no NOTIFY can reach it). The worker interrupts
          the actor and ends the job ``cancelled`` with an ``aborted`` event (see
          :meth:`abort_attempts`); the job is never retried nor run again. A worker that
          died with it lets the reaper cancel it once its lease expires.

        Parameters:
          job_id(str): the job (the Dramatiq message id).
          by(str): who asks, as the events and the row record it (default ``unknown``).

        Returns:
          dict: the job as :meth:`get` returns it, right after the request (``cancelled``,
          or still ``running`` with the request recorded).

        Raises:
          JobNotFound: no job has this id.
          InvalidTransition: the job has finished (succeeded, failed or cancelled).
        """
        by = clean_text(by) or "unknown"
        with self.pool.use(conn) as c, c.transaction():
            rows = self._fetch("abort_job", {"id": job_id, "by": by, "now": now}, c)
            if not rows:
                self._raise_for(job_id, "queued or running", "aborted", c)
            _, status, queue_name = rows[0]
            if status == "running":
                c.execute(
                    self.queries["notify_abort"],
                    {"channel": self.channel(queue_name), "payload": abort_payload(job_id)},
                )
            return self.get(job_id, conn=c)

    def finished_attempts(self, attempts: Sequence[Attempt], status: str, *, conn=None) -> set[str]:
        """The ids of ``attempts`` whose job already ended ``status`` at that attempt: the
        outcome an owner sent was written, though the reply was lost (the connection
        dropped as it committed), so its second try found the job no longer running."""
        if not attempts:
            return set()
        params = {**self._attempt_params(attempts), "status": status}
        return {str(r[0]) for r in self._fetch("finished_attempts", params, conn)}

    def abort_attempts(self, attempts: Sequence[Attempt], *, conn=None, now=None) -> set[str]:
        """running -> cancelled for attempts a worker stopped because their abort was
        requested (an ``aborted`` event each). Returns the ids changed: an attempt missing
        is no longer the caller's (or had no abort requested)."""
        if not attempts:
            return set()
        rows = self._fetch("abort_attempts", {**self._attempt_params(attempts), "now": now}, conn)
        return {str(r[0]) for r in rows}

    def cancel_skipped(
        self, attempts: Sequence[Attempt], skips: Sequence[dict[str, Any]], *, conn=None, now=None
    ) -> set[str]:
        """running -> cancelled for attempts whose message a middleware skipped without
        failing it (a ``cancelled`` event each, whose data is the attempt's skip:
        ``reason``, ``skipped_by``, ``message``). Returns the ids changed: an attempt
        missing is no longer the caller's."""
        if not attempts:
            return set()
        pairs = sorted(zip(attempts, skips), key=lambda pair: pair[0].id)
        params = {
            **self._attempt_params([attempt for attempt, _ in pairs]),
            "skips": [Jsonb(skip) for _, skip in pairs],
            "now": now,
        }
        return {str(r[0]) for r in self._fetch("cancel_skipped", params, conn)}

    def _raise_for(self, job_id: str, allowed: str, done: str, conn) -> None:
        job = self.get(job_id, conn=conn)
        raise InvalidTransition(job_id, job["status"], done, allowed)

    # -- reads -------------------------------------------------------------------------

    def get(self, job_id: str, *, conn=None) -> dict[str, Any]:
        """One job as a dict of its columns.

        Raises:
          JobNotFound: no job has this id.
        """
        with self.pool.use(conn) as c:
            cur = c.execute(self.queries["get_job"], {"id": job_id})
            row = cur.fetchone()
            if row is None:
                raise JobNotFound(f"no job with id {job_id}")
            return dict(zip([d.name for d in cur.description], row))

    def resolve_id(self, text: str, *, conn=None) -> str:
        """The id of the one job whose id is ``text`` or starts with it.

        A whole UUID (any form :class:`uuid.UUID` reads) is returned as it is, without a
        look-up. A prefix needs at least :data:`MIN_ID_PREFIX` hex characters (hyphens are
        ignored), such as the 8 characters the demo and ``jobs list`` show; it is resolved
        with one range scan of the primary key.

        Parameters:
          text(str): a job id, or its first characters.

        Raises:
          InvalidJobId: ``text`` is not hex, or is shorter than the minimum prefix.
          JobNotFound: no job id starts with it.
          AmbiguousJobId: several do; the error lists them.

        Returns:
          str: the job's id, in the canonical form.
        """
        bounds = id_prefix_range(text)
        if isinstance(bounds, str):
            return bounds
        low, high = bounds
        with self.pool.use(conn) as c:
            cur = c.execute(
                self.queries["find_job_ids"],
                {"low": low, "high": high, "limit": MAX_ID_CANDIDATES + 1},
            )
            names = [d.name for d in cur.description]
            rows = [dict(zip(names, row)) for row in cur.fetchall()]
        if not rows:
            raise JobNotFound(f"no job id starts with {text.strip()!r}")
        if len(rows) > 1:
            for row in rows:
                row["id"] = str(row["id"])
            more = len(rows) > MAX_ID_CANDIDATES
            raise AmbiguousJobId(text.strip(), rows[:MAX_ID_CANDIDATES], more)
        return str(rows[0]["id"])

    def events_of(self, job_id: str, *, conn=None) -> list[dict[str, Any]]:
        """A job's events, oldest first."""
        with self.pool.use(conn) as c:
            cur = c.execute(self.queries["get_job_events"], {"id": job_id})
            names = [d.name for d in cur.description]
            return [dict(zip(names, row)) for row in cur.fetchall()]

    def count_unfinished(self, queue_name: str, *, conn=None) -> int:
        """Jobs of a queue still waiting (delayed included) or running."""
        return self._fetch("count_unfinished", {"queue_name": queue_name}, conn)[0][0]

    def count_failed_since(self, queue_name: str, since: dt.datetime, *, conn=None) -> int:
        return self._fetch("count_failed_since", {"queue_name": queue_name, "since": since}, conn)[
            0
        ][0]

    def queue_counts(self, *, conn=None, now=None) -> dict[str, QueueCounts]:
        """Per queue, its waiting (runnable and delayed), running and failed jobs, and how
        long the oldest runnable one has waited: the one count the CLI's ``stats``, the
        admin API and its metrics all show. It reads the partial indexes on waiting,
        running and dead rows, never the finished rows of a big table, so it costs what
        the backlog costs, plus a count of the failed partitions of history. A queue with
        no unfinished or failed job does not appear."""
        params = {"now": now, "failed": True}
        return queue_counts_of(self._fetch("count_by_queue", params, conn))

    def flush(self, queue_name: str, *, conn=None) -> int:
        """Delete the waiting and running jobs of a queue; returns how many."""
        with self.pool.use(conn) as c:
            return c.execute(self.queries["flush_queue"], {"queue_name": queue_name}).fetchone()[0]
