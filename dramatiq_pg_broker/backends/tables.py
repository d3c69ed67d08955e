"""What the three Dramatiq backends on PostgreSQL share: the results backend, the
rate-limiter backend and dramatiq-abort's event backend each keep expiring rows in a table
of the broker's schema.

Each takes its connections from a broker or a pool of its own (:func:`~.db.backend_connections`),
reads its statements from its own SQL file, wakes its waiters on its own notification
channel and deletes its expired rows as it writes (:class:`~.db.Reclaimer`). The rule its
rows expire by is the same for all three, and so are its statements (``sql/expiring_rows.sql``:
the read of a live key, the deletion of expired rows), each table's name and key column
filled in as identifiers. A backend names those things as class attributes; the constructor's
connection and reclaiming
parameters, :meth:`~BackendTable.prune` and :meth:`~BackendTable.close` are then the same
for all three.
"""

from __future__ import annotations

from typing import Any, ClassVar

import psycopg
from psycopg_pool import ConnectionPool

from ..db.core import Reclaimer, backend_connections
from ..db.listener import channel_for
from ..db.queries import Queries, statements_for

#: The most expired rows one reclaiming pass deletes.
DEFAULT_PRUNE_BATCH = 1000

#: Seconds between two opportunistic reclaiming passes of one backend (a pass that found a
#: full batch is followed by another at the next write).
DEFAULT_PRUNE_INTERVAL = 5.0

#: The SQL file of the statements every backend's table shares: a live key's value, the
#: deletion of expired rows.
EXPIRING_ROWS = "expiring_rows.sql"


class BackendTable:
    """A backend whose rows live, and expire, in one table of the broker's schema. Its
    constructor's keyword parameters, the same for the three backends (each adds its own):

    Parameters:
      broker(PostgresBroker): use this broker's connection pool and schema.
      url(str): otherwise, the database URL (default ``DRAMATIQ_PG_URL``).
      schema(str): the schema of the table (default: the broker's, else
        ``DRAMATIQ_PG_SCHEMA``, else ``dramatiq``).
      pool(ConnectionPool): a ready psycopg pool of autocommit connections instead of
        ``url``.
      listen(bool): wake waiters with LISTEN/NOTIFY (default: the broker's or the
        ``DRAMATIQ_PG_LISTEN`` setting, True); False polls.
      prune_batch(int): the most expired rows one opportunistic reclaiming pass deletes.
      prune_interval(float): seconds between two such passes in one process.
    """

    #: The SQL file of the backend's statements (in ``dramatiq_pg_broker/sql``).
    sql_file: ClassVar[str]
    #: The backend's table in the schema, and the column that identifies one of its rows:
    #: what the statements the tables share (``expiring_rows.sql``) are given.
    table: ClassVar[str]
    row_key: ClassVar[str] = "key"
    #: Whether the table's rows hold a ``value`` column that :meth:`live_value` reads (the
    #: abort backend's events hold none).
    holds_values: ClassVar[bool] = True
    #: The notification channel's suffix (see :func:`~.listener.channel_for`).
    channel_name: ClassVar[str]
    #: What the rows are, for the reclaimer's log line ("results", "rate-limiter keys").
    rows_name: ClassVar[str]

    def __init__(
        self,
        *,
        broker: Any = None,
        url: str | None = None,
        schema: str | None = None,
        pool: ConnectionPool | None = None,
        listen: bool | None = None,
        prune_batch: int = DEFAULT_PRUNE_BATCH,
        prune_interval: float = DEFAULT_PRUNE_INTERVAL,
    ) -> None:
        self.pool, self.settings = backend_connections(
            url=url, schema=schema, pool=pool, broker=broker, listen=listen
        )
        #: A pool this backend made (closed by :meth:`close`); a broker's is the broker's.
        self._owns_pool = broker is None
        self.schema = self.settings.schema
        self.statements = statements_for(self.schema, self.sql_file)
        #: The statements of expiring_rows.sql for this backend's table.
        self.expiring = self.expiring_statements(self.schema)
        self.channel = channel_for(self.schema, self.channel_name)
        #: Deletes expired rows as this backend writes (see :class:`~.db.Reclaimer`).
        self.reclaimer = Reclaimer(
            lambda limit: self.prune(limit=limit),
            batch=prune_batch,
            interval=prune_interval,
            what=self.rows_name,
        )

    @classmethod
    def expiring_statements(cls, schema: str) -> Queries:
        """The statements of ``sql/expiring_rows.sql`` for ``schema``'s table: this
        backend's table and key column filled in."""
        return statements_for(schema, EXPIRING_ROWS, table=cls.table, key=cls.row_key)

    @classmethod
    def prune_expired_rows(cls, conn: psycopg.Connection, schema: str, limit: int) -> int:
        """Delete at most ``limit`` expired rows of ``schema``'s table on ``conn``, oldest
        expiry first, through the expiry index; returns how many. Safe to run from several
        processes at once."""
        statement = cls.expiring_statements(schema)["prune_expired"]
        return conn.execute(statement, {"limit": int(limit)}).rowcount

    def live_value(self, key: str) -> Any:
        """The value stored under ``key``, or None when there is none or its row has
        expired (an expired row counts as absent before it is deleted)."""
        if not self.holds_values:
            raise TypeError(f"{type(self).__name__} stores no values to read")
        with self.pool.connection() as conn:
            row = conn.execute(self.expiring["live_value"], {"key": key}).fetchone()
        return None if row is None else row[0]

    def prune(self, *, limit: int | None = None) -> int:
        """Delete at most ``limit`` (default ``prune_batch``) expired rows now; returns how
        many."""
        with self.pool.connection() as conn:
            return self.prune_expired_rows(conn, self.schema, limit or self.reclaimer.batch)

    def close(self) -> None:
        """Close this backend's own pool (a broker's pool is left to the broker)."""
        if self._owns_pool:
            self.pool.close()
