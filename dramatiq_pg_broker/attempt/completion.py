"""A job's success committed in the actor's own transaction: ``current_job().complete_in()``.

::

    @dramatiq.actor
    def charge(order_id):
        with psycopg.connect(APP_URL) as conn:
            with current_job().complete_in(conn):
                conn.execute("INSERT INTO charges (order_id) VALUES (%s)", (order_id,))

The block writes the job's success (the move to history with its ``succeeded`` event, the
statement the worker itself runs at the ack, guarded by the attempt's owner and number)
on the application's connection, in its transaction, just before that transaction
commits. Both commit together or not at all: once the commit is through, no crash, lease
expiry or retry can run the job's database work a second time.

How the block's transaction is chosen, for each kind of connection:

- a psycopg ``Connection`` or ``AsyncConnection``: ``conn.transaction()``, a transaction
  the block begins and commits, or a savepoint inside one the application opened;
- a SQLAlchemy ``Session`` or ``Connection`` (``AsyncSession``, ``AsyncConnection``):
  ``begin()``, committed by the block, when no transaction is open; ``begin_nested()`` (a
  savepoint) inside the application's transaction;
- a Django connection (``django.db.connection``, ``connections[alias]``):
  ``transaction.atomic()``, which begins and commits, or is a savepoint inside an open
  ``atomic()`` block.

A block inside the application's transaction (a savepoint) commits nothing itself: the
job succeeds when the application commits, and not if it rolls back. The worker learns
which once the actor returned (:meth:`.Ledger.resolve_completion`). If the worker no
longer owns the attempt when the block ends, the block raises
:class:`~.errors.LostOwnership` before anything is committed, and its transaction (or
savepoint) rolls back with the actor's writes.

The success statement locks the job's row until the application's transaction ends; the
worker's heartbeat leaves that attempt alone meanwhile, so it never waits for the
application (:meth:`.Ledger.completing`).

Isolation levels. At READ COMMITTED (and READ UNCOMMITTED, which PostgreSQL runs as READ
COMMITTED) each statement sees the rows as they are when it runs, and the success
statement finds the row's latest version whatever the worker wrote before. At REPEATABLE
READ and SERIALIZABLE the transaction keeps the snapshot of its first statement, and
PostgreSQL refuses (a serialization failure) to delete a row written after it; the worker
writes the job's row while the actor runs (its start, its lease renewals). So at these
levels the block begins by pinning the row (:meth:`.Ledger.pin_completion`): the worker
writes it once more, stops writing it, and the block's first statement locks it and checks
that the transaction sees that last version (``lock_for_completion``). It does when the
block's statement is the transaction's first read (the block began the transaction, or
the application's transaction has read nothing yet); a transaction that read before the
block has an older snapshot, and is refused at once with :class:`~.errors.TransactionError`
naming its level: its success could never be written.

A commit inside the block: psycopg (``conn.commit()`` inside ``conn.transaction()``) and
Django (inside ``atomic()``) refuse it themselves. SQLAlchemy allows ``commit()`` anywhere,
so while the block's body runs it listens for that commit (``before_commit`` of a
``Session``, ``commit`` of a ``Connection``) and writes the job's success just before it:
the application's commit commits the job's success with its writes, as the block's end
would have. SQLAlchemy then refuses further statements inside the block's ``begin()``.

How a block ends. On every way out, an exception raised anywhere in it included, the block
tells the ledger what it left (:meth:`.Ledger.completion_ended`): nothing (its transaction
or savepoint rolled back, or the success was never written: the attempt goes on as any
other, its lease renewed again at once, and a block tried again in the same attempt may
write the success), a committed success, a success in the application's transaction that
goes on, or one in a transaction that ended in a way it cannot see (its commit raised),
which the transaction's id settles. No attempt stays marked once its block is over. While
a block's transaction holds the job's row, the actor's own ``renew()`` writes nothing and
``progress()`` its event alone (:meth:`.Ledger.holds_row`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import importlib
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.pq import TransactionStatus

from ..errors import LostOwnership, TransactionError
from ..sending.app_connections import AppConnection, LoopConnection
from ..sending.async_sending import identity as async_identity
from ..sending.async_sending import in_thread, resolve_async_connection
from ..sending.blocks import (
    identity,
    is_sqlalchemy_async,
    is_sqlalchemy_sync,
    resolve_connection,
)
from .states import BlockEnd

if TYPE_CHECKING:
    from .current import CurrentJob


@dataclasses.dataclass(frozen=True)
class _Level:
    """The transaction level a block opened on the application's connection."""

    #: The framework's own transaction block: ``conn.transaction()``, ``begin()``,
    #: ``begin_nested()``, ``atomic()``.
    ctx: Any
    #: The block begins (and commits) the transaction, rather than a savepoint in it.
    began: bool
    #: The psycopg connection underneath, once ``ctx`` was entered.
    raw: Callable[[], Any]
    #: Whether the transaction is still open (None: the block cannot tell).
    active: Callable[[], bool] | None = dataclasses.field(default=None, kw_only=True)
    #: ``guard()``: the block the success is written in (None: none).
    guard: Callable[[], contextlib.AbstractContextManager[Any]] | None = dataclasses.field(
        default=None, kw_only=True
    )
    #: ``hooks(on_commit)``: while the block's body runs, ``on_commit()`` is called just
    #: before the application commits the transaction from inside the block (SQLAlchemy).
    #: None: the framework refuses such a commit itself (psycopg, Django).
    hooks: Callable[[Callable[[], None]], contextlib.AbstractContextManager[Any]] | None = (
        dataclasses.field(default=None, kw_only=True)
    )

    def check(self) -> None:
        if self.active is not None and not self.active():
            raise TransactionError(
                "the transaction of this complete_in() block ended inside the block (a "
                "commit or rollback of the application's): the job's success was not "
                "written; end the transaction after the block, not inside it"
            )

    def guarded(self) -> contextlib.AbstractContextManager[Any]:
        return self.guard() if self.guard is not None else contextlib.nullcontext()

    def hooked(self, on_commit: Callable[[], None]) -> contextlib.AbstractContextManager[Any]:
        return self.hooks(on_commit) if self.hooks is not None else contextlib.nullcontext()


