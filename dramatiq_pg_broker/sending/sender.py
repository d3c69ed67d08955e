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
  (:class:`GroupCommit`), and tried again after a connection error (:func:`retrying`).

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
import contextvars
import dataclasses
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, overload

import dramatiq
import psycopg
from dramatiq.errors import BrokerConnectionError
from dramatiq.middleware import Middleware, MiddlewareError
from psycopg_pool import PoolTimeout

from .. import forks
from ..errors import InvalidMessage, TransactionError
from ..jobs.rows import EnqueueResult, NewJob, clean_text
from . import messages
from .app_connections import AppConnection
from .app_transactions import JoinedTransaction

if TYPE_CHECKING:
    from .async_sending import AsyncBlock

logger = logging.getLogger("dramatiq_pg_broker.sending")


class SenderParts(Protocol):
    """What the send path uses of the broker whose sends it writes."""

    actors: dict[str, Any]
    middleware: list[Any]
    logger: logging.Logger
    ledger: Any  # the in-flight ledger: a retry reschedules the running attempt
    pool: Any  # the process pool
    settings: Any  # the broker's Settings
    store: Any  # the job store

    def emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None: ...

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None: ...


T = TypeVar("T")


# -- group commit ---------------------------------------------------------------------------


class GroupCommit:
    """Callers hand in one item each; whoever finds no write in progress writes everything
    waiting as one statement, so concurrent callers share a round trip (and a commit).

    Parameters:
      write(callable): ``write(items)`` writes a list of items in one statement and
        returns what :meth:`submit` gives each caller (a mapping keyed by ``id(item)``, a
        set of ids ...). Whatever it raises is raised to every caller of that write.
    """

    def __init__(self, write: Callable[[list[Any]], Any]) -> None:
        self._write = write
        self._cond = threading.Condition()
        self._open: dict[str, Any] = {"items": [], "done": False}
        self._busy = False

    def submit(self, item: Any) -> Any:
        """Have ``item`` written: at once when no write is in progress (a write of one),
        else with every item that arrives until the write in progress ends. Returns what
        the write of its group returned."""
        with self._cond:
            batch = self._open
            batch["items"].append(item)
            while not batch["done"]:
                if not self._busy:
                    self._busy = True
                    self._open = {"items": [], "done": False}
                    break
                self._cond.wait()
            else:
                return self._result(batch)
        try:
            batch["result"] = self._write(batch["items"])
        except BaseException as e:
            batch["error"] = e
        with self._cond:
            batch["done"] = True
            self._busy = False
            self._cond.notify_all()
        return self._result(batch)

    @property
    def waiting(self) -> int:
        """How many items wait for the write in progress to end."""
        with self._cond:
            return len(self._open["items"])

    @staticmethod
    def _result(batch: dict[str, Any]) -> Any:
        if "error" in batch:
            raise batch["error"]
        return batch["result"]


# -- retries after a connection error -----------------------------------------------------


def retrying(write: Callable[[bool], T], retries: int) -> T:
    """``write(first)``, tried again up to ``retries`` times while it fails on a
    connection error, 0.05 s after the first failure and four times longer after each
    next one.

    ``first`` is False for every try after the first, whose commit may have happened
    though its reply was lost: a send then takes a row with its own id for its own
    (returned as it is) instead of for a second send of that id. A pool timeout is not
    tried again: the pool already spent its whole timeout trying to get a connection, and
    asking again would only multiply that wait.

    Raises:
      dramatiq.errors.ConnectionError: the last try's.
    """
    delay = 0.05
    for attempt in range(retries + 1):
        try:
            return write(attempt == 0)
        except BrokerConnectionError as e:
            if attempt >= retries or isinstance(e.__cause__, PoolTimeout):
                raise
            # Told once per outage by the process (outage.py), not at every try.
            logger.debug("Enqueue failed on a connection error; retrying in %.2fs.", delay)
            time.sleep(delay)
            delay *= 4
    raise AssertionError("unreachable")  # pragma: no cover


