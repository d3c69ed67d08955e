"""The send path's writes: one job, a batch (checked against history), a bulk
enqueue through COPY or a staging table."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from ..errors import JobAlreadyFinished, JobNotFound
from .base import StoreBase, _execute
from .copy_rows import (
    _COPY_HEADER,
    _COPY_TRAILER,
    _CREATED_EVENT_MIDDLE,
    _EVENT_ROW_START,
    _JOB_ROW_MIDDLE,
    _JOB_ROW_START,
    _LENGTH,
    _NULL_FIELD,
    _QUEUED_FIELD,
    _TIMESTAMP,
    _buffering_writer,
    _text_field,
    _timestamp_us,
)
from .rows import (
    SEND_FIELDS,
    SEND_NAMES,
    UNIQUE_SCOPE,
    EnqueueResult,
    NewJob,
    _delay_ms,
    send_values,
)

#: What the server raises for a row it refuses (a constraint, a value it cannot store), as
#: opposed to a lost connection.
_REFUSED = (psycopg.DataError, psycopg.IntegrityError, psycopg.ProgrammingError)

#: The isolation levels (``transaction_isolation``) whose snapshot is taken once for the
#: whole transaction: a send's look-up of history can then miss a job that was sent, run
#: and finished after it (see :meth:`JobStore._confirm_new`).
SNAPSHOT_LEVELS = frozenset({"repeatable read", "serializable"})


def _nothing() -> None:
    pass


class _RepeatedId(Exception):
    """Two jobs of one bulk enqueue share an id: the staged path resolves it."""


@dataclass(frozen=True)
class _Send:
    """One job as the single-send path writes it, and what decides its fate on a
    conflict: the parameters of its statements, ``again`` (see
    :meth:`SendWrites.enqueue`), ``pooled`` (the connection is the broker's own: an
    autocommit statement or a transaction begun READ COMMITTED, see
    :meth:`SendWrites._confirm_new`), and ``key_released`` (a stale idempotency key was
    already freed for it: it is sent once more at most)."""

    job: NewJob
    params: dict[str, Any]
    again: bool
    pooled: bool
    key_released: bool = False


class SendWrites(StoreBase):
    """The writes of the send path (a part of :class:`~.store.JobStore`)."""

    # -- transitions -------------------------------------------------------------------

    def enqueue(
        self,
        job: NewJob,
        *,
        conn: psycopg.Connection | None = None,
        now: dt.datetime | None = None,
        again: bool = True,
        notify: bool = True,
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
        - ``notify=False``: the statement does not wake the queue's consumers (the caller
          has them woken once the row is committed, see :mod:`~..sending.notifier`).

        Raises:
          JobAlreadyFinished: a job with the same id already finished.
        """
        params = self._new_job_params(job, now, notify)
        if conn is not None:
            # The caller's transaction: its commit is the caller's to make durable or not.
            params["durable"] = True
        with self.pool.use(conn) as c:
            return self._insert_one(c, _Send(job, params, again, pooled=conn is None))

    def _insert_one(self, c: psycopg.Connection, send: _Send) -> EnqueueResult:
        job = send.job
        row = self._probing(c, "insert_job", send.params, job.sent_at_ms, send.pooled).fetchone()
        if row is not None:
            self._confirm_new(c, [job], row[2], send.pooled)
            return EnqueueResult(job.id, True, "queued", job.message, job.message_bytes)
        return self._not_inserted(c, send)

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

    def send_many(
        self, sends: Sequence[tuple[NewJob, bool]], *, notify: bool = True
    ) -> list[EnqueueResult | Exception]:
        """Single sends of several threads written together (group commit): one autocommit
        statement inserts them all, with their ``created`` events, and wakes their queues
        (unless ``notify`` is False, see :meth:`enqueue`); a send whose job conflicts with
        a stored one is then handled alone, as :meth:`enqueue` handles it. ``sends`` pairs
        each job with its ``again`` (see :meth:`enqueue`). The commit is durable unless no
        send in the group asked for it.

        Returns:
          list: in the order of ``sends``, each send's result, or the error that only this
          send raised (``JobAlreadyFinished``, or the server refusing its row).

        Raises:
          dramatiq.errors.ConnectionError: the statement could not be written; whether it
            committed is unknown, so every send of the group is retried as a whole.
        """
        jobs = [job for job, _ in sends]
        params = self._bulk_params(jobs, None)
        if notify:
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
                    params = self._new_job_params(job, None, notify)
                    alone = _Send(job, params, again, pooled=True)
                    results.append(self._insert_one(c, alone))
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
        self._refuse(
            c,
            f"job {', '.join(found)} was sent or finished after this {isolation} "
            "transaction's snapshot was taken, so sending its message again would give the "
            "id a second row: nothing was sent; retry the transaction",
        )

    def _refuse(self, c: Any, why: str) -> None:
        """Abort the application's transaction on ``c`` with a serialization failure that
        says ``why`` (SQLSTATE 40001: frameworks and applications retry it)."""
        try:
            c.execute(self.queries["refuse_send"])
        except psycopg.errors.SerializationFailure as e:
            raise psycopg.errors.SerializationFailure(why) from e
        raise AssertionError("refuse_send did not raise")  # pragma: no cover

    def _refuse_unseen_emptying(self, c: Any, send: _Send) -> None:
        """When a send frees a key because its job is nowhere to be seen: refuse it in an
        application's transaction whose snapshot predates the last emptying of a lane of
        jobs (0028), which sees the emptied lane empty and not the rows copied out of it.
        The broker's own sends are READ COMMITTED: nothing to do."""
        if send.pooled:
            return
        with self.pool.connection() as other:
            xids = [r[0] for r in other.execute(self.queries["lane_emptyings"])]
        if xids and c.execute(self.queries["unseen_emptyings"], {"xids": xids}).fetchone()[0]:
            self._refuse(
                c,
                f"the key of job {send.job.id} is held by a job this transaction's snapshot "
                "cannot see (a lane of the jobs table was emptied after it was taken): "
                "nothing was sent; retry the transaction",
            )

    def _not_inserted(self, c: psycopg.Connection, send: _Send) -> EnqueueResult:
        """What a send whose insert was a no-op gets: the job with its idempotency key, or
        the job with its id rescheduled (see :meth:`enqueue`)."""
        job, params, again = send.job, send.params, send.again
        if job.idempotency_scope == UNIQUE_SCOPE and not send.key_released:
            # A unique job's key is freed when its job ends; one still held by a job that
            # ended (its period ran past the end, or an older worker ended it) is freed
            # here once it may be, and the send inserts again.
            if c.execute(self.queries["release_unique_key"], params).fetchone() is not None:
                # Freed because its job is nowhere to be seen: unless the snapshot is too
                # old to tell (the refusal undoes the release with the transaction).
                self._refuse_unseen_emptying(c, send)
                return self._insert_one(c, replace(send, key_released=True))
        existing = c.execute(self.queries["find_existing"], params).fetchone()
        if existing is None and job.idempotency_key is not None and not send.key_released:
            # The key's job was deleted by hand (not by retention or flush, which free its
            # key): free the key and send once more.
            self._refuse_unseen_emptying(c, send)
            c.execute(self.queries["release_stale_key"], params)
            return self._insert_one(c, replace(send, key_released=True))
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
        notify: bool = True,
    ) -> list[EnqueueResult]:
        """Store many messages in one transaction (a savepoint inside the caller's, on
        ``conn``): all of them or, if anything fails, none. Each job is handled as
        :meth:`enqueue` handles one (``notify`` too); results are in the order of ``jobs``.

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
                    return self._enqueue_many(c, jobs, now, again, pooled, notify)
            # The broker's own transaction begins READ COMMITTED whatever the server's
            # default_transaction_isolation: each statement's snapshot then sees every move
            # to history committed before it (see _confirm_new). The pooled connection gets
            # its setting back (a pool passed in is the application's).
            previous = c.isolation_level
            c.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
            try:
                with c.transaction():
                    return self._enqueue_many(c, jobs, now, again, pooled, notify)
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
        notify: bool = True,
    ) -> list[EnqueueResult]:
        """:meth:`enqueue_many` inside its transaction (or savepoint) on ``c``."""
        if (
            self.DIRECT_COPY
            and len(jobs) >= self.BULK_COPY_MIN
            and self._copy_new(c, jobs, now, pooled)
        ):
            if notify:
                queues = {job.queue_name for job in jobs}
                channels = sorted(self.channel(q) for q in queues)
                c.execute(self.queries["notify_queues"], {"channels": channels})
            return [
                EnqueueResult(job.id, True, "queued", job.message, job.message_bytes)
                for job in jobs
            ]
        return self._insert_resolving(c, jobs, now, again, pooled, notify)

    def _insert_resolving(
        self,
        c: psycopg.Connection,
        jobs: Sequence[NewJob],
        now: dt.datetime | None,
        again: bool,
        pooled: bool = False,
        notify: bool = True,
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
            send = _Send(job, self._new_job_params(job, now, notify), again, pooled)
            try:
                results[index] = result = self._not_inserted(c, send)
            except JobAlreadyFinished as e:
                e.args = (f"message {index} of the batch: {e}",)
                raise
            if result.rescheduled:
                queues.add(job.queue_name)
        if queues and notify:
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
                else:
                    # None, or the bytes are JSON that jsonb holds as it is (see
                    # messages.encode): all_jobs parses them on read (migration 0018).
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
                            _QUEUED_FIELD,
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
                in_history, isolation = self._copied_in_history(c, jobs, now)
                if in_history:
                    raise _RepeatedId("a job's id or idempotency key is in history")
                self._confirm_new(c, jobs, isolation, pooled)
        except (psycopg.errors.UniqueViolation, _RepeatedId):
            return False
        return True

    def _copied_in_history(
        self, c: psycopg.Connection, jobs: Sequence[NewJob], now: dt.datetime | None = None
    ) -> tuple[bool, str]:
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
                    "key_periods": [job.unique_for_ms for job in keyed],
                    "now": now,
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

    def _new_job_params(
        self, job: NewJob, now: dt.datetime | None, notify: bool = True
    ) -> dict[str, Any]:
        """The parameters of ``insert_job`` (and of ``find_existing``, ``reenqueue_job``);
        no channel when the statements are not to notify."""
        params: dict[str, Any] = dict(zip(SEND_NAMES, send_values(job)))
        params.update(
            channel=self.channel(job.queue_name) if notify else None,
            durable=job.durable,
            now=now,
            events=self.events,
        )
        return params
