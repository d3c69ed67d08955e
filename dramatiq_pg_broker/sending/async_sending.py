"""Sending from asyncio code without blocking the event loop.

Two ways, both documented in the async guide (``docs/guides/async.md``):

- **Inside the application's transaction**: ``async with broker.transaction(conn):``, where
  ``conn`` is a psycopg ``AsyncConnection`` or a SQLAlchemy ``AsyncSession`` or
  ``AsyncConnection``. ``actor.send()`` is synchronous and cannot await a database write, so
  a send in the block does no I/O: its message is checked and encoded at once (a refused
  send raises there), and its job is collected, as ``broker.batch()`` collects. The
  collected jobs are written on the application's connection, in its transaction, when the
  block ends (before its commit) or at ``await broker.write_pending_sends()``: the job
  store's code runs in a worker thread and hands each statement to the event loop, which
  runs it on the async connection (:class:`~.app_connections.LoopConnection`). The loop is
  never blocked on the database, and the rules of the write are the ones of every other
  send.
- **Outside a transaction**: ``await broker.enqueue_async(message)``, or
  :func:`send_async` / :func:`send_with_options_async` for an actor: the send runs in a
  thread of the loop's default executor and goes through the broker's pool, sharing
  statements and commits with the sends other threads make at that moment.

The transaction block follows the synchronous block's rules: a psycopg ``AsyncConnection``
with no transaction open gets one that the block begins and commits (or rolls back if the
block raises); inside an open one the block is a savepoint (and psycopg refuses a commit
inside it). A SQLAlchemy ``AsyncSession`` or ``AsyncConnection`` is joined: its
transaction is begun if needed, and the application commits or rolls it back, after the
block or inside it. SQLAlchemy's events tell the block (:mod:`.app_transactions`): the
collected sends are written just before the COMMIT, or before a SAVEPOINT begins, and
dropped with a rollback; a send after the transaction ended, or a block whose transaction
ended unseen, raises ``TransactionError`` and writes nothing.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import datetime as dt
import functools
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import dramatiq
import psycopg
from psycopg.rows import tuple_row

from ..errors import TransactionError
from .app_connections import LoopConnection
from .app_transactions import JoinedTransaction
from .blocks import IDENTITY_SQL, Batch, check_psycopg_driver, given_psycopg, refuse_autocommit

if TYPE_CHECKING:
    from .sender import Sender

T = TypeVar("T")

#: What each async connection reached: (database, server start) (see sending.identity).
_identities: weakref.WeakKeyDictionary[psycopg.AsyncConnection, tuple] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(eq=False)
class AsyncTransaction(Batch):
    """An ``async with broker.transaction(conn)`` block: its sends collected until they are
    written on ``conn``."""

    conn: Any = None
    loop: Any = None
    #: Set once the block ended: a send made afterwards from a task that inherited the
    #: block (a task created inside it and still running) is refused.
    closed: bool = False
    #: One write at a time on the connection (tasks of the block may flush together).
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    #: The application's SQLAlchemy transaction, watched (None for a psycopg connection).
    joined: JoinedTransaction | None = None

    def add(self, job: Any, message: dramatiq.Message, delay: int | None = None) -> None:
        if self.closed:
            raise TransactionError(
                "this send belongs to an `async with broker.transaction()` block that has "
                "ended (a task created inside the block outlived it); send from inside the "
                "block, or with `await broker.enqueue_async()` outside it"
            )
        if self.joined is not None:
            self.joined.check()
        super().add(job, message, delay)

    def take(self) -> Batch:
        """The sends collected so far, leaving the block empty."""
        taken = Batch(self.jobs, self.messages, self.delays)
        self.jobs, self.messages, self.delays = [], [], []
        return taken

    def drop(self) -> None:
        """Forget the sends collected (the transaction was rolled back)."""
        self.take()


async def in_thread(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` in the loop's default executor, in a copy of this task's context.

    A cancellation of the caller waits for the thread to end before it goes on: the thread
    writes on the application's connection, and the transaction must not be rolled back
    under its feet.
    """
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, function, *args)
    future = loop.run_in_executor(None, call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait({future})
            except asyncio.CancelledError:
                continue
        raise


# -- the application's connection -----------------------------------------------------------


async def resolve_async_connection(obj: Any) -> tuple[psycopg.AsyncConnection, Any]:
    """The psycopg ``AsyncConnection`` to write on, and the SQLAlchemy ``AsyncConnection``
    whose transaction the block joins (None for a psycopg ``AsyncConnection`` given
    directly: the block opens its own transaction on it).

    Raises:
      TransactionError: ``obj`` is not a psycopg ``AsyncConnection``, nor a SQLAlchemy 2
        ``AsyncSession`` or ``AsyncConnection`` on the ``postgresql+psycopg`` driver.
    """
    if given_psycopg(obj, asynchronous=True):
        return obj, None
    sa_conn = await _sqlalchemy_async_connection(obj)
    if sa_conn is None:
        raise TransactionError(
            f"`async with broker.transaction()` takes a psycopg 3 AsyncConnection or a "
            f"SQLAlchemy 2 AsyncSession or AsyncConnection on the postgresql+psycopg "
            f"driver, not {type(obj).__module__}.{type(obj).__qualname__}"
        )
    check_psycopg_driver(sa_conn)
    driver = (await sa_conn.get_raw_connection()).driver_connection
    if not isinstance(driver, psycopg.AsyncConnection):  # pragma: no cover - psycopg only
        raise TransactionError("this SQLAlchemy connection has no psycopg AsyncConnection")
    refuse_autocommit(driver)
    return driver, sa_conn


async def _sqlalchemy_async_connection(obj: Any):
    """The SQLAlchemy ``AsyncConnection`` behind an ``AsyncSession`` or ``AsyncConnection``
    (its transaction begun), or None if ``obj`` is neither."""
    # Never imported here: such an object exists only if the application imported it.
    module = sys.modules.get("sqlalchemy.ext.asyncio")
    if module is None:
        return None
    if isinstance(obj, module.AsyncSession):
        # Begins the session's transaction if none is open; the application commits it.
        return await obj.connection()
    if isinstance(obj, module.AsyncConnection):
        if not obj.in_transaction():
            # As for a synchronous Connection: a transaction SQLAlchemy does not know
            # about would not be committed by its commit().
            await obj.begin()
        return obj
    return None


async def identity(conn: psycopg.AsyncConnection) -> tuple:
    """Which database on which server ``conn`` is connected to (cached per connection)."""
    known = _identities.get(conn)
    if known is None:
        async with psycopg.AsyncCursor(conn, row_factory=tuple_row) as cur:
            await cur.execute(IDENTITY_SQL)
            known = tuple(await cur.fetchone())
        _identities[conn] = known
    return known


# -- the block -----------------------------------------------------------------------------


class AsyncBlock:
    """One ``async with broker.transaction(conn)`` block of a :class:`~.sending.Sender`."""

    def __init__(self, sender: Sender, conn: Any) -> None:
        self._sender = sender
        self._given = conn
        self._tx: Any = None
        self._block: AsyncTransaction | None = None
        self._token: contextvars.Token | None = None

    async def enter(self) -> psycopg.AsyncConnection:
        conn, sa_conn = await resolve_async_connection(self._given)
        if sa_conn is None:
            self._tx = conn.transaction()
            await self._tx.__aenter__()
        try:
            await self._check_database(conn)
        except BaseException as e:
            if self._tx is not None:
                await self._tx.__aexit__(type(e), e, e.__traceback__)
            raise
        block = self._block = AsyncTransaction(conn=conn, loop=asyncio.get_running_loop())
        if sa_conn is not None:
            # The application may commit or roll back inside the block: its collected
            # sends are then written just before the COMMIT, or dropped.
            module = sys.modules["sqlalchemy.ext.asyncio"]
            block.joined = JoinedTransaction(
                sa_conn.sync_connection,
                session=(
                    self._given.sync_session
                    if isinstance(self._given, module.AsyncSession)
                    else None
                ),
                # What was collected goes into the transaction just before its COMMIT,
                # and into the enclosing level before a savepoint begins: what is still
                # collected when a savepoint rolls back was sent inside it.
                before_commit=functools.partial(_write_from_sqlalchemy, self._sender, block),
                after_rollback=block.drop,
                before_savepoint=functools.partial(_write_from_sqlalchemy, self._sender, block),
                after_savepoint_rollback=block.drop,
            )
        self._token = self._sender._blocks.push(block)
        return conn

    async def _check_database(self, conn: psycopg.AsyncConnection) -> None:
        sender = self._sender
        theirs = await identity(conn)
        if theirs != sender._identity:
            # The broker's own identity is read through its (synchronous) pool: in a thread.
            learned = await in_thread(sender.broker_identity)
            sender.check_database(theirs, learn=lambda: learned)

    async def exit(self, exc_type: Any, exc: Any, tb: Any) -> bool | None:
        block = self._block
        assert block is not None and self._token is not None
        self._sender._blocks.pop(self._token)
        try:
            if exc is None:
                # Sends made while the last ones were written (by middleware) are written
                # too, before the block closes.
                while block.jobs:
                    await write_pending(self._sender, block)
        except BaseException as e:
            exc_type, exc, tb = type(e), e, e.__traceback__
            raise
        finally:
            block.closed = True
            if block.joined is not None:
                block.joined.close()
            if self._tx is not None:
                await self._tx.__aexit__(exc_type, exc, tb)
        return None


async def write_pending(sender: Sender, block: AsyncTransaction) -> list[dramatiq.Message]:
    """Write the sends collected by ``block`` on its connection, now."""
    async with block.lock:
        if not block.jobs:
            return []
        if block.joined is not None:
            # Never on a connection whose transaction is over: SQLAlchemy gave it back to
            # its pool, and the write would open a transaction nobody commits.
            try:
                block.joined.check(f"{len(block.jobs)} send(s) collected by the block")
            except TransactionError:
                block.drop()
                raise
        taken = block.take()
        view = LoopConnection(block.conn, block.loop)
        return await in_thread(sender._write_batch, taken.jobs, taken.messages, taken.delays, view)


def _write_from_sqlalchemy(sender: Sender, block: AsyncTransaction) -> None:
    """Write ``block``'s collected sends from inside SQLAlchemy's ``commit()`` (just before
    its COMMIT) or ``begin_nested()`` (just before its SAVEPOINT): SQLAlchemy runs its
    synchronous core in a greenlet of the awaiting task, so the write is awaited there, as
    its driver awaits its own statements."""
    # SQLAlchemy is imported: the block was given one of its connections.
    util = sys.modules["sqlalchemy.util"]
    await_ = getattr(util, "await_", None) or util.await_only  # await_only before 2.1

    async def write_all() -> None:
        while block.jobs:
            await write_pending(sender, block)

    await_(write_all())


def innermost(sender: Sender) -> AsyncTransaction:
    """The innermost ``async with broker.transaction()`` block of this task.

    Raises:
      TransactionError: there is none.
    """
    block = sender._blocks.top()
    if not isinstance(block, AsyncTransaction):
        raise TransactionError(
            "write_pending_sends() is for the inside of an `async with "
            "broker.transaction(conn)` block"
        )
    return block


# -- sends outside a transaction -------------------------------------------------------------


async def enqueue_async(
    sender: Sender, message: dramatiq.Message, delay: int | None = None
) -> dramatiq.Message:
    """:meth:`PostgresBroker.enqueue_async <dramatiq_pg_broker.PostgresBroker.enqueue_async>`."""
    if isinstance(sender._blocks.top(), Batch):
        # Collected by the block around it (an async transaction, a batch): no I/O.
        return sender.send(message, delay)
    return await asyncio.to_thread(sender.send, message, delay)


async def send_async(actor: dramatiq.Actor, *args: Any, **kwargs: Any) -> dramatiq.Message:
    """``actor.send(*args, **kwargs)`` for asyncio code: the send does not block the event
    loop (see :meth:`PostgresBroker.enqueue_async
    <dramatiq_pg_broker.PostgresBroker.enqueue_async>`).

    Returns:
      Message: the stored message, as ``actor.send()`` returns it.
    """
    return await send_with_options_async(actor, args=args, kwargs=kwargs)


async def send_with_options_async(
    actor: dramatiq.Actor,
    *,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    delay: Any = None,
    **options: Any,
) -> dramatiq.Message:
    """``actor.send_with_options(...)`` for asyncio code (see :func:`send_async`).

    Parameters:
      actor(Actor): an actor of a :class:`~dramatiq_pg_broker.PostgresBroker`.
      args(tuple): positional arguments.
      kwargs(dict): keyword arguments.
      delay(int | timedelta): milliseconds (or a ``timedelta``) before the job may run.
      **options: message options, as for ``send_with_options``.

    Raises:
      TypeError: the actor's broker is not a PostgresBroker.
    """
    broker = actor.broker
    enqueue = getattr(broker, "enqueue_async", None)
    if enqueue is None:
        raise TypeError(
            f"send_async() needs an actor of a PostgresBroker; {actor.actor_name!r} belongs "
            f"to a {type(broker).__name__}"
        )
    if isinstance(delay, dt.timedelta):
        delay = int(delay.total_seconds() * 1000)
    message = actor.message_with_options(args=args, kwargs=kwargs, **options)
    return await enqueue(message, delay=delay)
