"""The hot table's lanes, emptied in turn (migration 0028).

The jobs table is partitioned into three lanes that take the rows sent during one
10-second period of the server's clock each, in turn, and a fourth, long lane for the rows
that outlive their lane. Once a lane has taken no insert for a whole period, while a
snapshot at least as old as its rows holds the database's horizon (VACUUM could remove
none of its dead rows), its remaining rows (delayed, running, a backlog) are copied to the
long lane and it is TRUNCATEd: the claims' index never holds more than a few periods of
dead entries, whatever snapshot another session holds open. While nothing holds the
horizon, VACUUM keeps the lanes small as it kept the single table, and no TRUNCATE makes
every session replan its statements on jobs (migration 0029). The server-side function
``empty_job_lane`` does it (the migrations' headers explain why the moved rows are safe);
the workers call it once a period (:mod:`..attempt.lanes`).
"""

from __future__ import annotations

import dataclasses

from ..db.core import read_committed
from .base import StoreBase

#: A lane with more rows than this left in it is not emptied in its period: the copy
#: would hold its lock too long (every statement on jobs waits for it). VACUUM keeps
#: it as it kept the single table.
MAX_MOVED = 2_000

#: The longest the emptying waits for the lane's lock: statements on jobs queue behind
#: the wait, so it is short, and the next try comes a second later.
LOCK_WAIT = "20 milliseconds"


@dataclasses.dataclass(frozen=True)
class LaneTurn:
    """What one call of ``empty_job_lane`` did.

    Attributes:
      lane: the lane that was due (0 to 2).
      outcome: ``emptied``, ``not due`` (done in this period already), ``not held`` (no
        snapshot as old as its rows: VACUUM keeps it), ``busy`` (another process is at
        it, or its lock was held), ``full`` (more than the limit left) or ``duplicate`` (an
        id of it is in the long lane too).
      moved: the rows copied to the long lane.
      next_due_seconds: when to call again.
    """

    lane: int
    outcome: str
    moved: int
    next_due_seconds: float


class Lanes(StoreBase):
    """The job store's emptying of the hot table's lanes (see the module docstring)."""

    def empty_lane(
        self,
        *,
        max_moved: int = MAX_MOVED,
        lock_wait: str = LOCK_WAIT,
        always: bool = False,
        conn=None,
    ) -> LaneTurn:
        """Empty the lane due in this period, if it is not yet and a snapshot holds the
        horizon (``always``: whether one does or not): one statement in a transaction
        begun READ COMMITTED whatever the database's default (the function refuses any
        other level: its snapshot must follow its lock)."""
        params = {"max_moved": max_moved, "lock_wait": lock_wait, "always": always}
        with self.pool.use(conn) as c:
            with read_committed(c).transaction():
                (row,) = c.execute(self.queries["empty_job_lane"], params).fetchall()
        lane, outcome, moved, next_due = row
        return LaneTurn(lane, outcome, moved, next_due)
