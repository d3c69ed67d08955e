"""PostgresRateLimiterBackend: Dramatiq's rate limiters, barriers and group callbacks on
PostgreSQL, shared by every process and host that reaches the database.

::

    from dramatiq.rate_limits import ConcurrentRateLimiter
    from dramatiq_pg_broker.rate_limits import PostgresRateLimiterBackend

    backend = PostgresRateLimiterBackend(broker=broker)
    mutex = ConcurrentRateLimiter(backend, "send-invoices", limit=1)

Keys live in the unlogged table ``<schema>.rate_limits`` (see the migration for why
unlogged). Every operation is one atomic statement, except ``incr_and_sum``, a short
transaction that locks the keys it sums. ``wait`` sleeps on LISTEN/NOTIFY.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from dramatiq.rate_limits import RateLimiterBackend

from ..db.listener import listener_for, payload_for
from .tables import DEFAULT_PRUNE_BATCH, DEFAULT_PRUNE_INTERVAL, BackendTable  # noqa: F401

#: The bounds of a stored value (PostgreSQL's bigint).
MIN_VALUE = -(2**63)
MAX_VALUE = 2**63 - 1


def prune_expired(conn: psycopg.Connection, schema: str, *, limit: int = 1000) -> int:
    """Delete at most ``limit`` expired rate-limiter keys of ``schema``, oldest expiry
    first, through the expiry index. Safe to run from several processes at once.

    Parameters:
      conn(psycopg.Connection): the connection to run on.
      schema(str): the schema of the rate_limits table.
      limit(int): the most rows deleted.

    Returns:
      int: how many keys were deleted.
    """
    return PostgresRateLimiterBackend.prune_expired_rows(conn, schema, limit)


class PostgresRateLimiterBackend(BackendTable, RateLimiterBackend):
    """A Dramatiq rate-limiter backend on PostgreSQL. Works with ``ConcurrentRateLimiter``,
    ``WindowRateLimiter``, ``BucketRateLimiter``, ``Barrier`` and the ``GroupCallbacks``
    middleware, with any Dramatiq broker.

    Values and expiries follow Dramatiq's Redis backend: an operation that would pass its
    bound changes nothing and returns False; a key past its TTL counts as absent.

    Parameters:
      broker, url, schema, pool, prune_batch, prune_interval: where the table is and how
        its expired rows are reclaimed, as for every backend of this package (see
        :class:`~dramatiq_pg_broker.backends.tables.BackendTable`).
      listen(bool): wake ``wait`` with LISTEN/NOTIFY (default True); False polls.
    """

    sql_file = "rate_limits.sql"
    table = "rate_limits"
    channel_name = "rate_limits"
    rows_name = "rate-limiter keys"

    def _run(self, name: str, params: dict[str, Any]) -> list[tuple]:
        with self.pool.connection() as conn:
            rows = conn.execute(self.statements[name], params).fetchall()
        self.reclaimer.maybe_run()
        return rows

    def add(self, key: str, value: int, ttl: int) -> bool:
        """Create ``key`` with ``value`` for ``ttl`` milliseconds unless it exists; True if
        it was created."""
        rows = self._run("add_key", {"key": key, "value": int(value), "ttl_ms": int(ttl)})
        return bool(rows)

    def incr(self, key: str, amount: int, maximum: int, ttl: int) -> bool:
        """Add ``amount`` to ``key`` (0 if absent) unless the result would pass ``maximum``;
        the key then lives ``ttl`` milliseconds. True if it changed."""
        return self._adjust(key, int(amount), MIN_VALUE, int(maximum), ttl)

    def decr(self, key: str, amount: int, minimum: int, ttl: int) -> bool:
        """Subtract ``amount`` from ``key`` (0 if absent) unless the result would fall below
        ``minimum``; the key then lives ``ttl`` milliseconds. True if it changed."""
        return self._adjust(key, -int(amount), int(minimum), MAX_VALUE, ttl)

    def _adjust(self, key: str, delta: int, lower: int, upper: int, ttl: int) -> bool:
        params = {"key": key, "delta": delta, "lower": lower, "upper": upper, "ttl_ms": int(ttl)}
        return bool(self._run("adjust_key", params))

    def incr_and_sum(
        self,
        key: str,
        keys: Callable[[], Iterable[str]],
        amount: int,
        maximum: int,
        ttl: int,
    ) -> bool:
        """Add ``amount`` to ``key`` unless its value, or ``amount`` plus the sum of the
        values of ``keys()``, would pass ``maximum``. True if it changed.

        Every key of the sum is locked for the length of one short transaction, so two
        callers summing overlapping windows (WindowRateLimiter at a second boundary) can
        never both pass the limit.
        """
        summed = list(dict.fromkeys(keys()))
        locked = sorted(set(summed) | {key})
        ttl_ms = int(ttl)
        with self.pool.connection() as conn, conn.transaction():
            conn.execute(self.statements["lock_keys"], {"keys": locked, "ttl_ms": ttl_ms})
            rows = conn.execute(
                self.statements["incr_within_sum"],
                {
                    "key": key,
                    "keys": summed,
                    "amount": int(amount),
                    "maximum": int(maximum),
                    "ttl_ms": ttl_ms,
                },
            ).fetchall()
        self.reclaimer.maybe_run()
        return bool(rows)

    def wait(self, key: str, timeout: int | None) -> bool:
        """Wait until an event is notified on ``key`` (or one notified earlier is still
        alive), at most ``timeout`` milliseconds (None: no limit). True if there was one."""
        seconds = None if timeout is None else max(0, timeout) / 1000

        def check() -> bool | None:
            return True if self.live_value(key) is not None else None

        if not self.settings.listen:
            return self._poll(check, seconds)
        return bool(listener_for(self.pool.url).wait_for(self.channel, key, check, seconds))

    @staticmethod
    def _poll(check: Callable[[], bool | None], seconds: float | None) -> bool:
        deadline = None if seconds is None else time.monotonic() + seconds
        delay = 0.01
        while True:
            if check():
                return True
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                delay = min(delay, remaining)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def wait_notify(self, key: str, ttl: int) -> None:
        """Record an event on ``key`` for ``ttl`` milliseconds and wake its waiters."""
        self._run(
            "notify_key",
            {"key": key, "ttl_ms": int(ttl), "channel": self.channel, "payload": payload_for(key)},
        )
