"""Where a send writes: the pool (one durable commit per send), the application's own
transaction (``broker.transaction(conn)``), or a batch written at the end of a block
(``broker.batch()``).

Both blocks are bound to the current thread (and asyncio task): a context variable holds a
stack of the blocks entered, and a send goes to the innermost one. Another thread's sends
are not part of a block this thread opened.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import dramatiq
import psycopg

from .errors import TransactionError
from .jobs import NewJob


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


@dataclasses.dataclass(frozen=True)
class Transaction:
    """A ``broker.transaction(conn)`` block: sends write on ``conn``."""

    conn: psycopg.Connection


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

    def connection_below(self, block: Batch) -> psycopg.Connection | None:
        """The connection of the innermost transaction block around ``block``, if any."""
        stack = self._stack.get()
        index = next(i for i in range(len(stack) - 1, -1, -1) if stack[i] is block)
        for entry in reversed(stack[:index]):
            if isinstance(entry, Transaction):
                return entry.conn
        return None

    @contextlib.contextmanager
    def pushed(self, entry: Transaction | Batch) -> Iterator[None]:
        token = self._stack.set((*self._stack.get(), entry))
        try:
            yield
        finally:
            self._stack.reset(token)


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


def resolve_connection(obj: Any) -> tuple[psycopg.Connection, bool]:
    """The psycopg connection to write on, and whether the block must open its own
    transaction on it (a psycopg connection given directly).

    Raises:
      TransactionError: ``obj`` is not a synchronous psycopg 3 connection, nor a SQLAlchemy
        2 Session or Connection on the ``postgresql+psycopg`` driver.
    """
    if isinstance(obj, psycopg.Connection):
        if obj.closed:
            raise TransactionError("broker.transaction() was given a closed connection")
        return obj, True
    if isinstance(obj, psycopg.AsyncConnection):
        raise TransactionError(
            "broker.transaction() needs a synchronous psycopg.Connection; sends are "
            "synchronous, so an AsyncConnection cannot carry them"
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
    return driver, False


#: What each connection reached, checked once per connection: (database, server start).
_identities: weakref.WeakKeyDictionary[psycopg.Connection, tuple] = weakref.WeakKeyDictionary()

# A database is named by its name and by when its server started (two servers never share
# a start time to the microsecond); a port or host name would differ between a TCP and a
# Unix-socket connection to the same server.
IDENTITY_SQL = "SELECT current_database(), pg_postmaster_start_time()"


def identity(conn: psycopg.Connection) -> tuple:
    """Which database on which server ``conn`` is connected to (cached per connection)."""
    known = _identities.get(conn)
    if known is None:
        known = tuple(conn.execute(IDENTITY_SQL).fetchone())
        _identities[conn] = known
    return known
