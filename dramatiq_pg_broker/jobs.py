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

import dataclasses
import datetime as dt
import hashlib
import json
import math
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg.types.json import Jsonb

from .db import ProcessPool, Queries
from .errors import InvalidTransition, JobAlreadyFinished, JobNotFound


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
    max_attempts: int = 21
    idempotency_key: str | None = None
    message_view_from_bytes: bool = False
    idempotency_scope: str = ""
    #: False: the send's own commit does not wait for its WAL flush (see
    #: ``Settings.durable_sends``); ignored in a transaction the caller holds.
    durable: bool = True


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

    # -- plumbing ------------------------------------------------------------------------

    def _fetch(self, name: str, params: dict[str, Any], conn=None) -> list[tuple]:
        params.setdefault("now", None)
        params.setdefault("events", self.events)
        with self.pool.use(conn) as c:
            return c.execute(self.queries[name], params).fetchall()

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
            return self._insert_one(c, job, params, again)

    def _insert_one(
        self, c: psycopg.Connection, job: NewJob, params: dict[str, Any], again: bool
    ) -> EnqueueResult:
        row = c.execute(self.queries["insert_job"], params).fetchone()
        if row is not None:
            return EnqueueResult(job.id, True, "queued", job.message, job.message_bytes)
        return self._not_inserted(c, job, params, again)

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
        results: list[EnqueueResult | Exception] = []
        with self.pool.use() as c:
            try:
                inserted = {str(r[0]) for r in c.execute(self.queries["insert_jobs"], params)}
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
                    results.append(self._insert_one(c, job, self._new_job_params(job, None), again))
                except (JobAlreadyFinished, *_REFUSED) as e:
                    results.append(e)
        return results

    def _not_inserted(
        self, c: psycopg.Connection, job: NewJob, params: dict[str, Any], again: bool
    ) -> EnqueueResult:
        """What a send whose insert was a no-op gets: the job with its idempotency key, or
        the job with its id rescheduled (see :meth:`enqueue`)."""
        existing = c.execute(self.queries["find_existing"], params).fetchone()
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
    _STAGED_TYPES = (
        "text", "text", "text", "jsonb", "bytea", "bool", "int4", "int8", "int4", "text",
        "text", "int8",
    )  # fmt: skip

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
        with self.pool.use(conn) as c, c.transaction():
            if len(jobs) >= self.BULK_COPY_MIN and self._copy_new(c, jobs, now):
                queues = {job.queue_name for job in jobs}
                channels = sorted(self.channel(q) for q in queues)
                c.execute(self.queries["notify_queues"], {"channels": channels})
                return [
                    EnqueueResult(job.id, True, "queued", job.message, job.message_bytes)
                    for job in jobs
                ]
            return self._insert_resolving(c, jobs, now, again)

    def _insert_resolving(
        self, c: psycopg.Connection, jobs: Sequence[NewJob], now: dt.datetime | None, again: bool
    ) -> list[EnqueueResult]:
        """The bulk path that resolves conflicts row by row (ON CONFLICT DO NOTHING, then
        each job not inserted as :meth:`enqueue` does)."""
        results: list[EnqueueResult | None] = [None] * len(jobs)
        queues: set[str] = set()
        for start in range(0, len(jobs), self.BULK_CHUNK):
            chunk = jobs[start : start + self.BULK_CHUNK]
            if len(chunk) >= self.BULK_COPY_MIN:
                rows = self._insert_staged(c, chunk, now)
            else:
                rows = c.execute(
                    self.queries["insert_jobs"], self._bulk_params(chunk, now)
                ).fetchall()
            inserted = {str(r[0]) for r in rows}
            for offset, job in enumerate(chunk):
                if job.id in inserted:
                    inserted.discard(job.id)  # a repeated id inserts once
                    results[start + offset] = EnqueueResult(
                        job.id, True, "queued", job.message, job.message_bytes
                    )
                    queues.add(job.queue_name)
        for index, job in enumerate(jobs):
            if results[index] is not None:
                continue
            params = self._new_job_params(job, now)
            try:
                results[index] = result = self._not_inserted(c, job, params, again)
            except JobAlreadyFinished as e:
                e.args = (f"message {index} of the batch: {e}",)
                raise
            if result.rescheduled:
                queues.add(job.queue_name)
        if queues:
            channels = sorted(self.channel(q) for q in queues)
            c.execute(self.queries["notify_queues"], {"channels": channels})
        return results  # type: ignore[return-value]

    #: Rows per COPY statement of the direct bulk path (measured on 100,000 messages: 2,500
    #: and 5,000 were alike, 10,000 slower, since the first and last chunks are not
    #: overlapped with encoding).
    COPY_CHUNK = 5_000
    #: How much of the next chunk is encoded while the server inserts the current chunk's
    #: jobs, in percent; the rest is encoded while it inserts their events. Measured: the
    #: job rows take longer (five indexes and the jsonb view) than the events.
    COPY_SPLIT = 80

    def _copy_new(
        self, c: psycopg.Connection, jobs: Sequence[NewJob], now: dt.datetime | None
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
        fields: dict[str, bytes] = {}
        seen: set[str] = set()
        total = len(jobs)

        def build(start: int, stop: int, job_rows: list[bytes], event_rows: list[bytes]):
            updated = _TIMESTAMP.pack(8, now_us)
            for position in range(start, stop):
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
                                now_us + max(0, int(job.delay_ms)) * 1000,
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
                cur = c.cursor()
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
                    with cur.copy(self.queries["copy_jobs"]) as copy:
                        copy.write(block(job_rows))
                        # Encoded while the server inserts the rows just sent.
                        build(stop, split if self.events else following, next_jobs, next_events)
                    if self.events:
                        with cur.copy(self.queries["copy_created_events"]) as copy:
                            copy.write(block(event_rows))
                            build(split, following, next_jobs, next_events)
                    job_rows, event_rows, start = next_jobs, next_events, stop
        except (psycopg.errors.UniqueViolation, _RepeatedId):
            return False
        return True

    def _insert_staged(
        self, c: psycopg.Connection, jobs: Sequence[NewJob], now: dt.datetime | None
    ) -> list[tuple]:
        c.execute(self.queries["stage_jobs"])
        with c.cursor().copy(self.queries["copy_staged_jobs"]) as copy:
            copy.set_types(self._STAGED_TYPES)
            for position, j in enumerate(jobs, 1):
                copy.write_row(
                    (
                        j.id,
                        j.queue_name,
                        j.actor_name,
                        Jsonb(j.message) if j.message is not None else None,
                        j.message_bytes,
                        j.message_view_from_bytes,
                        j.priority,
                        max(0, int(j.delay_ms)),
                        j.max_attempts,
                        j.idempotency_key,
                        j.idempotency_scope,
                        position,
                    )
                )
        rows = c.execute(
            self.queries["insert_staged_jobs"], {"now": now, "events": self.events}
        ).fetchall()
        c.execute(self.queries["drop_staged_jobs"])
        return rows

    def _bulk_params(self, jobs: Sequence[NewJob], now: dt.datetime | None) -> dict[str, Any]:
        return {
            "ids": [j.id for j in jobs],
            "queue_names": [j.queue_name for j in jobs],
            "actor_names": [j.actor_name for j in jobs],
            "messages": [Jsonb(j.message) if j.message is not None else None for j in jobs],
            "message_bytes": [j.message_bytes for j in jobs],
            "view_from_bytes": [j.message_view_from_bytes for j in jobs],
            "priorities": [j.priority for j in jobs],
            "delays_ms": [max(0, int(j.delay_ms)) for j in jobs],
            "max_attempts": [j.max_attempts for j in jobs],
            "idempotency_keys": [j.idempotency_key for j in jobs],
            "idempotency_scopes": [j.idempotency_scope for j in jobs],
            "channels": [],
            "durable": True,
            "now": now,
            "events": self.events,
        }

    def _new_job_params(self, job: NewJob, now: dt.datetime | None) -> dict[str, Any]:
        return {
            "id": job.id,
            "queue_name": job.queue_name,
            "actor_name": job.actor_name,
            "message": Jsonb(job.message) if job.message is not None else None,
            "message_bytes": job.message_bytes,
            "view_from_bytes": job.message_view_from_bytes,
            "priority": job.priority,
            "delay_ms": max(0, int(job.delay_ms)),
            "max_attempts": job.max_attempts,
            "idempotency_key": job.idempotency_key,
            "idempotency_scope": job.idempotency_scope,
            "channel": self.channel(job.queue_name),
            "durable": job.durable,
            "now": now,
            "events": self.events,
        }

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
        rows = self._fetch(
            "claim_jobs",
            {
                "queue_name": queue_name,
                "limit": limit,
                "owner": owner,
                "lease_ms": _ms(lease_seconds),
                "now": now,
            },
            conn,
        )
        if len(rows) == 1 and rows[0][0] is None:
            left = rows[0][11]
            return Claim(
                [], rows[0][9], rows[0][8], math.inf if left is None else left, bool(rows[0][13])
            )
        return Claim([ClaimedJob(str(r[0]), *r[1:8], abort_requested=r[12]) for r in rows])

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
        conn=None,
        now=None,
    ) -> bool:
        """running -> queued, runnable after ``delay_ms`` (a retry). The attempt stays
        charged. Passing ``message`` or ``message_bytes`` replaces the stored message."""
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
        if not queue_names:
            return
        with self.pool.use(conn) as c:
            for queue_name in sorted(queue_names):
                c.execute(self.queries["notify_queue"], {"channel": self.channel(queue_name)})

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
        """
        rows = self._fetch("retry_failed", {"id": job_id, "by": by, "now": now}, conn)
        if not rows:
            self._raise_for(job_id, "failed", "retried", conn)
        with self.pool.use(conn) as c:
            c.execute(self.queries["notify_queue"], {"channel": self.channel(rows[0][1])})
        return self.get(job_id, conn=conn)

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

    def abort_attempts(self, attempts: Sequence[Attempt], *, conn=None, now=None) -> set[str]:
        """running -> cancelled for attempts a worker stopped because their abort was
        requested (an ``aborted`` event each). Returns the ids changed: an attempt missing
        is no longer the caller's (or had no abort requested)."""
        if not attempts:
            return set()
        rows = self._fetch("abort_attempts", {**self._attempt_params(attempts), "now": now}, conn)
        return {str(r[0]) for r in rows}

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

    def flush(self, queue_name: str, *, conn=None) -> int:
        """Delete the waiting and running jobs of a queue; returns how many."""
        with self.pool.use(conn) as c:
            return c.execute(self.queries["flush_queue"], {"queue_name": queue_name}).rowcount
