"""Group commit of concurrent writes, and retries of a write after a lost connection."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from dramatiq.errors import BrokerConnectionError
from psycopg_pool import PoolTimeout

logger = logging.getLogger("dramatiq_pg_broker.sending")


T = TypeVar("T")


# -- group commit ---------------------------------------------------------------------------


class GroupCommit:
    """Callers hand in one item each; whoever finds no write in progress writes everything
    waiting as one statement, so concurrent callers share a round trip (and a commit).

    Parameters:
      write(callable): ``write(items)`` writes a list of items in one statement and
        returns what :meth:`submit` gives each caller (a mapping keyed by ``id(item)``, a
        set of ids ...). Whatever it raises is raised to every caller of that write.
    """

    def __init__(self, write: Callable[[list[Any]], Any]) -> None:
        self._write = write
        self._cond = threading.Condition()
        self._open: dict[str, Any] = {"items": [], "done": False}
        self._busy = False

    def submit(self, item: Any) -> Any:
        """Have ``item`` written: at once when no write is in progress (a write of one),
        else with every item that arrives until the write in progress ends. Returns what
        the write of its group returned."""
        with self._cond:
            batch = self._open
            batch["items"].append(item)
            while not batch["done"]:
                if not self._busy:
                    self._busy = True
                    self._open = {"items": [], "done": False}
                    break
                self._cond.wait()
            else:
                return self._result(batch)
        try:
            batch["result"] = self._write(batch["items"])
        except BaseException as e:
            batch["error"] = e
        with self._cond:
            batch["done"] = True
            self._busy = False
            self._cond.notify_all()
        return self._result(batch)

    @property
    def waiting(self) -> int:
        """How many items wait for the write in progress to end."""
        with self._cond:
            return len(self._open["items"])

    @staticmethod
    def _result(batch: dict[str, Any]) -> Any:
        if "error" in batch:
            raise batch["error"]
        return batch["result"]


# -- retries after a connection error -----------------------------------------------------


def retrying(write: Callable[[bool], T], retries: int) -> T:
    """``write(first)``, tried again up to ``retries`` times while it fails on a
    connection error, 0.05 s after the first failure and four times longer after each
    next one.

    ``first`` is False for every try after the first, whose commit may have happened
    though its reply was lost: a send then takes a row with its own id for its own
    (returned as it is) instead of for a second send of that id. A pool timeout is not
    tried again: the pool already spent its whole timeout trying to get a connection, and
    asking again would only multiply that wait.

    Raises:
      dramatiq.errors.ConnectionError: the last try's.
    """
    delay = 0.05
    for attempt in range(retries + 1):
        try:
            return write(attempt == 0)
        except BrokerConnectionError as e:
            if attempt >= retries or isinstance(e.__cause__, PoolTimeout):
                raise
            # Told once per outage by the process (outage.py), not at every try.
            logger.debug("Enqueue failed on a connection error; retrying in %.2fs.", delay)
            time.sleep(delay)
            delay *= 4
    raise AssertionError("unreachable")  # pragma: no cover
