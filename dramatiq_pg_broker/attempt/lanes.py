"""The thread that empties the hot table's lanes in turn (:mod:`..jobs.lanes`).

One :class:`LaneKeeper` runs in each worker process (it starts with the first consumer,
as the heartbeat does). Once a period it asks the server to empty the lane due
(``empty_job_lane``): one process at a time does it (a transaction advisory lock; the
others are told ``busy`` and skip), and a process that finds it done already (``not
due``), or not worth doing because no snapshot holds the horizon (``not held``), sleeps
until the next period begins, plus up to a second at random so that the processes of a
fleet do not all ask at the same instant. Its calls also mark where each period's lane
begins, which the server's test of the horizon needs: a lane whose end no call saw (in
the first period after the fleet starts) is left to vacuum. A lane that could not be
emptied (its lock held, or too many rows left in it) is tried again a second later, until
its period ends. Nothing runs while the schema gate is closed.
"""

from __future__ import annotations

import logging
import random
import threading

import psycopg
from dramatiq.errors import BrokerConnectionError

from ..jobs.lanes import LaneTurn
from ..service import Service

logger = logging.getLogger("dramatiq_pg_broker.lanes")

#: How long to wait after a failure (the database unreachable, an error) before trying
#: again.
RETRY_SECONDS = 5.0

#: The spread of the processes' calls after a period begins (see the module docstring).
JITTER_SECONDS = 1.0


class LaneKeeper(Service):
    """Empties the lanes of the hot table in turn. See the module docstring.

    Parameters:
      store(JobStore): ``empty_lane()``.
      schema_gate(SchemaGate): nothing is tried before it opens.
      max_moved(int): the most rows a lane may have left to be emptied
        (:data:`~..jobs.lanes.MAX_MOVED` by default).
    """

    thread_name = "dramatiq-pg-lanes"

    def __init__(self, store, schema_gate, *, max_moved: int) -> None:
        super().__init__()
        self.store = store
        self.schema_gate = schema_gate
        self.max_moved = max_moved
        self._wake = threading.Event()
        #: The last turn this process took (for tests and logs).
        self.last: LaneTurn | None = None

    def reset(self) -> None:
        self._wake = threading.Event()
        self.last = None

    def wake(self) -> None:
        self._wake.set()

    def run(self) -> None:
        while not self.stopping.is_set():
            wait = self.turn() if self.schema_gate.is_open else RETRY_SECONDS
            self._wake.wait(max(0.05, wait))
            self._wake.clear()

    def turn(self) -> float:
        """Ask for the due lane to be emptied once; returns the seconds to wait before
        the next call."""
        try:
            turn = self.store.empty_lane(max_moved=self.max_moved)
        except BrokerConnectionError as e:
            logger.debug("Emptying a lane could not reach the database: %s", e)
            return RETRY_SECONDS
        except psycopg.errors.UndefinedFunction:
            # A schema before 0028: the gate lets code run against it only while a
            # migration is pending; try again later.
            return RETRY_SECONDS * 12
        except Exception:
            logger.exception("Emptying a lane of the jobs table failed.")
            return RETRY_SECONDS
        self.last = turn
        if turn.outcome == "emptied":
            logger.debug("Emptied lane %s of jobs (%s rows moved).", turn.lane, turn.moved)
        if turn.outcome in ("emptied", "not due", "not held"):
            return turn.next_due_seconds + random.uniform(0, JITTER_SECONDS)
        return turn.next_due_seconds
