"""PostgresBroker: a Dramatiq broker that stores every message as a job row.

Swap one line::

    from dramatiq_pg_broker import PostgresBroker
    dramatiq.set_broker(PostgresBroker(url="postgresql://app@db/app"))

and run workers with the standard CLI (``dramatiq your_module``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import dramatiq
import psycopg
from dramatiq.errors import BrokerConnectionError, QueueJoinTimeout
from dramatiq.middleware import Middleware, MiddlewareError
from dramatiq.middleware.retries import Retries as DramatiqRetries
from psycopg_pool import ConnectionPool, PoolTimeout

from . import forks, messages, sending
from .config import Settings
from .consumer import PgMessageProxy, PostgresConsumer, describe_error
from .current import AbortGuard, JobContext, current_job
from .db import ProcessPool
from .errors import InvalidMessage, PgBrokerError, TransactionError
from .inflight import Ledger, State, _GroupCommit
from .jobs import EnqueueResult, JobStore, NewJob, clean_text
from .leases import LeaseKeeper
from .outcomes import OutcomeWriter
from .periodic import Periodic, Schedule
from .retries import Retries
from .workers import Presence

logger = logging.getLogger(__name__)

#: Largest max_attempts a job row takes when an actor allows unlimited retries.
UNLIMITED_ATTEMPTS = messages.UNLIMITED_ATTEMPTS


class JobFailed(PgBrokerError):
    """A job of the joined queue failed while ``join(fail_fast=True)`` waited."""


class PostgresBroker(dramatiq.Broker):
    """A Dramatiq broker backed by PostgreSQL job rows.

    Construction does no I/O: the connection pool opens on first use, once per process
    (the ``dramatiq`` CLI imports the broker module in each forked worker).

    Parameters:
      url(str): PostgreSQL URL. Default: ``DRAMATIQ_PG_URL``; with neither, the embedded
        local server (``pgserver``) is started, for development only.
      pool(ConnectionPool): a ready psycopg pool to use instead of opening one (it must
        open autocommit connections).
      schema(str): schema of the job tables (``DRAMATIQ_PG_SCHEMA``, default ``dramatiq``).
      listen(bool): wake idle consumers with LISTEN/NOTIFY (default True). Use False behind
        PgBouncer in transaction mode; consumers then poll every ``poll_interval``. Pass
        ``prepared_statements=False`` there as well.
      lease_seconds(float): how long a claim holds without renewal (default 30).
      middleware(list[Middleware]): as for any Dramatiq broker. With the default
        middleware, Dramatiq's Retries is replaced by this package's, which reschedules the
        same row. A middleware list you pass is kept as it is.
      schedules(list[Schedule]): periodic schedules the workers run (see
        :mod:`dramatiq_pg_broker.periodic`; ``@periodic`` above an actor adds to it).
      settings(Settings): every other knob (see :class:`Settings`); keyword arguments win.
      **options: any other :class:`Settings` field (``poll_interval``, ``events``, ...).
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        pool: ConnectionPool | None = None,
        schema: str | None = None,
        listen: bool | None = None,
        lease_seconds: float | None = None,
        middleware: list[Middleware] | None = None,
        schedules: list[Schedule] | None = None,
        settings: Settings | None = None,
        **options: Any,
    ) -> None:
        given = {"url": url, "schema": schema, "listen": listen, "lease_seconds": lease_seconds}
        given.update(options)
        if settings is not None:
            import dataclasses

            settings = dataclasses.replace(
                settings, **{k: v for k, v in given.items() if v is not None}
            )
        else:
            settings = Settings.load(**given)
        self.settings = settings
        if settings.log_level:
            logging.getLogger("dramatiq_pg_broker").setLevel(settings.log_level.upper())

        if middleware is None:
            middleware = [m() for m in dramatiq.middleware.default_middleware]
            middleware = [Retries() if type(m) is DramatiqRetries else m for m in middleware]
        super().__init__(middleware=middleware)
        for m in self.middleware:
            if isinstance(m, Retries):
                m.configure(settings.backoff_base_ms, settings.backoff_max_ms)
        # First, so that a message this process no longer owns is skipped before any
        # other middleware sees it start.
        first = type(self.middleware[0]) if self.middleware else None
        self.add_middleware(JobContext(), before=first)
        self.schedules: list[Schedule] = []
        self.periodic = Periodic()
        self.add_middleware(self.periodic)
        #: This process in the worker registry (see :mod:`.workers`).
        self.presence = Presence()
        self.add_middleware(self.presence)
        # Last, so that its after-hooks run first (see AbortGuard).
        self.add_middleware(AbortGuard())

        self.queues: dict[str, None] = {}
        self.pool = ProcessPool(settings, pool=pool)
        self.store = JobStore(self.pool, settings.schema, events=settings.events)
        self.leases = LeaseKeeper(self)
        self.outcomes = OutcomeWriter(self)
        #: Every attempt this process holds: the one owner of their states.
        self.ledger = Ledger(self)
        self._consumers_lock = threading.Lock()
        self._sends = sending.SendContext()
        #: Concurrent sends through the pool share a statement (see _send); per process.
        self._group = _GroupCommit(self._write_sends)
        self._group_pid = forks.pid()
        self._identity: tuple | None = None
        for schedule in schedules or ():
            self.add_schedule(schedule)

    def add_schedule(self, schedule: Schedule) -> None:
        """Run ``schedule`` in the workers (what ``@periodic`` above an actor does).

        Raises:
          ConfigurationError: another schedule has the same name.
        """
        from .periodic import add_schedule

        add_schedule(self, schedule)

    # -- declaring -----------------------------------------------------------------------

    def declare_queue(self, queue_name: str) -> None:
        """Declare a queue. No I/O: a queue is just a ``queue_name`` on job rows."""
        if queue_name not in self.queues:
            self.emit_before("declare_queue", queue_name)
            self.queues[queue_name] = None
            self.emit_after("declare_queue", queue_name)

    # -- sending -------------------------------------------------------------------------

    def decode_message(self, data: Any, data_bytes: bytes | None) -> dramatiq.Message:
        """Rebuild a message from its row (see :func:`dramatiq_pg_broker.messages.decode`)."""
        return messages.decode(data, data_bytes)

    def default_max_retries(self) -> int | None:
        """``max_retries`` of an actor that sets none: the Retries middleware's, else the
        ``max_attempts`` setting's."""
        retries = next((m for m in self.middleware if isinstance(m, DramatiqRetries)), None)
        return retries.max_retries if retries is not None else self.settings.max_attempts - 1

    def job_for(
        self, message: dramatiq.Message, delay: int | None = None
    ) -> tuple[NewJob, dramatiq.Message]:
        """The job row a send of ``message`` writes, and the message as stored.

        Raises:
          InvalidMessage: an option is out of range, or the encoder cannot encode a value.
        """
        actor = self.actors.get(message.actor_name)
        return messages.job_from_message(
            message,
            delay=delay,
            actor_priority=actor.priority if actor is not None else 0,
            actor_options=actor.options if actor is not None else None,
            default_max_retries=self.default_max_retries(),
            durable=self.settings.durable_sends,
        )

    def enqueue(self, message: dramatiq.Message, *, delay: int | None = None) -> dramatiq.Message:
        """Store a message as a queued job row and wake the queue's consumers.

        ``delay`` (milliseconds) or an ``eta`` option (epoch milliseconds) sets
        ``available_at``; no delay queue exists and no worker holds delayed messages in
        memory. Priority is the actor's ``priority``, overridable per message with the
        ``priority`` option; lower runs first. The ``idempotency_key`` option makes a second
        send of the same actor with the same key return the first job's message instead of
        a new job.

        The send returns once its row is committed, and flushed to the server's WAL unless
        the message's ``durable`` option (default: the ``durable_sends`` setting) is False.
        Sends through the pool from several threads at once share statements and commits
        (see :meth:`_send`).

        Enqueueing a message whose id is already a job (``message.copy()``, as snooze
        patterns and Dramatiq's own Retries do) reschedules that row if it is waiting or
        running, with the new message and delay; a running attempt in this thread is
        settled so that its ack writes nothing.

        Raises:
          InvalidMessage: an option is out of range (``priority``, ``delay``, ``eta``,
            ``max_retries``, ``idempotency_key``) or the encoder cannot encode a value.
          JobAlreadyFinished: the message's id is a job that already finished.
          dramatiq.errors.ConnectionError: the database stayed unreachable after
            ``enqueue_retries`` attempts.
        """
        self.emit_before("enqueue", message, delay)
        proxy = self._in_flight(message)
        if proxy is not None and isinstance(proxy.options.get("traceback"), str):
            # Dramatiq's formatted traceback repeats the error text, which may hold
            # characters a stored message cannot (NUL, lone surrogates).
            proxy.options["traceback"] = clean_text(proxy.options["traceback"])
        job, stored = self.job_for(message, delay)

        if proxy is not None:
            delay_ms = job.delay_ms
            if message is proxy and proxy.backoff_ms is not None:
                # A retry by this package's Retries: its deterministic backoff.
                delay_ms = proxy.backoff_ms
            error = describe_error(proxy) if proxy._exception is not None else None
            self.reschedule(proxy, delay_ms, error, replace_message=True, new_message=stored)
            self.emit_after("enqueue", message, delay)
            return message

        block = self._sends.top()
        if isinstance(block, sending.Batch):
            block.add(job, stored, delay)
            return stored
        if block is not None:
            # The application's transaction: no retry (a failed statement aborts it).
            result = self.store.enqueue(job, conn=block.conn)
        else:
            result = self._with_retries(self._retried(lambda again: self._send(job, again)))
        if not result.created and result.id != job.id:
            logger.debug(
                "Idempotency key %r already used by job %s.", job.idempotency_key, result.id
            )
            stored = self.decode_message(result.message, result.message_bytes)
        self.emit_after("enqueue", stored, delay)
        return stored

    def _send(self, job: NewJob, again: bool) -> EnqueueResult:
        """Write one send through the pool, sharing the statement and its commit with the
        sends other threads are making at the same moment (group commit): a send finding no
        write in progress writes at once, alone (one round trip); sends arriving while one
        is written wait for it, then go together in one statement. Each returns once its
        row is committed, durably unless it asked otherwise."""
        group = self._group
        if self._group_pid != forks.pid():
            with self._consumers_lock:
                if self._group_pid != forks.pid():
                    # A forked child shares no write in progress with its parent.
                    self._group = group = _GroupCommit(self._write_sends)
                    self._group_pid = forks.pid()
                group = self._group
        item = (job, again)
        result = group.submit(item)[id(item)]
        if isinstance(result, BaseException):
            raise result
        return result

    def _write_sends(self, items: list[tuple[NewJob, bool]]) -> dict[int, Any]:
        if len(items) == 1:
            job, again = items[0]
            return {id(items[0]): self.store.enqueue(job, again=again)}
        return {id(item): result for item, result in zip(items, self.store.send_many(items))}

    @staticmethod
    def _retried(fn):
        """``fn(again)`` for :meth:`_with_retries`: ``again`` is False after the first try,
        whose commit may have happened (a lost reply), so that its own row is returned as it
        is instead of being taken for a second send of the same id."""
        first = [True]

        def attempt():
            again, first[0] = first[0], False
            return fn(again)

        return attempt

    def enqueue_many(
        self, messages: Iterable[dramatiq.Message], *, delay: int | None = None
    ) -> list[dramatiq.Message]:
        """Send many messages in one transaction: from 200 messages on, COPY straight into
        the jobs table (and the ``created`` events into theirs), each message checked and
        encoded while the server writes the ones before it; smaller batches, and any batch
        in which a message conflicts with a stored job (an idempotency key or id already
        used, an id repeated), are written with one statement per 10,000 messages that
        resolves the conflicts. Each message is handled as :meth:`enqueue` handles one
        (idempotency keys, priorities, delays, re-enqueued ids); nothing is written if any
        message is refused.

        Inside :meth:`batch`, the messages join the batch; inside :meth:`transaction`, they
        are written in the application's transaction.

        Returns:
          list[Message]: the stored messages in order (for an idempotency key already used,
          the existing job's message).

        Raises:
          InvalidMessage: message ``i`` is refused (the error names ``i``).
          JobAlreadyFinished: message ``i``'s id is a job that already finished.
        """
        messages = list(messages)
        before = self._emitter("before", "enqueue")
        job_for = self._job_builder()
        stored: list[dramatiq.Message] = [None] * len(messages)  # type: ignore[list-item]

        def build(index: int) -> NewJob:
            message = messages[index]
            before(message, delay)
            try:
                job, stored[index] = job_for(message, delay)
            except InvalidMessage as e:
                raise InvalidMessage(f"message {index} of the batch: {e}") from e
            return job

        jobs = sending.LazyJobs(len(messages), build)
        block = self._sends.top()
        if isinstance(block, sending.Batch):
            for index, job in enumerate(jobs):
                block.add(job, stored[index], delay)
            return list(stored)
        conn = block.conn if block is not None else None
        return self._write_batch(jobs, stored, [delay] * len(messages), conn)

    def _write_batch(
        self,
        jobs: Sequence[NewJob],
        stored: list[dramatiq.Message],
        delays: list[int | None],
        conn: psycopg.Connection | None,
    ) -> list[dramatiq.Message]:
        if conn is not None:
            results = self.store.enqueue_many(jobs, conn=conn)
        else:
            results = self._with_retries(
                self._retried(lambda again: self.store.enqueue_many(jobs, again=again))
            )
        after = self._emitter("after", "enqueue")
        sent = []
        for job, message, delay, result in zip(jobs, stored, delays, results):
            if not result.created and result.id != job.id:
                message = self.decode_message(result.message, result.message_bytes)
            after(message, delay)
            sent.append(message)
        return sent

    def _job_builder(self):
        """:meth:`job_for`, with what does not change within one batch looked up once."""
        default_max_retries = self.default_max_retries()
        durable = self.settings.durable_sends
        actors = self.actors

        def job_for(message: dramatiq.Message, delay: int | None):
            actor = actors.get(message.actor_name)
            return messages.job_from_message(
                message,
                delay=delay,
                actor_priority=actor.priority if actor is not None else 0,
                actor_options=actor.options if actor is not None else None,
                default_max_retries=default_max_retries,
                durable=durable,
            )

        return job_for

    def _emitter(self, when: str, signal: str):
        """``emit_before(signal, ...)`` or ``emit_after``, as Dramatiq's broker runs them,
        over only the middleware that define that hook: a batch of 100,000 messages
        otherwise spends a good part of its time calling the base class's empty hooks."""
        name = f"{when}_{signal}"
        base = getattr(Middleware, name)
        order = self.middleware if when == "before" else list(reversed(self.middleware))
        hooks = [
            (m, getattr(m, name))
            for m in order
            if getattr(type(m), name, base) is not base or name in getattr(m, "__dict__", {})
        ]

        def emit(*args: Any) -> None:
            for middleware, hook in hooks:
                try:
                    hook(self, *args)
                except MiddlewareError:
                    if when == "before":
                        raise
                    self.logger.critical(
                        "Unexpected failure in %s of %r.", name, middleware, exc_info=True
                    )
                except Exception:
                    self.logger.critical(
                        "Unexpected failure in %s of %r.", name, middleware, exc_info=True
                    )

        return emit

    @contextlib.contextmanager
    def batch(self) -> Iterator[sending.Batch]:
        """Collect every send of this thread in the block, and write them together at its
        end (see :meth:`enqueue_many`): a loop of ``actor.send()`` or a
        ``group([...]).run()`` becomes one round trip.

        A send in the block returns its message at once, before it is written; a send whose
        idempotency key is already used still returns its own message (the existing job is
        what is stored). If the block raises, nothing is written. A batch block inside
        another joins it; inside :meth:`transaction`, the batch is written in that
        transaction.

        Raises:
          InvalidMessage: at the send that is refused (nothing of the block is written).
          JobAlreadyFinished: at the end of the block, naming the message's index.
        """
        top = self._sends.top()
        if isinstance(top, sending.Batch):
            yield top
            return
        batch = sending.Batch()
        with self._sends.pushed(batch):
            yield batch
            conn = self._sends.connection_below(batch)
        if batch.jobs:
            self._write_batch(batch.jobs, batch.messages, batch.delays, conn)

    @contextlib.contextmanager
    def transaction(self, conn: Any) -> Iterator[psycopg.Connection]:
        """Send inside the application's own transaction: every send of this thread in the
        block is written on ``conn``, so the job commits with the application's writes
        (and its NOTIFY reaches workers at that commit) or disappears with a rollback.

        ``conn`` is a psycopg 3 ``Connection`` (autocommit or not): the block is then
        ``conn.transaction()``, which begins a transaction and commits it at the end of the
        block (or rolls it back if the block raises), or is a savepoint when a transaction
        is already open on ``conn``. Or a SQLAlchemy 2 ``Session`` or ``Connection`` on the
        ``postgresql+psycopg`` driver: the sends join its transaction (begun if needed),
        which the application commits or rolls back as usual.

        Blocks nest (the innermost one's connection is used). The block belongs to the
        thread (or asyncio task) that entered it: sends from other threads go through the
        broker's pool as usual.

        Yields:
          psycopg.Connection: the connection the sends are written on.

        Raises:
          TransactionError: ``conn`` is not one of the above, or reaches another database
            (another name or another server) than the broker's.
        """
        pg_conn, own = sending.resolve_connection(conn)
        with pg_conn.transaction() if own else contextlib.nullcontext():
            self._check_database(pg_conn)
            with self._sends.pushed(sending.Transaction(pg_conn)):
                yield pg_conn

    def _check_database(self, conn: psycopg.Connection) -> None:
        if self._identity is None:
            with self.pool.connection() as pooled:
                self._identity = sending.identity(pooled)
        theirs = sending.identity(conn)
        if theirs != self._identity:
            where = (
                f"database {theirs[0]!r}"
                if theirs[0] != self._identity[0]
                else f"a database {theirs[0]!r} on another server"
            )
            raise TransactionError(
                f"the connection given to broker.transaction() reaches {where}, but this "
                f"broker's jobs are in database {self._identity[0]!r} of its own server "
                "(its url); a transaction cannot span two databases"
            )

    def _in_flight(self, message: dramatiq.Message) -> PgMessageProxy | None:
        """The unsettled attempt of this message that this thread is running, if any."""
        if isinstance(message, PgMessageProxy):
            return message if self.ledger.state_of(message.attempt) is State.STARTED else None
        job = current_job()
        if (
            job is not None
            and job.id == message.message_id
            and self.ledger.state_of(job.message.attempt) is State.STARTED
        ):
            return job.message
        return None

    def _with_retries(self, fn):
        delay = 0.05
        for attempt in range(self.settings.enqueue_retries + 1):
            try:
                return fn()
            except BrokerConnectionError as e:
                # A pool timeout means the pool already spent its whole timeout trying to
                # get a connection; asking again would only multiply that wait.
                if attempt >= self.settings.enqueue_retries or isinstance(e.__cause__, PoolTimeout):
                    raise
                logger.warning("Enqueue failed on a connection error; retrying in %.2fs.", delay)
                time.sleep(delay)
                delay *= 4

    def reschedule(
        self,
        message: PgMessageProxy,
        delay_ms: int,
        error: str | None,
        *,
        replace_message: bool = False,
        new_message: dramatiq.Message | None = None,
    ) -> bool:
        """Move a running message's row back to queued, runnable in ``delay_ms``. The
        following ack or nack of this message writes nothing. Returns False (and logs) if
        this worker no longer owns the attempt. ``replace_message`` stores the message
        again (``new_message``, or the proxy's own).

        Raises:
          dramatiq.errors.ConnectionError: the database stayed unreachable. The attempt is
            then left as it is (running, its lease no longer renewed): the reaper requeues
            it with backoff once the lease expires. It is never acked as a success.
        """
        data = data_bytes = None
        if replace_message:
            stored = messages.encode(new_message if new_message is not None else message._message)
            data_bytes = stored.data
            data = stored.view
            if data is None and stored.view_from_bytes:
                data = messages.display_view(data_bytes)
        # The ledger settles the attempt whatever happens: a failed attempt whose retry
        # could not be written must not be acked as a success by the ack Dramatiq sends
        # next.
        owned = self.ledger.reschedule(
            message.attempt,
            lambda: self._with_retries(
                lambda: self.store.reschedule(
                    message.attempt,
                    message.queue_name,
                    delay_ms,
                    error,
                    message=data,
                    message_bytes=data_bytes,
                )
            ),
        )
        if not owned:
            logger.warning(
                "Could not reschedule job %s attempt %d: this worker no longer owns it.",
                message.attempt.id,
                message.attempt.attempt,
            )
        return owned

    # -- consuming -----------------------------------------------------------------------

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 30000) -> PostgresConsumer:
        """A consumer claiming rows of ``queue_name``; see :class:`PostgresConsumer`."""
        if queue_name not in self.queues:
            raise dramatiq.errors.QueueNotFound(queue_name)
        self.leases.start()
        return PostgresConsumer(self, queue_name, prefetch, timeout)

    # -- maintenance and tests -----------------------------------------------------------

    def flush(self, queue_name: str) -> None:
        """Drop the waiting and running jobs of a queue (finished history stays)."""
        self.store.flush(queue_name)

    def flush_all(self) -> None:
        """Drop the waiting and running jobs of every declared queue."""
        for queue_name in self.queues:
            self.flush(queue_name)

    def join(
        self,
        queue_name: str,
        *,
        interval: int = 50,
        timeout: int | None = None,
        fail_fast: bool = False,
    ) -> None:
        """Wait until no job of the queue is queued (delayed included) or running.

        Meant for tests, as with Dramatiq's own brokers.

        Parameters:
          queue_name(str): the queue.
          interval(int): milliseconds between two checks.
          timeout(int): give up after this many milliseconds.
          fail_fast(bool): raise :class:`JobFailed` as soon as a job of the queue fails.

        Raises:
          QueueJoinTimeout: the timeout elapsed.
          JobFailed: with ``fail_fast``, a job failed.
        """
        # The server's clock, which also wrote finished_at: this host's may differ. A
        # failure up to a second before the call counts (a job sent just before join).
        started = self.store.server_now() - dt.timedelta(seconds=1) if fail_fast else None
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        while True:
            # Unfinished first: a job that fails between the two counts is then still seen
            # by the failure count, instead of the queue just looking finished.
            unfinished = self.store.count_unfinished(queue_name)
            if fail_fast and self.store.count_failed_since(queue_name, started):
                raise JobFailed(f"a job of queue {queue_name!r} failed")
            if unfinished == 0:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)
            time.sleep(interval / 1000)

    def close(self) -> None:
        """Stop the scheduler, write pending outcomes, stop the heartbeat and close this
        process's pool."""
        if self.periodic.scheduler is not None:
            self.periodic.scheduler.stop()
        self.outcomes.flush(timeout=30)
        self.leases.stop()
        self.pool.close()
