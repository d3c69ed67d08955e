"""The planner statistics of the job tables, kept up with a burst.

PostgreSQL plans each statement from a table's size as its last ANALYZE (or VACUUM)
counted it, and the workers' connections keep their prepared plans until the next one.
The jobs table swings between empty and a backlog: when a burst follows a drained spell,
the statistics still count the table empty, and a statement prepared meanwhile (the
send's id probe, measured) is planned as a read of the whole table, at every execution,
until autovacuum analyzes it again (up to its naptime, a minute by default; never on a
server without it). Measured for 10,000 sends after a drained 20,000-job backlog: 10,015
sequential scans of jobs reading 50,015,000 rows, and 554 and 625 sends/s against 965 and
1,033 when the probe used its index.

A busy worker's heartbeat (:class:`~..attempt.leases.LeaseKeeper`) therefore asks
:meth:`Statistics.refresh_statistics` whether a job table holds far more rows than its
statistics say (the server's running count of live rows, read without a scan), and
analyzes the ones that do: the ANALYZE replaces the statistics and every cached plan on
those tables is made again. Across processes one runs it at a time (a transaction
advisory lock; the others skip), and it waits at most :data:`LOCK_TIMEOUT` for a VACUUM
or ANALYZE already on the table (autovacuum's), then leaves it to that one.
"""

from __future__ import annotations

import psycopg

from .base import StoreBase

#: Fewest live rows a table must hold before its statistics are refreshed here: below
#: that a sequential scan is cheap, and autovacuum's own threshold catches up soon.
MIN_ROWS = 10_000

#: The longest an ANALYZE waits for its lock (an autovacuum run on the same table).
LOCK_TIMEOUT = "200ms"


class Statistics(StoreBase):
    """The job store's upkeep of its tables' planner statistics (see the module
    docstring)."""

    def refresh_statistics(self, *, conn=None, min_rows: int = MIN_ROWS) -> list[str]:
        """ANALYZE the job tables that hold at least four times the rows (and at least
        ``min_rows``) their statistics count; returns their names. Nothing when another
        process is at it, or when a VACUUM or ANALYZE of the table holds it longer than
        :data:`LOCK_TIMEOUT`."""
        with self.pool.use(conn) as c:
            try:
                with c.transaction():
                    lock = c.execute(
                        "SELECT pg_try_advisory_xact_lock(hashtext(%s))",
                        (f"dramatiq_pg_broker.statistics.{self.schema}",),
                    ).fetchone()[0]
                    if not lock:
                        return []
                    stale = [
                        row[0]
                        for row in c.execute(
                            self.queries["stale_statistics"], {"min_rows": min_rows}
                        )
                    ]
                    if stale:
                        c.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                    for table in stale:
                        # The name comes from regclass's own output: quoted as needed.
                        c.execute(f"ANALYZE {table}")
            except psycopg.errors.LockNotAvailable:
                return []
        return stale
