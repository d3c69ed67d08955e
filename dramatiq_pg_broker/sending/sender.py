"""The send path: how a Dramatiq message becomes a job row, and where the row is written.

:meth:`PostgresBroker.enqueue <dramatiq_pg_broker.PostgresBroker.enqueue>` (and
``enqueue_many``, ``batch``, ``transaction``) hand every message to the broker's
:class:`Sender`, which

- runs the middleware's ``before_enqueue`` and, once the row is written, ``after_enqueue``;
- builds the row (:func:`.messages.job_from_message`, the one place a message becomes a
  row: validated, encoded, scheduled, its ``max_attempts`` derived);
- takes a send of the message this thread's actor is running (a retry by the Retries
  middleware, a snooze) for what it is: that attempt's row rescheduled, not a new row;
- writes the row where the send belongs: inside ``broker.batch()``, collected and written
  with the block's other sends at its end; inside ``broker.transaction(conn)``, on the
  application's connection (as :mod:`.app_connections` wraps it); inside ``async with
  broker.transaction(conn)``, collected and written on the application's asyncio
  connection at the block's end (:mod:`.async_sending`); with no block open, in the
  transaction the :attr:`Sender.resolver` finds (Django's ``atomic()`` block, see
  :mod:`dramatiq_pg_broker.contrib.django`); otherwise through the pool, sharing one
  statement and its commit with the sends other threads make at that moment
  (:class:`GroupCommit`), and tried again after a connection error (:func:`retrying`);
- wakes the workers of the queues it filled: a send in the application's transaction in
  its own statement (delivered at that commit), the broker's own sends through the
  process's :class:`~.notifier.Notifier` once committed (see :mod:`.notifier` for why).

The blocks are bound to the current thread (and asyncio task): a context variable holds a
stack of the blocks entered, and a send goes to the innermost one. Another thread's sends
are not part of a block this thread opened; tasks created inside an async block inherit it
while it is open.

The worker side (the ledger, the consumer) imports this module for :class:`GroupCommit`,
so nothing of it is imported here: what the send path asks of it (is this message an
attempt this thread runs?) is handed to the :class:`Sender` by the broker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import dramatiq
import psycopg
from dramatiq.middleware import Middleware

from .. import forks
from ..config import Settings
from ..errors import InvalidMessage, TransactionError
from ..jobs.rows import EnqueueResult, NewJob, clean_text
from . import messages
from .app_transactions import JoinedTransaction
from .blocks import Batch, LazyJobs, SendContext, Transaction, identity, resolve_connection
from .group_commit import GroupCommit, retrying
from .notifier import Notifier

if TYPE_CHECKING:
    from ..jobs.store import JobStore
    from .async_sending import AsyncBlock


logger = logging.getLogger("dramatiq_pg_broker.sending")


class Pooled(Protocol):
    """The broker's process pool (:class:`~dramatiq_pg_broker.db.core.ProcessPool`)."""

    def connection(self) -> ContextManager[psycopg.Connection]: ...


class Reschedules(Protocol):
    """What the send path asks the in-flight ledger
    (:class:`~dramatiq_pg_broker.attempt.inflight.Ledger`): a retry of the running attempt
    is written when Dramatiq acks or nacks it."""

    def reschedule(self, attempt: Any, write: Callable[[], bool]) -> bool: ...


#: ``emitter(when, signal)``: a function running the ``when_signal`` hooks of the broker's
#: middleware (``when``: ``before`` or ``after``), as Dramatiq's ``emit_before`` and
#: ``emit_after`` run them.
Emitter = Callable[[str, str], Callable[..., None]]


class TransactionBlock:
    """What ``broker.transaction(conn)`` returns: ``with`` it for a synchronous connection
    (:meth:`Sender.sync_transaction`), ``async with`` it for an asyncio one
    (:mod:`.async_sending`)."""

    def __init__(self, sender: Sender, conn: Any) -> None:
        self._sender = sender
        self._conn = conn
        self._sync: ContextManager[psycopg.Connection] | None = None
        self._async: AsyncBlock | None = None

    def __enter__(self) -> psycopg.Connection:
        self._sync = self._sender.sync_transaction(self._conn)
        return self._sync.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        assert self._sync is not None
        return self._sync.__exit__(*exc)

    async def __aenter__(self) -> Any:
        from .async_sending import AsyncBlock

        self._async = AsyncBlock(self._sender, self._conn)
        return await self._async.enter()

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._async is not None
        return await self._async.exit(*exc)


