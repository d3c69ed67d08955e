"""PostgresBackend: Dramatiq's results stored in PostgreSQL.

Use it with Dramatiq's ``Results`` middleware exactly like the Redis backend::

    from dramatiq.results import Results
    from dramatiq_pg_broker.results import PostgresBackend

    broker.add_middleware(Results(backend=PostgresBackend(broker=broker)))

A blocking ``get_result`` sleeps on LISTEN/NOTIFY (one listening connection per process,
see :mod:`.listener`) and wakes when the result is committed; it never polls the table.
The backend does not depend on the broker: with Dramatiq's Redis or RabbitMQ broker, give
it ``url=`` (and ``schema=``) instead of ``broker=``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import psycopg
from dramatiq.encoder import Encoder
from dramatiq.results import ResultBackend, ResultMissing, ResultTimeout
from dramatiq.results.backend import DEFAULT_TIMEOUT, Missing
from dramatiq.results.result import wrap_exception, wrap_result

from ..db.listener import listener_for, payload_for
from .tables import DEFAULT_PRUNE_BATCH, DEFAULT_PRUNE_INTERVAL, BackendTable  # noqa: F401

logger = logging.getLogger("dramatiq_pg_broker.results")


def prune_expired(conn: psycopg.Connection, schema: str, *, limit: int = 1000) -> int:
    """Delete at most ``limit`` expired results of ``schema``, oldest expiry first, through
    the expiry index (never a full scan). Safe to run from several processes at once.

    Parameters:
      conn(psycopg.Connection): the connection to run on (its transaction, if any, is used).
      schema(str): the schema of the results table.
      limit(int): the most rows deleted.

    Returns:
      int: how many results were deleted.
    """
    return PostgresBackend.prune_expired_rows(conn, schema, limit)


def describe_stored(value: bytes, failed: bool) -> dict[str, Any]:
    """A stored result as an operator sees it: ``{"value": ...}`` for a result,
    ``{"error": {"type": ..., "message": ...}}`` for a stored failure, and
    ``{"encoding": "binary"}`` alone when the encoder was not JSON (pickle)."""
    try:
        decoded = json.loads(bytes(value))
    except (UnicodeDecodeError, ValueError):
        return {"failed": failed, "encoding": "binary"}
    if failed and isinstance(decoded, dict) and isinstance(decoded.get("exn"), dict):
        exn = decoded["exn"]
        return {
            "failed": True,
            "encoding": "json",
            "error": {"type": exn.get("type"), "message": exn.get("msg")},
        }
    return {"failed": failed, "encoding": "json", "value": decoded}


class PostgresBackend(BackendTable, ResultBackend):
    """A Dramatiq result backend on a PostgreSQL table (``<schema>.results``, created by
    ``dramatiq-pg-broker migrate``).

    Parameters:
      broker, url, schema, pool, prune_batch, prune_interval: where the table is and how
        its expired rows are reclaimed, as for every backend of this package (see
        :class:`~dramatiq_pg_broker.backends.tables.BackendTable`).
      listen(bool): wake blocked readers with LISTEN/NOTIFY (default: the broker's or
        ``DRAMATIQ_PG_LISTEN`` setting, True). False polls as Dramatiq's base backend does;
        use it behind PgBouncer in transaction mode.
      namespace(str), encoder(Encoder), use_namespace_prefix_keys(bool): as for every
        Dramatiq result backend.
    """

    sql_file = "results.sql"
    table = "results"
    channel_name = "results"
    rows_name = "results"

    def __init__(
        self,
        *,
        namespace: str = "dramatiq-results",
        encoder: Encoder | None = None,
        use_namespace_prefix_keys: bool = False,
        **options: Any,
    ) -> None:
        ResultBackend.__init__(
            self,
            namespace=namespace,
            encoder=encoder,
            use_namespace_prefix_keys=use_namespace_prefix_keys,
        )
        BackendTable.__init__(self, **options)

    # -- reading ---------------------------------------------------------------------------

    def get_result(self, message, *, block: bool = False, timeout: int | None = None) -> Any:
        """Get a message's result.

        Parameters:
          message(Message): the message whose result to get.
          block(bool): wait for the result to be stored.
          timeout(int): the longest wait, in milliseconds (default 10 seconds). A blocked
            reader wakes within milliseconds of the commit that stores the result.

        Raises:
          ResultMissing: ``block`` is False and there is no (unexpired) result.
          ResultTimeout: no result was stored within ``timeout``.
          ResultFailure: the actor failed and its exception was stored.

        Returns:
          object: the result.
        """
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        key = self.build_message_key(message)
        if not block:
            data = self._fetch(key)
            if data is None:
                raise ResultMissing(message)
        elif not self.settings.listen:
            return super().get_result(message, block=True, timeout=timeout)
        else:
            data = listener_for(self.pool.url).wait_for(
                self.channel, key, lambda: self._fetch(key), max(0, timeout) / 1000
            )
            if data is None:
                raise ResultTimeout(message)
        return self.unwrap_result(self.encoder.decode(data))

    def _fetch(self, key: str) -> bytes | None:
        value = self.live_value(key)
        return None if value is None else bytes(value)

    def _get(self, message_key: str) -> Any:
        data = self._fetch(message_key)
        return Missing if data is None else self.encoder.decode(data)

    # -- storing ---------------------------------------------------------------------------

    def store_result(self, message, result: Any, ttl: int) -> None:
        """Store a result for ``ttl`` milliseconds and wake its blocked readers."""
        self._write(
            self.build_message_key(message), message.message_id, wrap_result(result), ttl, False
        )

    def store_exception(self, message, exception: Exception, ttl: int) -> None:
        """Store an actor's failure for ``ttl`` milliseconds; readers get ``ResultFailure``.
        Any process with this backend can do it (a worker, the reaper, an operator's tool)."""
        self._write(
            self.build_message_key(message),
            message.message_id,
            wrap_exception(exception),
            ttl,
            True,
        )

    def _store(self, message_key: str, result: Any, ttl: int) -> None:
        self._write(message_key, "", result, ttl, False)

    def _write(self, key: str, message_id: str, result: Any, ttl: int, failed: bool) -> None:
        params = {
            "key": key,
            "message_id": str(message_id),
            "value": self.encoder.encode(result),
            "failed": failed,
            "ttl_ms": int(ttl),
            "channel": self.channel,
            "payload": payload_for(key),
        }
        with self.pool.connection() as conn:
            conn.execute(self.statements["store_result"], params)
        self.reclaimer.maybe_run()

    # -- reclaiming ------------------------------------------------------------------------