# -- blocks: batch() and transaction() ------------------------------------------------------


@dataclasses.dataclass
class Batch:
    """The sends collected by a ``broker.batch()`` block, written together at its end."""

    jobs: list[NewJob] = dataclasses.field(default_factory=list)
    messages: list[dramatiq.Message] = dataclasses.field(default_factory=list)
    delays: list[int | None] = dataclasses.field(default_factory=list)

    def add(self, job: NewJob, message: dramatiq.Message, delay: int | None = None) -> None:
        self.jobs.append(job)
        self.messages.append(message)
        self.delays.append(delay)

    def __len__(self) -> int:
        return len(self.jobs)


class LazyJobs(Sequence[NewJob]):
    """The jobs of ``broker.enqueue_many()``, each checked and encoded on first access, in
    order, and kept.

    The store's COPY path reads them one chunk ahead of what the server is inserting, so
    this process encodes while the server writes; a retry after a lost connection reads
    the kept ones again.
    """

    def __init__(self, count: int, build: Callable[[int], NewJob]) -> None:
        self._count = count
        self._build = build
        self._built: list[NewJob] = []

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> NewJob: ...

    @overload
    def __getitem__(self, index: slice) -> list[NewJob]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(index)
        built = self._built
        while len(built) <= index:
            built.append(self._build(len(built)))
        return built[index]

    def __iter__(self) -> Iterator[NewJob]:
        if len(self._built) == self._count:
            return iter(self._built)
        return (self[index] for index in range(self._count))


@dataclasses.dataclass
class Transaction:
    """A transaction block: sends write on ``conn``, the application's connection (a
    ``broker.transaction(conn)`` block, or one a :attr:`Sender.resolver` found)."""

    conn: psycopg.Connection
    #: Entered around each write on ``conn``: a framework's bookkeeping (Django marks its
    #: ``atomic()`` block for rollback when a write fails). None: nothing.
    guard: Callable[[], ContextManager[Any]] | None = None
    #: Called before each write: raises if the transaction the block joined has ended (a
    #: SQLAlchemy Session or Connection committed inside the block). None: nothing.
    check: Callable[[], None] | None = None
    #: ``conn`` as the job store writes on it.
    view: AppConnection = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.view = AppConnection(self.conn)

    def writing(self) -> ContextManager[Any]:
        if self.check is not None:
            self.check()
        return self.guard() if self.guard is not None else contextlib.nullcontext()


class SendContext:
    """The stack of ``transaction()`` and ``batch()`` blocks of the current thread or task,
    for one broker."""

    def __init__(self) -> None:
        self._stack: contextvars.ContextVar[tuple[Transaction | Batch, ...]] = (
            contextvars.ContextVar(f"dramatiq_pg_broker_sends_{id(self)}", default=())
        )

    def top(self) -> Transaction | Batch | None:
        stack = self._stack.get()
        return stack[-1] if stack else None

    def transaction_below(self, block: Batch) -> Transaction | None:
        """The innermost transaction block around ``block``, if any."""
        stack = self._stack.get()
        index = next(i for i in range(len(stack) - 1, -1, -1) if stack[i] is block)
        for entry in reversed(stack[:index]):
            if isinstance(entry, Transaction):
                return entry
        return None

    def push(self, entry: Transaction | Batch) -> contextvars.Token:
        """Enter a block; :meth:`pop` with the token leaves it (in the same context)."""
        return self._stack.set((*self._stack.get(), entry))

    def pop(self, token: contextvars.Token) -> None:
        self._stack.reset(token)

    @contextlib.contextmanager
    def pushed(self, entry: Transaction | Batch) -> Iterator[None]:
        token = self.push(entry)
        try:
            yield
        finally:
            self.pop(token)