# -- the sender ------------------------------------------------------------------------------


class RunningMessage(Protocol):
    """A message a worker runs, as its consumer hands it to Dramatiq
    (:class:`~dramatiq_pg_broker.attempt.consumer.PgMessageProxy`)."""

    attempt: Any  # the claimed attempt (:class:`~dramatiq_pg_broker.jobs.Attempt`)
    backoff_ms: int | None
    queue_name: str
    options: dict[str, Any]


class RunningAttempt(NamedTuple):
    """An attempt the current thread's actor runs and has not settled (see
    :func:`.current.running_attempt`)."""

    #: The message Dramatiq's worker handed to the actor.
    message: RunningMessage
    #: What its actor raised, as ``last_error`` keeps it; None if it did not raise.
    error: str | None


@dataclasses.dataclass(eq=False, repr=False, kw_only=True)
class Sender:
    """The send path of one broker. See the module docstring. The broker builds it with
    what it uses.

    Parameters:
      store(JobStore): where the rows are written.
      settings(Settings): ``durable_sends``, ``enqueue_retries``, ``max_attempts``.
      pool(ProcessPool): the broker's pool, opened on first use (which database the
        broker's jobs are in, see :meth:`check_database`).
      ledger(Ledger): the in-flight ledger, which writes a retry of the running attempt
        at its ack or nack.
      running(callable): ``running(message)`` is the :class:`RunningAttempt` of
        ``message`` if this thread's actor runs it, else None
        (:func:`.current.running_attempt`, bound to the broker's ledger).
      actors(Mapping[str, Actor]): the broker's actors (their priority and options).
      middleware(Sequence[Middleware]): the broker's middleware list (the Retries
        middleware's ``max_retries``).
      emit_before, emit_after(callable): the broker's ``emit_before`` and ``emit_after``
        (a single send's ``enqueue`` hooks).
      emitter(callable): see :data:`Emitter` (the hooks of a batch of sends, looked up
        once for the batch).
      notifier(Notifier): wakes the queues the broker's own sends filled (default: one
        on ``store.wake_queues``), as the ``notify_sends`` setting says.
    """

    store: JobStore
    settings: Settings
    pool: Pooled
    ledger: Reschedules
    running: Callable[[dramatiq.Message], RunningAttempt | None]
    actors: Mapping[str, dramatiq.Actor]
    middleware: Sequence[Middleware]
    emit_before: Callable[..., None]
    emit_after: Callable[..., None]
    emitter: Emitter
    notifier: Notifier | None = None
    #: Asked for the transaction a send joins when no ``broker.transaction()`` or
    #: ``batch()`` block is open: ``resolver()`` returns a :class:`Transaction` on the
    #: application's connection, or None to send through the pool. The Django
    #: integration sets it to join ``transaction.atomic()`` blocks.
    resolver: Callable[[], Transaction | None] | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self._blocks = SendContext()
        #: Concurrent sends through the pool share a statement: one group per process.
        self._group = forks.PerProcess(lambda: GroupCommit(self._write_group))
        self._identity: tuple | None = None
        if self.notifier is None:
            self.notifier = Notifier(self.store.wake_queues)
        #: Whether the broker's own sends notify in their statement (the old way).
        self._notify_in_statement = self.settings.notify_sends == "statement"
        self._owes = self.settings.notify_sends == "coalesced"
        #: A job delayed by this many milliseconds or more is not notified: every idle
        #: consumer looks at its queue within its poll interval, before the job is due.
        self._quiet_delay_ms = self.settings.poll_interval * 1000

    def _block(self) -> Transaction | Batch | None:
        """Where a send of this thread (or task) goes: the innermost block it opened, else
        the transaction the :attr:`resolver` finds, else None (the pool)."""
        block = self._blocks.top()
        if block is None and self.resolver is not None:
            block = self.resolver()
        return block

    def app_transaction(self) -> Transaction | None:
        """The application's transaction the sends of this thread (or task) are written
        in: the innermost ``transaction()`` block, the one a ``batch()`` block stands in,
        or the one the :attr:`resolver` finds; None when they go through the pool."""
        block = self._blocks.top()
        if isinstance(block, Batch):
            block = self._blocks.transaction_below(block)
        if block is None and self.resolver is not None:
            block = self.resolver()
        return block if isinstance(block, Transaction) else None

    @property
    def waiting(self) -> int:
        """How many sends of this process wait for the group commit in progress to end
        (they go together in the next statement)."""
        group = self._group.peek()
        return 0 if group is None else group.waiting

    # -- building the row ----------------------------------------------------------------

    def job_for(
        self, message: dramatiq.Message, delay: int | None = None
    ) -> tuple[NewJob, dramatiq.Message]:
        """The job row a send of ``message`` writes, and the message as stored.

        Raises:
          InvalidMessage: an option is out of range, or the encoder cannot encode a value.
        """
        return self._builder()(message, delay)

    def _builder(self) -> Callable[[dramatiq.Message, int | None], tuple[NewJob, Any]]:
        """:meth:`job_for`, with what does not change within one batch looked up once."""
        default_max_retries = messages.default_max_retries(self.settings, self.middleware)
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

    # -- one message ---------------------------------------------------------------------

    def send(self, message: dramatiq.Message, delay: int | None = None) -> dramatiq.Message:
        """:meth:`PostgresBroker.enqueue <dramatiq_pg_broker.PostgresBroker.enqueue>`."""
        self.emit_before("enqueue", message, delay)
        running = self.running(message)
        if running is not None:
            self._retry(running, message, delay)
            self.emit_after("enqueue", message, delay)
            return message
        job, stored = self.job_for(message, delay)
        block = self._block()
        if isinstance(block, Batch):
            block.add(job, stored, delay)
            return stored
        if block is not None:
            # The application's transaction: no retry (a failed statement aborts it).
            with block.writing():
                result = self.store.enqueue(job, conn=block.view)
        else:
            result = retrying(
                lambda first: self._send_alone(job, first), self.settings.enqueue_retries
            )
        stored = self._as_stored(job, stored, result)
        self.emit_after("enqueue", stored, delay)
        return stored

    def _send_alone(self, job: NewJob, first: bool) -> EnqueueResult:
        """Write one send through the pool, sharing the statement and its commit with the
        sends other threads are making at the same moment (group commit): a send finding no
        write in progress writes at once, alone (one round trip); sends arriving while one
        is written wait for it, then go together in one statement. Each returns once its
        row is committed, durably unless it asked otherwise."""
        item = (job, first)
        result = self._group.get().submit(item)[id(item)]
        if isinstance(result, BaseException):
            raise result
        return result

    def _write_group(self, items: list[tuple[NewJob, bool]]) -> dict[int, Any]:
        notify = self._notify_in_statement
        if len(items) == 1:
            job, first = items[0]
            result = self.store.enqueue(job, again=first, notify=notify)
            self._wake([job], [result])
            return {id(items[0]): result}
        results = self.store.send_many(items, notify=notify)
        self._wake([job for job, _ in items], results)
        return {id(item): result for item, result in zip(items, results)}

    def _wake(self, jobs: Sequence[NewJob], results: Sequence[Any]) -> None:
        """Owe the notifier the queues that committed sends of the broker's own filled
        with a job runnable before the workers' next look (see :mod:`.notifier`)."""
        if not self._owes:
            return
        quiet = self._quiet_delay_ms
        queues = {
            job.queue_name
            for job, result in zip(jobs, results)
            if isinstance(result, EnqueueResult)
            and (result.created or result.rescheduled)
            and job.delay_ms < quiet
        }
        if queues:
            self.notifier.owe(queues)  # type: ignore[union-attr]

    def close(self) -> None:
        """Send the wake-ups this process owes (within a few seconds) and stop the
        notifier's thread (see :mod:`.notifier`)."""
        self.notifier.stop()  # type: ignore[union-attr]

    @staticmethod
    def _as_stored(job: NewJob, stored: dramatiq.Message, result: EnqueueResult):
        """The message a send returns: its own, or the existing job's when its idempotency
        key was already used."""
        if not result.created and result.id != job.id:
            logger.debug(
                "Idempotency key %r already used by job %s.", job.idempotency_key, result.id
            )
            return messages.decode(result.message, result.message_bytes)
        return stored

    # -- the running attempt -------------------------------------------------------------

    def _retry(self, running: RunningAttempt, message: dramatiq.Message, delay: int | None):
        """A send of the message this thread's actor runs: its row goes back to queued
        with the message as sent (Dramatiq's Retries updates its options), after ``delay``
        (the delay the Retries middleware computed and logged), written by the ack or
        nack Dramatiq sends for the attempt once every middleware ran."""
        proxy = running.message
        if isinstance(proxy.options.get("traceback"), str):
            # Dramatiq's formatted traceback repeats the error text, which may hold
            # characters a stored message cannot (NUL, lone surrogates).
            proxy.options["traceback"] = clean_text(proxy.options["traceback"])
        job, stored = self.job_for(message, delay)
        delay_ms = job.delay_ms
        if message is proxy and proxy.backoff_ms is not None:
            # The Retries middleware's deterministic backoff (``jitter=False``).
            delay_ms = proxy.backoff_ms
        self.reschedule(
            proxy, delay_ms, running.error, message=stored, max_attempts=job.max_attempts
        )

    def reschedule(
        self,
        proxy: RunningMessage,
        delay_ms: int,
        error: str | None,
        *,
        message: dramatiq.Message | None = None,
        max_attempts: int | None = None,
    ) -> bool:
        """Move a running message's row back to queued, runnable in ``delay_ms``, when
        Dramatiq acks or nacks the message (after every middleware's
        ``after_process_message``): that ack or nack writes the retry instead of an
        outcome. Returns False (and logs) if this worker no longer holds the attempt
        running.

        Parameters:
          proxy(RunningMessage): the running message.
          delay_ms(int): milliseconds until the job may run again.
          error(str): the attempt's error, kept in ``last_error``.
          message(Message): the message to store instead of the row's.
          max_attempts(int): the row's new ``max_attempts`` (None keeps it).

        A retry that cannot be written at the ack (the database stayed unreachable) is
        logged and left as it is (running, its lease no longer renewed): the reaper
        requeues it with backoff once the lease expires. It is never acked as a success.
        """
        data = data_bytes = None
        if message is not None:
            encoded = messages.encode(message)
            data_bytes = encoded.data
            # No jsonb copy when the bytes are JSON that jsonb holds as they are: all_jobs
            # parses them on read (migration 0018), as for a first send.
            data = encoded.view
        attempt = proxy.attempt

        def write(first: bool) -> bool:
            return self.store.reschedule(
                attempt,
                proxy.queue_name,
                delay_ms,
                error,
                message=data,
                message_bytes=data_bytes,
                max_attempts=max_attempts,
            )

        # The ledger writes it at the ack or nack, and settles the attempt whatever
        # happens: a failed attempt whose retry could not be written is never acked as a
        # success.
        held = self.ledger.reschedule(
            attempt, lambda: retrying(write, self.settings.enqueue_retries)
        )
        if not held:
            logger.warning(
                "Could not reschedule job %s attempt %d: this worker no longer owns it.",
                attempt.id,
                attempt.attempt,
            )
        return held

    # -- many messages -------------------------------------------------------------------

    def enqueue_many(
        self, messages: Iterable[dramatiq.Message], delay: int | None = None
    ) -> list[dramatiq.Message]:
        """:meth:`PostgresBroker.enqueue_many <dramatiq_pg_broker.PostgresBroker.enqueue_many>`."""
        messages = list(messages)
        before = self.emitter("before", "enqueue")
        job_for = self._builder()
        stored: list[dramatiq.Message] = [None] * len(messages)  # type: ignore[list-item]

        def build(index: int) -> NewJob:
            message = messages[index]
            before(message, delay)
            try:
                job, stored[index] = job_for(message, delay)
            except InvalidMessage as e:
                raise InvalidMessage(f"message {index} of the batch: {e}") from e
            return job

        jobs = LazyJobs(len(messages), build)
        block = self._block()
        if isinstance(block, Batch):
            for index, job in enumerate(jobs):
                block.add(job, stored[index], delay)
            return list(stored)
        if block is not None:
            with block.writing():
                return self._write_batch(jobs, stored, [delay] * len(messages), block.view)
        return self._write_batch(jobs, stored, [delay] * len(messages), None)

    def _write_batch(
        self,
        jobs: Sequence[NewJob],
        stored: list[dramatiq.Message],
        delays: list[int | None],
        conn: Any,
    ) -> list[dramatiq.Message]:
        """Write collected sends in one transaction: on ``conn`` (the application's
        connection, as :mod:`.app_connections` wraps it), else through the pool, retried
        after a connection error."""
        if conn is not None:
            results = self.store.enqueue_many(jobs, conn=conn)
        else:
            results = retrying(
                lambda first: self.store.enqueue_many(
                    jobs, again=first, notify=self._notify_in_statement
                ),
                self.settings.enqueue_retries,
            )
            self._wake(jobs, results)
        after = self.emitter("after", "enqueue")
        sent = []
        for job, message, delay, result in zip(jobs, stored, delays, results):
            message = self._as_stored(job, message, result)
            after(message, delay)
            sent.append(message)
        return sent

    @contextlib.contextmanager
    def batch(self) -> Iterator[Batch]:
        """:meth:`PostgresBroker.batch <dramatiq_pg_broker.PostgresBroker.batch>`."""
        top = self._blocks.top()
        if isinstance(top, Batch):
            yield top
            return
        batch = Batch()
        with self._blocks.pushed(batch):
            yield batch
            below = self._blocks.transaction_below(batch)
        if below is None and self.resolver is not None:
            below = self.resolver()
        if not batch.jobs:
            return
        if below is None:
            self._write_batch(batch.jobs, batch.messages, batch.delays, None)
            return
        with below.writing():
            self._write_batch(batch.jobs, batch.messages, batch.delays, below.view)

    # -- the application's transaction ---------------------------------------------------

    def transaction(self, conn: Any) -> TransactionBlock:
        """:meth:`PostgresBroker.transaction
        <dramatiq_pg_broker.PostgresBroker.transaction>`."""
        return TransactionBlock(self, conn)

    @contextlib.contextmanager
    def sync_transaction(self, conn: Any) -> Iterator[psycopg.Connection]:
        """``with broker.transaction(conn)``."""
        pg_conn, sa_conn = resolve_connection(conn)
        if sa_conn is None:
            with pg_conn.transaction():
                block = Transaction(pg_conn)
                self.check_database(identity(block.view))
                with self._blocks.pushed(block):
                    yield pg_conn
            return
        # Sends write at once, so a commit inside the block commits them; a send after it
        # must not write on the psycopg connection SQLAlchemy gave back to its pool.
        orm = sys.modules.get("sqlalchemy.orm")
        session = conn if orm is not None and isinstance(conn, orm.Session) else None
        joined = JoinedTransaction(sa_conn, session=session)
        try:
            block = Transaction(pg_conn, check=joined.check)
            self.check_database(identity(block.view))
            with self._blocks.pushed(block):
                yield pg_conn
        finally:
            joined.close()

    def broker_identity(self) -> tuple:
        """What the broker's own connections reach (see :func:`identity`)."""
        with self.pool.connection() as pooled:
            return identity(pooled)

    def check_database(self, theirs: tuple, *, learn: Callable[[], tuple] | None = None) -> None:
        """Refuse an application's connection that reaches ``theirs`` (its
        :func:`identity`) when the broker's jobs are in another database.

        Parameters:
          learn(callable): how to read the broker's identity (default
            :meth:`broker_identity`; an async block reads it in a thread first).

        Raises:
          TransactionError: the databases differ.
        """
        if theirs != self._identity:
            # Learned at the first transaction, and again whenever it differs: a server
            # restart or a failover gives the broker's database another server start.
            self._identity = (learn or self.broker_identity)()
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
