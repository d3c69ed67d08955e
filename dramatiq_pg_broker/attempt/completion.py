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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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

    def check(self) -> None:
        if self.active is not None and not self.active():
            raise TransactionError(
                "the transaction of this complete_in() block ended inside the block (a "
                "commit or rollback of the application's): the job's success was not "
                "written; end the transaction after the block, not inside it"
            )

    def guarded(self) -> contextlib.AbstractContextManager[Any]:
        return self.guard() if self.guard is not None else contextlib.nullcontext()


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


def _sqlalchemy_level(obj: Any, raw: Callable[[], Any]) -> _Level:
    """A SQLAlchemy session's or connection's level: a transaction of its own, or a nested
    one (a savepoint) inside the transaction it is in."""
    began = not obj.in_transaction()
    tx = obj.begin() if began else obj.begin_nested()
    return _Level(tx, began, raw, active=lambda: tx.is_active)


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


class CompletionBlock:
    """What :meth:`CurrentJob.complete_in <dramatiq_pg_broker.CurrentJob.complete_in>`
    returns: ``with`` it for a synchronous connection, ``async with`` it for an asyncio
    one. See the module docstring."""

    def __init__(self, job: CurrentJob, conn: Any) -> None:
        self._job = job
        self._given = conn
        self._sync: contextlib.AbstractContextManager[Any] | None = None
        self._async: contextlib.AbstractAsyncContextManager[Any] | None = None

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

    @contextlib.contextmanager
    def _sync_block(self) -> Iterator[Any]:
        job = self._job
        level = _sync_level(self._given)
        with level.ctx:
            raw = level.raw()
            job.parts.sender.check_database(identity(AppConnection(raw)))
            yield self._given
            # Reached only when the block's body raised nothing.
            level.check()
            with level.guarded():
                self._complete(
                    lambda: job.parts.store.complete_in_transaction(
                        job.message.attempt, AppConnection(raw)
                    )
                )
        if level.began:
            job.parts.ledger.completion_committed(job.message.attempt)

    @contextlib.asynccontextmanager
    async def _async_block(self) -> AsyncIterator[Any]:
        job = self._job
        level = _async_level(self._given)
        async with level.ctx:
            raw = level.raw() or (await resolve_async_connection(self._given))[0]
            sender = job.parts.sender
            await in_thread(sender.check_database, await async_identity(raw))
            yield self._given
            level.check()
            view = LoopConnection(raw, asyncio.get_running_loop())
            await in_thread(
                self._complete,
                lambda: job.parts.store.complete_in_transaction(job.message.attempt, view),
            )
        if level.began:
            job.parts.ledger.completion_committed(job.message.attempt)

    def _complete(self, write: Callable[[], str | None]) -> None:
        """Write the success in the block's transaction (``write``: the statement), with
        the ledger told before and after.

        Raises:
          LostOwnership: the attempt is no longer this worker's (the transaction then
            rolls back).
        """
        job = self._job
        attempt = job.message.attempt
        ledger = job.parts.ledger
        if not ledger.completing(attempt):
            raise LostOwnership(
                f"job {attempt.id} attempt {attempt.attempt} is no longer owned by this "
                "worker (its lease was lost, it was aborted, or it was completed already): "
                "its success was not written, and this transaction must roll back"
            )
        try:
            xid = write()
        except BaseException:
            ledger.completion_undone(attempt)
            raise
        if xid is None:
            ledger.completion_undone(attempt)
            raise LostOwnership(
                f"job {attempt.id} attempt {attempt.attempt} is no longer owned by this "
                "worker (its lease expired and another worker took it, or an operator "
                "aborted it): its success was not written, and this transaction must roll "
                "back"
            )
        ledger.completion_written(attempt, xid)