def _sqlalchemy_connection(obj: Any):
    """The SQLAlchemy ``Connection`` behind a Session or Connection, or None if ``obj`` is
    neither (or SQLAlchemy is not installed)."""
    # Never imported here (the broker does not depend on SQLAlchemy): a Session or
    # Connection can only exist if the application imported SQLAlchemy already.
    orm = sys.modules.get("sqlalchemy.orm")
    engine = sys.modules.get("sqlalchemy.engine")
    if orm is not None and isinstance(obj, orm.Session):
        # Begins the session's transaction if none is open; the application commits it.
        return obj.connection()
    if engine is not None and isinstance(obj, engine.Connection):
        if not obj.in_transaction():
            # A statement written under SQLAlchemy's feet would open a transaction that
            # SQLAlchemy does not know about, and its commit() would not commit it.
            obj.begin()
        return obj
    return None


def _is_sqlalchemy_async(obj: Any) -> bool:
    """Whether ``obj`` is a SQLAlchemy ``AsyncSession`` or ``AsyncConnection``."""
    module = sys.modules.get("sqlalchemy.ext.asyncio")
    return module is not None and isinstance(obj, (module.AsyncSession, module.AsyncConnection))


def resolve_connection(obj: Any) -> tuple[psycopg.Connection, Any]:
    """The psycopg connection to write on, and the SQLAlchemy ``Connection`` whose
    transaction the block joins (None for a psycopg connection given directly: the block
    opens its own transaction on it).

    Raises:
      TransactionError: ``obj`` is not a synchronous psycopg 3 connection, nor a SQLAlchemy
        2 Session or Connection on the ``postgresql+psycopg`` driver.
    """
    if isinstance(obj, psycopg.Connection):
        if obj.closed:
            raise TransactionError("broker.transaction() was given a closed connection")
        return obj, None
    if isinstance(obj, psycopg.AsyncConnection) or _is_sqlalchemy_async(obj):
        raise TransactionError(
            f"{type(obj).__qualname__} is an asyncio connection: enter the block with "
            "`async with broker.transaction(conn)`, not `with`"
        )
    sa_conn = _sqlalchemy_connection(obj)
    if sa_conn is None:
        raise TransactionError(
            f"broker.transaction() takes a psycopg 3 Connection or a SQLAlchemy 2 Session or "
            f"Connection on the postgresql+psycopg driver, not {type(obj).__module__}."
            f"{type(obj).__qualname__}"
        )
    dialect = sa_conn.dialect
    if dialect.name != "postgresql" or dialect.driver != "psycopg":
        raise TransactionError(
            f"broker.transaction() needs SQLAlchemy's postgresql+psycopg driver (psycopg 3); "
            f"this connection uses {dialect.name}+{dialect.driver}"
        )
    driver = sa_conn.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise TransactionError(
            "broker.transaction() needs a synchronous SQLAlchemy Session or Connection "
            "(create_engine, not create_async_engine)"
        )
    if driver.autocommit:
        raise TransactionError(
            "this SQLAlchemy connection uses the AUTOCOMMIT isolation level: it has no "
            "transaction for the jobs to join"
        )
    return driver, sa_conn


#: What each connection reached, checked once per connection: (database, server start).
_identities: weakref.WeakKeyDictionary[psycopg.Connection, tuple] = weakref.WeakKeyDictionary()

# A database is named by its name and by when its server started (two servers never share
# a start time to the microsecond); a port or host name would differ between a TCP and a
# Unix-socket connection to the same server.
IDENTITY_SQL = "SELECT current_database(), pg_postmaster_start_time()"


def identity(conn: psycopg.Connection | AppConnection) -> tuple:
    """Which database on which server ``conn`` is connected to (cached per connection)."""
    key = conn.raw if isinstance(conn, AppConnection) else conn
    known = _identities.get(key)
    if known is None:
        known = tuple(conn.execute(IDENTITY_SQL).fetchone())
        _identities[key] = known
    return known


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


