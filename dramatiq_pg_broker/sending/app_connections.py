"""The application's connections, as the send path writes on them.

A send inside ``broker.transaction(conn)`` (or Django's ``transaction.atomic()``, or an
``async with broker.transaction(aconn)`` block) runs the job store's statements on a
connection the application owns. The store is written against a synchronous psycopg
connection; the two classes here give it one without touching what belongs to the
application:

- :class:`AppConnection` wraps a synchronous ``psycopg.Connection``. Its cursors are
  psycopg's own server-binding cursors returning tuples, whatever cursor class and row
  factory the application configured (Django's cursors bind on the client; an application
  may read rows as dicts), with psycopg's JSON loaders (Django loads ``jsonb`` as text),
  and it never lets a savepoint of the store take over the application's
  transaction (see :meth:`AppConnection.transaction`).
- :class:`LoopConnection` is the same surface over a ``psycopg.AsyncConnection``, for the
  store's code running in a worker thread: each statement is handed to the event loop that
  owns the connection and awaited there, so the loop never blocks on the database and the
  store's logic exists once.

Both offer only what the store's send path uses: ``execute()`` (with ``fetchone``,
``fetchall`` and iteration on the result), ``cursor().copy()`` (``write``,
``write_row``, ``set_types``) and ``transaction()``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg.types.json import JsonbLoader, JsonLoader

T = TypeVar("T")

#: The name of the savepoint the store's writes use on an application's connection whose
#: transaction has not sent its first statement yet.
SAVEPOINT = "dramatiq_pg_broker_sends"


def _with_json_loaders(cur: psycopg.Cursor | psycopg.AsyncCursor) -> Any:
    # The application's adapters stay (its time zone, its dumpers), but the store reads
    # jsonb as psycopg does by default: Django registers a text loader for it.
    cur.adapters.register_loader("jsonb", JsonbLoader)
    cur.adapters.register_loader("json", JsonLoader)
    return cur


def _needs_own_begin(conn: psycopg.Connection | psycopg.AsyncConnection) -> bool:
    """Whether ``conn.transaction()`` would take the application's transaction for its own:
    on a connection that is not in autocommit mode and has not sent a statement since its
    last commit, psycopg's ``transaction()`` sends BEGIN and, at its end, COMMIT. For the
    application (Django inside ``atomic()``, SQLAlchemy after ``begin()``) the transaction
    has begun already, only lazily."""
    return not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE


class AppConnection:
    """A synchronous psycopg connection that belongs to the application, as the job store
    writes on it.

    Parameters:
      conn(psycopg.Connection): the application's connection.
    """

    def __init__(self, conn: psycopg.Connection) -> None:
        self.raw = conn

    def cursor(self) -> psycopg.Cursor:
        return _with_json_loaders(psycopg.Cursor(self.raw, row_factory=tuple_row))

    def execute(self, query: Any, params: Any = None) -> psycopg.Cursor:
        return self.cursor().execute(query, params)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """A savepoint inside the application's transaction (or, on an autocommit
        connection, a transaction of its own, as psycopg's ``transaction()`` makes)."""
        if not _needs_own_begin(self.raw):
            with self.raw.transaction():
                yield
            return
        # psycopg begins the application's transaction before the SAVEPOINT, as it would
        # before any first statement; the commit stays the application's.
        with _savepoint(self):
            yield


@contextlib.contextmanager
def _savepoint(conn: AppConnection | LoopConnection) -> Iterator[None]:
    """A savepoint on an application connection: released when the block ends, rolled back
    to (then released) when it raises."""
    conn.execute(f"SAVEPOINT {SAVEPOINT}")
    try:
        yield
    except BaseException:
        conn.execute(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
        conn.execute(f"RELEASE SAVEPOINT {SAVEPOINT}")
        raise
    conn.execute(f"RELEASE SAVEPOINT {SAVEPOINT}")


class _Rows:
    """The outcome of one statement run on the loop: its rows, read at once."""

    def __init__(self, rows: list[tuple] | None, rowcount: int) -> None:
        self._rows = rows or []
        self.rowcount = rowcount

    def fetchone(self) -> tuple | None:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[tuple]:
        rows, self._rows = self._rows, []
        return rows

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.fetchall())


class _LoopCopy:
    """A COPY to the server, collected in the thread and sent by the loop in one go when
    the block ends (an error the server reports, a unique violation say, is raised there,
    as psycopg raises it at the end of a COPY)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.rows: list[Sequence[Any]] = []
        self.types: Sequence[Any] | None = None

    def write(self, data: bytes) -> None:
        self.chunks.append(data)

    def write_row(self, row: Sequence[Any]) -> None:
        self.rows.append(row)

    def set_types(self, types: Sequence[Any]) -> None:
        self.types = types


class _LoopCursor:
    def __init__(self, owner: LoopConnection) -> None:
        self._owner = owner

    def execute(self, query: Any, params: Any = None) -> _Rows:
        return self._owner.execute(query, params)

    @contextlib.contextmanager
    def copy(self, statement: Any) -> Iterator[_LoopCopy]:
        collected = _LoopCopy()
        yield collected
        self._owner.run(self._owner._copy(statement, collected))


class LoopConnection:
    """A ``psycopg.AsyncConnection`` as the job store writes on it from a worker thread:
    every statement runs on ``loop`` (the loop that owns the connection) while the thread
    waits for it.

    The coroutine that started the thread awaits it, so the application does not use the
    connection meanwhile; psycopg's own lock would serialise it anyway.

    Parameters:
      conn(psycopg.AsyncConnection): the application's connection.
      loop(asyncio.AbstractEventLoop): its event loop.
    """

    def __init__(self, conn: psycopg.AsyncConnection, loop: asyncio.AbstractEventLoop) -> None:
        self.raw = conn
        self.loop = loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the connection's loop and wait for its outcome (from a thread
        other than the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def cursor(self) -> _LoopCursor:
        return _LoopCursor(self)

    def execute(self, query: Any, params: Any = None) -> _Rows:
        return self.run(self._execute(query, params))

    async def _execute(self, query: Any, params: Any) -> _Rows:
        cur = _with_json_loaders(psycopg.AsyncCursor(self.raw, row_factory=tuple_row))
        async with cur:
            await cur.execute(query, params)
            rows = await cur.fetchall() if cur.description is not None else None
            return _Rows(rows, cur.rowcount)

    async def _copy(self, statement: Any, collected: _LoopCopy) -> None:
        async with psycopg.AsyncCursor(self.raw) as cur, cur.copy(statement) as copy:
            if collected.types is not None:
                copy.set_types(collected.types)
            for chunk in collected.chunks:
                await copy.write(chunk)
            for row in collected.rows:
                await copy.write_row(row)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """As :meth:`AppConnection.transaction`."""
        if not _needs_own_begin(self.raw):
            tx = self.raw.transaction()
            self.run(tx.__aenter__())
            try:
                yield
            except BaseException as e:
                self.run(tx.__aexit__(type(e), e, e.__traceback__))
                raise
            self.run(tx.__aexit__(None, None, None))
            return
        with _savepoint(self):
            yield