def _needs(name: str) -> Any:
    """A module of the application's framework, only if the application imported it (the
    broker depends on neither SQLAlchemy nor Django)."""
    return sys.modules.get(name)


def _django_wrapper(obj: Any) -> Any:
    """The Django ``DatabaseWrapper`` behind ``obj`` (``django.db.connection`` is a proxy
    to this thread's wrapper of the default alias), or None."""
    base = _needs("django.db.backends.base.base")
    if base is None:
        return None
    if isinstance(obj, base.BaseDatabaseWrapper):
        return obj
    proxies = _needs("django.utils.connection")
    if proxies is not None and isinstance(obj, proxies.ConnectionProxy):
        return _needs("django.db").connections[obj.alias]
    return None


def _django_level(wrapper: Any) -> _Level:
    transaction = _needs("django.db.transaction")
    alias = wrapper.alias
    # Outside atomic() in autocommit mode atomic() begins and commits; anywhere else it is a
    # savepoint (or, after set_autocommit(False), the application's transaction).
    began = not wrapper.in_atomic_block and wrapper.autocommit

    def raw() -> psycopg.Connection:
        conn = wrapper.connection
        if not isinstance(conn, psycopg.Connection):
            raise TransactionError(
                "complete_in() needs Django's PostgreSQL backend on psycopg 3 (the psycopg "
                f"package); the {alias!r} database uses {type(conn).__module__}"
            )
        return conn

    @contextlib.contextmanager
    def guard() -> Iterator[None]:
        # As for a query through Django: refused in a block marked for rollback; a failed
        # statement marks the block, so that Django rolls back rather than commits.
        wrapper.validate_no_broken_transaction()
        try:
            yield
        except Exception:
            transaction.set_rollback(True, using=alias)
            raise

    return _Level(transaction.atomic(using=alias), began, raw, guard=guard)


