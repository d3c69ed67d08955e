"""The blocks a send can stand in: ``broker.batch()`` and ``broker.transaction(conn)``,
the context that stacks them, and the application's connection they resolve to."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import Any, overload

import dramatiq
import psycopg

from ..errors import TransactionError
from ..jobs.rows import NewJob
from .app_connections import AppConnection

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


def is_sqlalchemy_sync(obj: Any) -> bool:
    """Whether ``obj`` is a SQLAlchemy ``Session`` or ``Connection`` (SQLAlchemy is never
    imported here: an object of it exists only if the application imported it)."""
    orm = sys.modules.get("sqlalchemy.orm")
    engine = sys.modules.get("sqlalchemy.engine")
    return (orm is not None and isinstance(obj, orm.Session)) or (
        engine is not None and isinstance(obj, engine.Connection)
    )


def is_sqlalchemy_async(obj: Any) -> bool:
    """Whether ``obj`` is a SQLAlchemy ``AsyncSession`` or ``AsyncConnection``."""
    module = sys.modules.get("sqlalchemy.ext.asyncio")
    return module is not None and isinstance(obj, (module.AsyncSession, module.AsyncConnection))


def check_psycopg_driver(sa_conn: Any) -> None:
    """Refuse a SQLAlchemy connection on any driver but postgresql+psycopg (psycopg 3)."""
    dialect = sa_conn.dialect
    if dialect.name != "postgresql" or dialect.driver != "psycopg":
        raise TransactionError(
            f"broker.transaction() needs SQLAlchemy's postgresql+psycopg driver (psycopg 3); "
            f"this connection uses {dialect.name}+{dialect.driver}"
        )


def given_psycopg(obj: Any, *, asynchronous: bool) -> bool:
    """Whether ``obj`` is a psycopg connection of the block's own kind (``AsyncConnection``
    for ``async with``, ``Connection`` for ``with``), which the block writes on directly;
    False for anything else, left to be read as SQLAlchemy's. The sync and async blocks
    share this rule, so each refuses a closed connection, and one of the other kind
    (psycopg's or SQLAlchemy's), with the same sentences.

    Raises:
      TransactionError: ``obj`` is closed, or of the other kind: the sentence names the
        block it needs.
    """
    own, other = psycopg.Connection, psycopg.AsyncConnection
    if asynchronous:
        own, other = other, own
    if isinstance(obj, own):
        if obj.closed:
            raise TransactionError("broker.transaction() was given a closed connection")
        return True
    if asynchronous and (isinstance(obj, other) or is_sqlalchemy_sync(obj)):
        raise TransactionError(
            f"{type(obj).__qualname__} is a synchronous connection: enter the block with "
            "`with broker.transaction(conn)`, not `async with`"
        )
    if not asynchronous and (isinstance(obj, other) or is_sqlalchemy_async(obj)):
        raise TransactionError(
            f"{type(obj).__qualname__} is an asyncio connection: enter the block with "
            "`async with broker.transaction(conn)`, not `with`"
        )
    return False


def refuse_autocommit(driver: psycopg.Connection | psycopg.AsyncConnection) -> None:
    """Refuse the psycopg connection under a SQLAlchemy one that has no transaction to
    join (the AUTOCOMMIT isolation level), sync or async alike."""
    if driver.autocommit:
        raise TransactionError(
            "this SQLAlchemy connection uses the AUTOCOMMIT isolation level: it has no "
            "transaction for the jobs to join"
        )


def resolve_connection(obj: Any) -> tuple[psycopg.Connection, Any]:
    """The psycopg connection to write on, and the SQLAlchemy ``Connection`` whose
    transaction the block joins (None for a psycopg connection given directly: the block
    opens its own transaction on it).

    Raises:
      TransactionError: ``obj`` is not a synchronous psycopg 3 connection, nor a SQLAlchemy
        2 Session or Connection on the ``postgresql+psycopg`` driver.
    """
    if given_psycopg(obj, asynchronous=False):
        return obj, None
    sa_conn = _sqlalchemy_connection(obj)
    if sa_conn is None:
        raise TransactionError(
            f"broker.transaction() takes a psycopg 3 Connection or a SQLAlchemy 2 Session or "
            f"Connection on the postgresql+psycopg driver, not {type(obj).__module__}."
            f"{type(obj).__qualname__}"
        )
    check_psycopg_driver(sa_conn)
    driver = sa_conn.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise TransactionError(
            "broker.transaction() needs a synchronous SQLAlchemy Session or Connection "
            "(create_engine, not create_async_engine)"
        )
    refuse_autocommit(driver)
    return driver, sa_conn


# A database is named by its name and by when its server started (two servers never share
# a start time to the microsecond); a port or host name would differ between a TCP and a
# Unix-socket connection to the same server.
IDENTITY_SQL = "SELECT current_database(), pg_postmaster_start_time()"

#: What each connection reached, checked once per connection: (database, server start).
_identities: weakref.WeakKeyDictionary[psycopg.Connection, tuple] = weakref.WeakKeyDictionary()


def identity(conn: psycopg.Connection | AppConnection) -> tuple:
    """Which database on which server ``conn`` is connected to (cached per connection)."""
    key = conn.raw if isinstance(conn, AppConnection) else conn
    known = _identities.get(key)
    if known is None:
        known = tuple(conn.execute(IDENTITY_SQL).fetchone())
        _identities[key] = known
    return known
