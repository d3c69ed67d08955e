"""The application's SQLAlchemy transaction that a ``broker.transaction()`` block joined,
watched for its end.

A block given a SQLAlchemy ``Session``, ``Connection``, ``AsyncSession`` or
``AsyncConnection`` writes its jobs on the psycopg connection underneath, in the transaction
SQLAlchemy began. The application may end that transaction inside the block (FastAPI code
commits with ``await session.commit()`` where it pleases): the psycopg connection then goes
back to SQLAlchemy's pool, and a statement written on it afterwards would open a
transaction nobody commits, leaving the job to whoever gets the connection next.

:class:`JoinedTransaction` follows the transaction through SQLAlchemy's connection events
(``commit``, ``rollback`` and the savepoint events of the block's ``Connection``, listened
to on that one connection object for the block's duration):

- just before the COMMIT, it calls the block's ``before_commit`` (an async block writes the
  sends it collected there, on that connection, so they commit with the application's
  rows);
- after a rollback, it calls ``after_rollback`` (an async block drops what it collected);
- savepoints begun, rolled back and released inside the block are handed on, so that an
  async block's collected sends follow them;
- once the transaction has ended, :meth:`JoinedTransaction.check` raises
  :class:`~.errors.TransactionError` saying how it ended, and nothing is written anywhere.

A psycopg connection given directly needs none of it: the block's own ``conn.transaction()``
makes psycopg refuse a commit or rollback inside it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..errors import TransactionError

#: The connection events listened to, and the method of :class:`JoinedTransaction` each calls.
_EVENTS = {
    "commit": "_on_commit",
    "rollback": "_on_rollback",
    "savepoint": "_on_savepoint",
    "rollback_savepoint": "_on_rollback_savepoint",
    "release_savepoint": "_on_release_savepoint",
}


class JoinedTransaction:
    """The transaction of a SQLAlchemy ``Connection`` (synchronous, or the one behind an
    ``AsyncConnection``) as a ``broker.transaction()`` block joined it.

    Parameters:
      conn(sqlalchemy.engine.Connection): the connection, inside a transaction.
      session(sqlalchemy.orm.Session): the session ``conn`` belongs to, if any (the
        synchronous one behind an ``AsyncSession``).
      before_commit(callable): called just before its COMMIT (inside SQLAlchemy's
        ``commit()``: what it raises, the commit raises, and nothing is committed).
      after_rollback(callable): called after it was rolled back.
      before_savepoint(callable): called just before a savepoint begins inside the block.
      after_savepoint_rollback(callable): called after a savepoint begun inside the block
        was rolled back.
    """

    def __init__(
        self,
        conn: Any,
        *,
        session: Any = None,
        before_commit: Callable[[], None] | None = None,
        after_rollback: Callable[[], None] | None = None,
        before_savepoint: Callable[[], None] | None = None,
        after_savepoint_rollback: Callable[[], None] | None = None,
    ) -> None:
        # Never imported by the broker: a SQLAlchemy connection exists only if the
        # application imported SQLAlchemy already.
        event = self._event = sys.modules["sqlalchemy.event"]
        self.conn = conn
        self.root = conn.get_transaction()
        #: How the transaction ended inside the block ("was committed", ...); None while
        #: it is the one the block joined.
        self.ended: str | None = None
        self._before_commit = before_commit
        self._after_rollback = after_rollback
        self._before_savepoint = before_savepoint
        self._after_savepoint_rollback = after_savepoint_rollback
        #: The names of the savepoints begun inside the block and still open, innermost
        #: last (None until learned: SQLAlchemy names a savepoint after announcing it).
        self._savepoints: list[str | None] = []
        self._listening = False
        self._session = session
        # A synchronous block writes at once, and PostgreSQL itself takes its sends with a
        # savepoint: it needs no savepoint events (each listener costs ~15 us a block).
        watch_savepoints = before_savepoint is not None or after_savepoint_rollback is not None
        self._events = {
            name: method
            for name, method in _EVENTS.items()
            if watch_savepoints or "savepoint" not in name
        }
        for name, method in self._events.items():
            event.listen(conn, name, getattr(self, method))
        if session is not None:
            event.listen(session, "after_transaction_create", self._on_session_transaction)
        self._listening = True

    def close(self) -> None:
        """Stop listening (at the end of the block)."""
        if not self._listening:
            return
        self._listening = False
        for name, method in self._events.items():
            self._event.remove(self.conn, name, getattr(self, method))
        if self._session is not None:
            self._event.remove(
                self._session, "after_transaction_create", self._on_session_transaction
            )

    # -- state ---------------------------------------------------------------------------

    def why_not_current(self) -> str | None:
        """Why the block's transaction is no longer the connection's current one, or None
        if it still is."""
        if self.ended is not None:
            return self.ended
        conn = self.conn
        if conn.closed or conn.invalidated:
            return "ended: its connection was closed or invalidated"
        if conn.get_transaction() is not self.root or not (self.root and self.root.is_active):
            return "ended"
        return None

    def check(self, what: str = "this send") -> None:
        """Raise if the transaction the block joined has ended.

        Parameters:
          what(str): what would have been written, for the message.

        Raises:
          TransactionError: it ended inside the block (nothing was written).
        """
        why = self.why_not_current()
        if why is not None:
            raise TransactionError(
                f"the transaction this broker.transaction() block joined {why} inside the "
                f"block: {what} had no transaction to join and was not written anywhere; "
                "send before the commit, or open a new broker.transaction() block for the "
                "next transaction"
            )

    # -- the connection's events -------------------------------------------------------

    def _on_session_transaction(self, session: Any, transaction: Any) -> None:
        # A Session emits the SAVEPOINT of begin_nested() only when it next needs its
        # connection; the block's sends do not go through the session, and would be written
        # outside the savepoint the application believes they are in. Emitted now (inside
        # begin_nested(), in the greenlet of an AsyncSession).
        if transaction.nested and self.why_not_current() is None:
            session.connection(bind_arguments={"bind": self.conn.engine})

    def _on_commit(self, conn: Any) -> None:
        if self.ended is not None:
            return
        if self._before_commit is not None:
            self._before_commit()
        self.ended = "was committed"

    def _on_rollback(self, conn: Any) -> None:
        if self.ended is not None:
            return
        self.ended = "was rolled back"
        if self._after_rollback is not None:
            self._after_rollback()

    def _on_savepoint(self, conn: Any, name: str | None) -> None:
        if self.ended is not None:
            return
        if self._before_savepoint is not None:
            self._before_savepoint()
        self._savepoints.append(name)

    def _open_savepoint(self, name: str) -> int | None:
        """The index in ``_savepoints`` of the open savepoint ``name``, if the block began
        it."""
        # SQLAlchemy names a savepoint after it announced it: the names of the open ones
        # are read from the connection's nested transactions, innermost first.
        tx = self.conn.get_nested_transaction()
        for index in range(len(self._savepoints) - 1, -1, -1):
            if tx is None:
                break
            if self._savepoints[index] is None:
                self._savepoints[index] = getattr(tx, "_savepoint", None)
            tx = getattr(tx, "_previous_nested", None)
        if name in self._savepoints:
            return self._savepoints.index(name)
        return None

    def _on_rollback_savepoint(self, conn: Any, name: str, context: Any = None) -> None:
        if self.ended is not None:
            return
        index = self._open_savepoint(name)
        if index is not None:
            del self._savepoints[index:]
            if self._after_savepoint_rollback is not None:
                self._after_savepoint_rollback()
            return
        # A savepoint the block was opened inside of: the block's part of the transaction
        # is gone with it.
        self.ended = "was rolled back (to a savepoint begun before the block)"
        if self._after_rollback is not None:
            self._after_rollback()

    def _on_release_savepoint(self, conn: Any, name: str, context: Any = None) -> None:
        index = self._open_savepoint(name)
        if index is not None:
            del self._savepoints[index:]