def _psycopg_level(conn: psycopg.Connection | psycopg.AsyncConnection) -> _Level:
    """The block's level on a psycopg connection, sync or asyncio: its transaction (or a
    savepoint in the one already open)."""
    if conn.closed:
        raise TransactionError("complete_in() was given a closed connection")
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise TransactionError(
            "complete_in() was given a connection whose transaction failed: roll it back"
        )
    return _Level(conn.transaction(), status == TransactionStatus.IDLE, lambda: conn)


def _sqlalchemy_hooks(obj: Any) -> Callable[[Callable[[], None]], Any]:
    """``hooks(on_commit)`` for a SQLAlchemy session or connection (sync or asyncio): a
    listener, for the block's body only, that calls ``on_commit()`` before the
    application's commit reaches the database. A session's commit of a nested transaction
    (a savepoint released) commits nothing and is let by; a connection's ``commit`` event
    is its root transaction's only."""

    @contextlib.contextmanager
    def hooks(on_commit: Callable[[], None]) -> Iterator[None]:
        event = importlib.import_module("sqlalchemy.event")
        orm = importlib.import_module("sqlalchemy.orm")
        # An asyncio session or connection fires the events of the synchronous one it
        # wraps (started by now: the block's transaction has begun).
        target = getattr(obj, "sync_session", None) or getattr(obj, "sync_connection", obj)
        if isinstance(target, orm.Session):
            name = "before_commit"

            def listener(session: Any) -> None:
                if not session.in_nested_transaction():
                    on_commit()

        else:
            name = "commit"

            def listener(connection: Any) -> None:
                on_commit()

        event.listen(target, name, listener)
        try:
            yield
        finally:
            event.remove(target, name, listener)

    return hooks


def _sqlalchemy_level(obj: Any, raw: Callable[[], Any]) -> _Level:
    """A SQLAlchemy session's or connection's level: a transaction of its own, or a nested
    one (a savepoint) inside the transaction it is in."""
    began = not obj.in_transaction()
    tx = obj.begin() if began else obj.begin_nested()
    return _Level(tx, began, raw, active=lambda: tx.is_active, hooks=_sqlalchemy_hooks(obj))


async def _adapted_view(obj: Any) -> _AdaptedConnection:
    """The DBAPI connection under a SQLAlchemy ``AsyncSession`` or ``AsyncConnection``, as
    the store writes on it from one of SQLAlchemy's synchronous event hooks: SQLAlchemy
    runs them in its greenlet, where the adapter's cursor awaits each statement on the
    event loop. Looked up when the block begins (a session refuses it during a commit)."""
    if hasattr(obj, "sync_session"):
        sa_conn = (await obj.connection()).sync_connection
    else:
        sa_conn = obj.sync_connection
    return _AdaptedConnection(sa_conn.connection.dbapi_connection)


class _AdaptedConnection:
    """``execute()`` as the store uses it, on SQLAlchemy's asyncio DBAPI adapter."""

    def __init__(self, dbapi: Any) -> None:
        self.dbapi = dbapi

    def execute(self, query: Any, params: Any = None) -> Any:
        cursor = self.dbapi.cursor()
        cursor.execute(query, params)
        return cursor


#: The levels at which the block pins the job's row first (see the module docstring).
_SNAPSHOT_LEVELS = ("repeatable read", "serializable")


def _isolation(conn: Any, level: _Level, store: Any) -> str:
    """The isolation level of the block's transaction (``read committed``, ...): the
    connection's own setting for a transaction the block begins, else the server's word
    (``SHOW``, which takes no snapshot)."""
    configured = getattr(conn.raw, "isolation_level", None)
    if level.began and configured is not None:
        return configured.name.lower().replace("_", " ")
    return store.transaction_isolation(conn)


def _sync_level(obj: Any) -> _Level:
    if isinstance(obj, psycopg.Connection):
        return _psycopg_level(obj)
    wrapper = _django_wrapper(obj)
    if wrapper is not None:
        return _django_level(wrapper)
    if isinstance(obj, psycopg.AsyncConnection) or is_sqlalchemy_async(obj):
        raise TransactionError(
            f"{type(obj).__qualname__} is an asyncio connection: enter the block with "
            "`async with current_job().complete_in(conn)`, not `with`"
        )
    if not is_sqlalchemy_sync(obj):
        raise TransactionError(
            "complete_in() takes a psycopg 3 Connection, a SQLAlchemy 2 Session or "
            "Connection on the postgresql+psycopg driver, or a Django connection, not "
            f"{type(obj).__module__}.{type(obj).__qualname__}"
        )
    return _sqlalchemy_level(obj, lambda: resolve_connection(obj)[0])