class Sender:
    """The send path of one broker. See the module docstring.

    Parameters:
      broker(PostgresBroker): whose store, settings, actors, middleware and ledger it uses.
      running(callable): ``running(message)`` is the :class:`RunningAttempt` of
        ``message`` if this thread's actor runs it, else None
        (:func:`.current.running_attempt`, bound to the broker's ledger).
    """

    def __init__(
        self,
        broker: SenderParts,
        running: Callable[[dramatiq.Message], RunningAttempt | None],
    ) -> None:
        self.broker = broker
        self.store = broker.store
        self.settings = broker.settings
        self._running = running
        self._blocks = SendContext()
        #: Concurrent sends through the pool share a statement: one group per process.
        self._group = forks.PerProcess(lambda: GroupCommit(self._write_group))
        self._identity: tuple | None = None
        #: Asked for the transaction a send joins when no ``broker.transaction()`` or
        #: ``batch()`` block is open: ``resolver()`` returns a :class:`Transaction` on the
        #: application's connection, or None to send through the pool. The Django
        #: integration sets it to join ``transaction.atomic()`` blocks.
        self.resolver: Callable[[], Transaction | None] | None = None

    def _block(self) -> Transaction | Batch | None:
        """Where a send of this thread (or task) goes: the innermost block it opened, else
        the transaction the :attr:`resolver` finds, else None (the pool)."""
        block = self._blocks.top()
        if block is None and self.resolver is not None:
            block = self.resolver()
        return block

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
        broker = self.broker
        default_max_retries = messages.default_max_retries(self.settings, broker.middleware)
        durable = self.settings.durable_sends
        actors = broker.actors

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
        broker = self.broker
        broker.emit_before("enqueue", message, delay)
        running = self._running(message)
        if running is not None:
            self._retry(running, message, delay)
            broker.emit_after("enqueue", message, delay)
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
        broker.emit_after("enqueue", stored, delay)
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
        if len(items) == 1:
            job, first = items[0]
            return {id(items[0]): self.store.enqueue(job, again=first)}
        return {id(item): result for item, result in zip(items, self.store.send_many(items))}

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
            data = encoded.view
            if data is None and encoded.view_from_bytes:
                data = messages.display_view(data_bytes)
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
        held = self.broker.ledger.reschedule(
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

    def send_all(
        self, messages: Iterable[dramatiq.Message], delay: int | None = None
    ) -> list[dramatiq.Message]:
        """:meth:`PostgresBroker.enqueue_many <dramatiq_pg_broker.PostgresBroker.enqueue_many>`."""
        messages = list(messages)
        before = self._emitter("before", "enqueue")
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
                lambda first: self.store.enqueue_many(jobs, again=first),
                self.settings.enqueue_retries,
            )
        after = self._emitter("after", "enqueue")
        sent = []
        for job, message, delay, result in zip(jobs, stored, delays, results):
            message = self._as_stored(job, message, result)
            after(message, delay)
            sent.append(message)
        return sent

    def _emitter(self, when: str, signal: str) -> Callable[..., None]:
        """``emit_before(signal, ...)`` or ``emit_after``, as Dramatiq's broker runs them,
        over only the middleware that define that hook: a batch of 100,000 messages
        otherwise spends a good part of its time calling the base class's empty hooks."""
        broker = self.broker
        name = f"{when}_{signal}"
        base = getattr(Middleware, name)
        order = broker.middleware if when == "before" else list(reversed(broker.middleware))
        hooks = [
            (m, getattr(m, name))
            for m in order
            if getattr(type(m), name, base) is not base or name in getattr(m, "__dict__", {})
        ]

        def emit(*args: Any) -> None:
            for middleware, hook in hooks:
                try:
                    hook(broker, *args)
                except MiddlewareError:
                    if when == "before":
                        raise
                    broker.logger.critical(
                        "Unexpected failure in %s of %r.", name, middleware, exc_info=True
                    )
                except Exception:
                    broker.logger.critical(
                        "Unexpected failure in %s of %r.", name, middleware, exc_info=True
                    )

        return emit

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
        with self.broker.pool.connection() as pooled:
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
