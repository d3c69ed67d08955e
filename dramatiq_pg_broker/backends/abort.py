"""PostgresEventBackend: the event backend of dramatiq-abort, on PostgreSQL alone.

dramatiq-abort (a separate package: ``pip install 'dramatiq-pg-broker[abort]'``) aborts
Dramatiq messages through an :class:`~dramatiq_abort.Abortable` middleware and an event
backend; its own production backend is Redis. This one needs only the database the broker
(or the results backend) already uses::

    from dramatiq_abort import Abortable, abort
    from dramatiq_pg_broker.backends.abort import PostgresEventBackend

    broker.add_middleware(Abortable(backend=PostgresEventBackend(broker=broker)))
    ...
    abort(message.message_id)                      # from any process
    abort(message.message_id, mode=AbortMode.CANCEL)  # only if it has not started

It works with any Dramatiq broker (give ``url=`` instead of ``broker=``). With the
:class:`~dramatiq_pg_broker.PostgresBroker`, the broker's own abort
(``dramatiq-pg-broker jobs abort``, the admin API, ``broker.store.abort``) needs no
middleware and records the job as ``cancelled``; dramatiq-abort's ``Abort`` ends a job
``failed`` (it is never retried either, see :mod:`.retries`).

How it keeps dramatiq-abort's contract (``notify``, ``poll``, ``wait_many``):

- an event is a row of ``<schema>.abort_events`` (key, JSON parameters, expiry); a
  ``notify`` stores its events in one statement, valid for ``ttl`` milliseconds, and sends
  a NOTIFY per key, delivered at commit;
- ``poll`` and ``wait_many`` consume an event: the one caller whose ``DELETE`` takes the row
  gets it, as Redis's ``LPOP``/``BLPOP`` give a list element to one client. Of several
  keys, the oldest event is taken first;
- ``wait_many`` looks once, then sleeps on the process's one LISTEN connection
  (:mod:`.listener`, shared with the results backend) until a NOTIFY for one of its keys
  arrives or the timeout passes: no statement while it waits. dramatiq-abort's watcher
  calls it again every second with the running messages' keys, so a worker process sends
  about one statement a second while it runs abortable messages, none while idle. With
  ``listen=False`` (behind a transaction-mode pooler) it looks every ``poll_interval``
  instead;
- an expired event is ignored at once; its row is deleted by the broker's retention run
  (see :data:`.retention.RECLAIMERS`) and, opportunistically, by the backend itself after
  a ``notify``, a bounded batch at a time through the expiry index.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import psycopg
from psycopg.types.json import Jsonb

try:
    from dramatiq_abort import Event, EventBackend

    INSTALLED = True
except ImportError:  # the optional extra is missing: the module still imports, so that
    # retention reclaims the table's expired rows; the backend itself needs the package.
    INSTALLED = False
    EventBackend = object  # type: ignore[assignment,misc]

    class Event(NamedTuple):  # type: ignore[no-redef]
        """dramatiq-abort's event: a key and its parameters."""

        key: str
        params: dict[str, Any]


from ..db.listener import listener_for, payload_for
from .tables import DEFAULT_PRUNE_BATCH, DEFAULT_PRUNE_INTERVAL, BackendTable  # noqa: F401

__all__ = ["PostgresEventBackend", "prune_expired"]


def prune_expired(conn: psycopg.Connection, schema: str, *, limit: int = 1000) -> int:
    """Delete at most ``limit`` expired abort events of ``schema``, oldest expiry first,
    through the expiry index. Safe to run from several processes at once.

    Returns:
      int: how many events were deleted.
    """
    return PostgresEventBackend.prune_expired_rows(conn, schema, limit)


class PostgresEventBackend(BackendTable, EventBackend):
    """dramatiq-abort's event backend on a PostgreSQL table (``<schema>.abort_events``,
    created by ``dramatiq-pg-broker migrate``). See the module docstring.

    Parameters:
      broker, url, schema, pool, prune_batch, prune_interval: where the table is and how
        its expired rows are reclaimed, as for every backend of this package (see
        :class:`~dramatiq_pg_broker.backends.tables.BackendTable`).
      listen(bool): wake ``wait_many`` with LISTEN/NOTIFY (default: the broker's or the
        ``DRAMATIQ_PG_LISTEN`` setting, True). False looks every ``poll_interval``; use it
        behind PgBouncer in transaction mode.

    Raises:
      ImportError: dramatiq-abort is not installed (the ``abort`` extra).
    """

    sql_file = "abort.sql"
    table = "abort_events"
    row_key = "id"
    holds_values = False
    channel_name = "aborts"
    rows_name = "abort events"

    def __init__(self, **options: Any) -> None:
        if not INSTALLED:
            raise ImportError(
                "PostgresEventBackend is the event backend of dramatiq-abort, which is not "
                "installed: pip install 'dramatiq-pg-broker[abort]'"
            )
        super().__init__(**options)

    def notify(self, events: Iterable[Event], ttl: int) -> None:
        """Signal ``events``: each can be taken once, by :meth:`poll` or :meth:`wait_many`,
        for ``ttl`` milliseconds."""
        events = list(events)
        if not events:
            return
        for event in events:
            if not isinstance(event.params, dict):
                raise TypeError("an event's params must be a dict")
        params = {
            "keys": [event.key for event in events],
            "params": [Jsonb(event.params) for event in events],
            "ttl_ms": int(ttl),
            "channel": self.channel,
            "payloads": sorted({payload_for(event.key) for event in events}),
        }
        with self.pool.connection() as conn:
            conn.execute(self.statements["notify_events"], params)
        self.reclaimer.maybe_run()

    def poll(self, key: str) -> Event | None:
        """Take the event of ``key`` if one was signalled (never waits)."""
        return self._take([key])

    def wait_many(self, keys: Iterable[str], timeout: int) -> Event | None:
        """Take the first event signalled for any of ``keys``, waiting at most ``timeout``
        milliseconds for one; None if none came."""
        keys = list(keys)
        seconds = max(0, timeout or 0) / 1000
        if not keys:
            time.sleep(seconds)
            return None
        if self.settings.listen:
            return listener_for(self.pool.url).wait_for_any(
                self.channel, keys, lambda: self._take(keys), seconds
            )
        deadline = time.monotonic() + seconds
        while True:
            event = self._take(keys)
            left = deadline - time.monotonic()
            if event is not None or left <= 0:
                return event
            time.sleep(min(left, self.settings.poll_interval))

    def _take(self, keys: list[str]) -> Event | None:
        with self.pool.connection() as conn:
            row = conn.execute(self.statements["take_event"], {"keys": keys}).fetchone()
        if row is None:
            return None
        key, params = row
        if isinstance(
            params, (str, bytes)
        ):  # pragma: no cover - a connection without jsonb loaders
            params = json.loads(params)
        return Event(key, params if isinstance(params, dict) else {})