def _async_level(obj: Any) -> _Level:
    if isinstance(obj, psycopg.AsyncConnection):
        return _psycopg_level(obj)
    if isinstance(obj, psycopg.Connection) or is_sqlalchemy_sync(obj) or _django_wrapper(obj):
        raise TransactionError(
            f"{type(obj).__qualname__} is a synchronous connection: enter the block with "
            "`with current_job().complete_in(conn)`, not `async with`"
        )
    if not is_sqlalchemy_async(obj):
        raise TransactionError(
            "`async with complete_in()` takes a psycopg 3 AsyncConnection or a SQLAlchemy 2 "
            "AsyncSession or AsyncConnection on the postgresql+psycopg driver, not "
            f"{type(obj).__module__}.{type(obj).__qualname__}"
        )
    return _sqlalchemy_level(obj, lambda: None)


#: The ``complete_in()`` block this context is inside, if any: its attempt, the psycopg
#: connection its transaction is on, and the block (see
#: :meth:`CompletionBlock._joins_enclosing`).
_enclosing: contextvars.ContextVar[tuple[Any, Any, CompletionBlock] | None] = (
    contextvars.ContextVar("dramatiq_pg_broker_completion_block", default=None)
)


class CompletionBlock:
    """What :meth:`CurrentJob.complete_in <dramatiq_pg_broker.CurrentJob.complete_in>`
    returns: ``with`` it for a synchronous connection, ``async with`` it for an asyncio
    one. See the module docstring."""

    def __init__(self, job: CurrentJob, conn: Any) -> None:
        self._job = job
        self._given = conn
        self._sync: contextlib.AbstractContextManager[Any] | None = None
        self._async: contextlib.AbstractAsyncContextManager[Any] | None = None
        #: The job's row was pinned when the block began (REPEATABLE READ, SERIALIZABLE).
        self._pinned = False
        #: The success is written in the transaction (by the block's end, or just before
        #: the application's commit inside the block).
        self._written = False
        #: ... by the application's commit inside the block, which committed it then.
        self._by_commit = False

    def __enter__(self) -> Any:
        self._sync = self._sync_block()
        return self._sync.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        assert self._sync is not None
        return self._sync.__exit__(*exc)

    async def __aenter__(self) -> Any:
        self._async = self._async_block()
        return await self._async.__aenter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._async is not None
        return await self._async.__aexit__(*exc)

    # -- the two shapes --------------------------------------------------------------------
    #
    # Each tells the ledger how it ended on every way out (_ended): whatever its body, its
    # commit or an exception raised in its thread at any instruction (an abort, a time
    # limit) did, the attempt is not left marked once the block is over.

    @contextlib.contextmanager
    def _sync_block(self) -> Iterator[Any]:
        job = self._job
        level = _sync_level(self._given)
        inside: list[BaseException] = []
        try:
            with level.ctx:
                try:
                    raw = level.raw()
                    if self._joins_enclosing(raw):
                        yield self._given
                        return
                    view = AppConnection(raw)
                    self._open(view, level, lambda: job.parts.sender.check_database(identity(view)))

                    def write() -> str | None:
                        return job.parts.store.complete_in_transaction(job.message.attempt, view)

                    token = _enclosing.set((job.message.attempt, raw, self))
                    try:
                        with level.hooked(lambda: self._before_commit(write)):
                            yield self._given
                    finally:
                        _enclosing.reset(token)
                    # Reached only when the block's body raised nothing.
                    if not self._written:
                        level.check()
                        with level.guarded():
                            self._complete(write)
                except BaseException as e:
                    inside.append(e)
                    raise
        except BaseException as e:
            self._ended(level, raised=True, rolled_back=bool(inside) and e is inside[0])
            raise
        self._ended(level, raised=False, rolled_back=False)

    @contextlib.asynccontextmanager
    async def _async_block(self) -> AsyncIterator[Any]:
        job = self._job
        level = _async_level(self._given)
        inside: list[BaseException] = []
        try:
            async with level.ctx:
                try:
                    raw = level.raw() or (await resolve_async_connection(self._given))[0]
                    if self._joins_enclosing(raw):
                        yield self._given
                        return
                    sender = job.parts.sender
                    view = LoopConnection(raw, asyncio.get_running_loop())
                    await in_thread(
                        self._open,
                        view,
                        level,
                        lambda: sender.check_database(view.run(async_identity(raw))),
                    )
                    store = job.parts.store
                    adapted = await _adapted_view(self._given) if level.hooks is not None else None

                    def write_in_hook() -> str | None:
                        return store.complete_in_transaction(job.message.attempt, adapted)

                    token = _enclosing.set((job.message.attempt, raw, self))
                    try:
                        with level.hooked(lambda: self._before_commit(write_in_hook)):
                            yield self._given
                    finally:
                        _enclosing.reset(token)
                    if not self._written:
                        level.check()
                        await in_thread(
                            self._complete,
                            lambda: store.complete_in_transaction(job.message.attempt, view),
                        )
                except BaseException as e:
                    inside.append(e)
                    raise
        except BaseException as e:
            rolled_back = bool(inside) and e is inside[0]
            await in_thread(lambda: self._ended(level, raised=True, rolled_back=rolled_back))
            raise
        await in_thread(lambda: self._ended(level, raised=False, rolled_back=False))

    # -- the steps -------------------------------------------------------------------------

    def _joins_enclosing(self, raw: Any) -> bool:
        """Whether this block is inside the body of another block of the same attempt on
        the same connection (a helper that wraps its writes in ``complete_in()``, called
        from the actor's own block): it is then a savepoint of that block's transaction,
        which writes the job's success at its end, and does nothing more itself. (Marking
        the attempt again would refuse the outer block's success: ``LostOwnership`` on
        every attempt.) Not once that block wrote the success (a SQLAlchemy commit inside
        it): the job has succeeded, and this block is a second one."""
        enclosing = _enclosing.get()
        return (
            enclosing is not None
            and enclosing[0] == self._job.message.attempt
            and enclosing[1] is raw
            and not enclosing[2]._written
        )

    def _open(self, conn: Any, level: _Level, check_database: Callable[[], None]) -> None:
        """Check that the connection reaches the broker's database (``check_database``),
        and pin the job's row when the block's transaction keeps one snapshot (REPEATABLE
        READ, SERIALIZABLE): see the module docstring. The pin comes before the check's
        query, which may be the transaction's first read. (A refusal leaves the attempt
        marked: the block's end undoes it, as on every way out.)

        Raises:
          LostOwnership: the attempt is no longer this worker's, or its abort was
            requested.
          TransactionError: the connection reaches another database, or the transaction
            took its snapshot before the block, so the job's success can never be written
            in it.
        """
        job = self._job
        isolation = _isolation(conn, level, job.parts.store)
        if isolation not in _SNAPSHOT_LEVELS:
            check_database()
            return
        attempt = job.message.attempt
        pinned = job.parts.ledger.pin_completion(attempt, self)
        if pinned is None:
            raise self._lost("its success cannot be written, and the block does not begin")
        # Before the check's query, which may take the transaction's snapshot: a lane of
        # jobs emptied after it would hide the job's row from it (migration 0028).
        job.parts.store.lock_lanes_for_completion(conn)
        check_database()
        try:
            fresh, owned = job.parts.store.lock_for_completion(attempt, pinned, conn)
        except psycopg.errors.SerializationFailure as e:
            # The lock itself may refuse a snapshot older than the row's latest version
            # (whether it does depends on what else wrote the row meanwhile: the worker's
            # lease renewal in flight when the block began). Once pinned, only an
            # operator's abort writes the row; anything else means the same as a stale view.
            if self._row_taken():
                raise self._lost(
                    "its success cannot be written, and the block does not begin"
                ) from e
            raise self._stale_snapshot(isolation) from e
        if not fresh:
            # (What an older snapshot says of the row's owner is of no use: the pin, just
            # before, found the attempt this worker's.)
            raise self._stale_snapshot(isolation)
        if not owned:
            # An operator's abort came between the pin and the transaction's snapshot.
            raise self._lost("its success cannot be written, and the block does not begin")
        self._pinned = True

    @staticmethod
    def _stale_snapshot(isolation: str) -> TransactionError:
        """The refusal of a block whose transaction took its snapshot before it began."""
        return TransactionError(
            f"this complete_in() block is inside a {isolation.upper()} transaction that "
            "read the database before the block began: its snapshot is older than the "
            "job's row, which the worker writes while the actor runs (its start, its "
            "lease), and PostgreSQL refuses, at this isolation level, the write of the "
            "job's success on a row changed since the snapshot. Begin the transaction "
            "with the block (no transaction open, or one that has read nothing yet, "
            "when the block starts), or run it at READ COMMITTED"
        )

    def _before_commit(self, write: Callable[[], str | None]) -> None:
        """The application commits the block's transaction from inside the block
        (SQLAlchemy): the job's success is written first, and commits with it."""
        if self._written:
            return
        self._complete(write)
        self._by_commit = True

    def _ended(self, level: _Level, *, raised: bool, rolled_back: bool) -> None:
        """The block ended (``raised``: by an exception, which ``rolled_back`` the
        block's transaction or savepoint on its way out): tell the ledger what it left."""
        if not self._written or (raised and rolled_back and not self._by_commit):
            # Never written, or written in a transaction or savepoint that rolled back.
            how = BlockEnd.NOT_WRITTEN
        elif self._by_commit or raised:
            # The application's commit inside the block (through, or raised), or the
            # block's own end raised after the success was written (its COMMIT, the
            # release of its savepoint): the transaction's id says what stands.
            how = BlockEnd.ENDED
        elif level.began:
            how = BlockEnd.COMMITTED
        else:
            how = BlockEnd.OPEN
        self._job.parts.ledger.completion_ended(self._job.message.attempt, self, how)

    def _lost(self, what: str) -> LostOwnership:
        attempt = self._job.message.attempt
        return LostOwnership(
            f"job {attempt.id} attempt {attempt.attempt} is no longer owned by this "
            "worker (its lease expired and another worker took it, an operator aborted "
            f"it, or it was completed already): {what}; this transaction must roll back"
        )

    def _complete(self, write: Callable[[], str | None]) -> None:
        """Write the success in the block's transaction (``write``: the statement), with
        the ledger told before and after (and at the block's end, :meth:`_ended`).

        Raises:
          LostOwnership: the attempt is no longer this worker's (the transaction then
            rolls back).
        """
        job = self._job
        attempt = job.message.attempt
        ledger = job.parts.ledger
        if self._pinned:
            # Pinned when the block began: the heartbeat left the row alone since.
            if ledger.abort_requested(attempt):
                raise self._lost("its success was not written")
        elif not ledger.completing(attempt, self):
            raise self._lost("its success was not written")
        try:
            xid = write()
        except psycopg.errors.SerializationFailure as e:
            if self._pinned and self._row_taken():
                # Only an operator's abort writes a pinned row: the snapshot missed it.
                raise self._lost("its success was not written") from e
            raise
        if xid is None:
            raise self._lost("its success was not written")
        ledger.completion_written(attempt, xid)
        self._written = True

    def _row_taken(self) -> bool:
        """Whether the job's row, as it is now, is no longer this attempt's running one
        with no abort requested (read on the broker's pool)."""
        job = self._job
        attempt = job.message.attempt
        if job.parts.ledger.abort_requested(attempt):
            return True
        try:
            row = job.parts.store.get(attempt.id)
        except Exception:
            return False
        return not (
            row["status"] == "running"
            and row["locked_by"] == attempt.owner
            and row["attempts"] == attempt.attempt
            and row["abort_requested_at"] is None
        )
