"""PostgresBroker: a Dramatiq broker that stores every message as a job row.

Swap one line::

    from dramatiq_pg_broker import PostgresBroker
    dramatiq.set_broker(PostgresBroker(url="postgresql://app@db/app"))

and run workers with the standard CLI (``dramatiq your_module``).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Any

import dramatiq
from dramatiq.common import current_millis
from dramatiq.encoder import JSONEncoder
from dramatiq.errors import BrokerConnectionError, QueueJoinTimeout
from dramatiq.middleware import Middleware
from dramatiq.middleware.retries import Retries as DramatiqRetries
from psycopg_pool import ConnectionPool, PoolTimeout

from .config import Settings
from .consumer import OutcomeWriter, PgMessageProxy, PostgresConsumer
from .current import JobContext
from .db import ProcessPool
from .errors import PgBrokerError
from .jobs import JobStore, NewJob
from .leases import LeaseKeeper
from .retries import Retries

logger = logging.getLogger(__name__)

#: Largest max_attempts a job row takes when an actor allows unlimited retries.
UNLIMITED_ATTEMPTS = 2**31 - 1


class JobFailed(PgBrokerError):
    """A job of the joined queue failed while ``join(fail_fast=True)`` waited."""


class PostgresBroker(dramatiq.Broker):
    """A Dramatiq broker backed by PostgreSQL job rows.

    Construction does no I/O: the connection pool opens on first use, once per process
    (the ``dramatiq`` CLI imports the broker module in each forked worker).

    Parameters:
      url(str): PostgreSQL URL. Default: ``DRAMATIQ_PG_URL``; with neither, the embedded
        local server (``pgserver``) is started, for development only.
      pool(ConnectionPool): a ready psycopg pool to use instead of opening one (it must
        open autocommit connections).
      schema(str): schema of the job tables (``DRAMATIQ_PG_SCHEMA``, default ``dramatiq``).
      listen(bool): wake idle consumers with LISTEN/NOTIFY (default True). Use False behind
        PgBouncer in transaction mode; consumers then poll every ``poll_interval``. Pass
        ``prepared_statements=False`` there as well.
      lease_seconds(float): how long a claim holds without renewal (default 30).
      middleware(list[Middleware]): as for any Dramatiq broker. With the default
        middleware, Dramatiq's Retries is replaced by this package's, which reschedules the
        same row. A middleware list you pass is kept as it is.
      settings(Settings): every other knob (see :class:`Settings`); keyword arguments win.
      **options: any other :class:`Settings` field (``poll_interval``, ``events``, ...).
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        pool: ConnectionPool | None = None,
        schema: str | None = None,
        listen: bool | None = None,
        lease_seconds: float | None = None,
        middleware: list[Middleware] | None = None,
        settings: Settings | None = None,
        **options: Any,
    ) -> None:
        given = {"url": url, "schema": schema, "listen": listen, "lease_seconds": lease_seconds}
        given.update(options)
        if settings is not None:
            import dataclasses

            settings = dataclasses.replace(
                settings, **{k: v for k, v in given.items() if v is not None}
            )
        else:
            settings = Settings.load(**given)
        self.settings = settings
        if settings.log_level:
            logging.getLogger("dramatiq_pg_broker").setLevel(settings.log_level.upper())

        if middleware is None:
            middleware = [m() for m in dramatiq.middleware.default_middleware]
            middleware = [Retries() if type(m) is DramatiqRetries else m for m in middleware]
        super().__init__(middleware=middleware)
        for m in self.middleware:
            if isinstance(m, Retries):
                m.configure(settings.backoff_base_ms, settings.backoff_max_ms)
        self.add_middleware(JobContext())

        self.queues: dict[str, None] = {}
        self.pool = ProcessPool(settings, pool=pool)
        self.store = JobStore(self.pool, settings.schema, events=settings.events)
        self.leases = LeaseKeeper(self)
        self.outcomes = OutcomeWriter(self)
        self._consumers_lock = threading.Lock()

    # -- declaring -----------------------------------------------------------------------

    def declare_queue(self, queue_name: str) -> None:
        """Declare a queue. No I/O: a queue is just a ``queue_name`` on job rows."""
        if queue_name not in self.queues:
            self.emit_before("declare_queue", queue_name)
            self.queues[queue_name] = None
            self.emit_after("declare_queue", queue_name)

    # -- sending -------------------------------------------------------------------------

    def encode_message(self, message: dramatiq.Message) -> tuple[dict | None, bytes | None]:
        """The stored form: a dict for jsonb under a JSON encoder, else the encoded bytes."""
        encoder = dramatiq.get_encoder()
        if isinstance(encoder, JSONEncoder):
            return message.asdict(), None
        return None, message.encode()

    def decode_message(self, data: Any, data_bytes: bytes | None) -> dramatiq.Message:
        """Rebuild a message from its stored form (see :meth:`encode_message`)."""
        if data_bytes is not None:
            return dramatiq.Message.decode(bytes(data_bytes))
        if isinstance(data, (str, bytes)):
            return dramatiq.Message.decode(data.encode() if isinstance(data, str) else data)
        fields = dict(data)
        fields["args"] = tuple(fields.get("args") or ())
        return dramatiq.Message(**fields)

    def _max_attempts(self, message: dramatiq.Message) -> int:
        actor = self.actors.get(message.actor_name)
        retries = next((m for m in self.middleware if isinstance(m, DramatiqRetries)), None)
        default = retries.max_retries if retries is not None else self.settings.max_attempts - 1
        actor_value = actor.options.get("max_retries", default) if actor else default
        max_retries = message.options.get("max_retries", actor_value)
        if max_retries is None:
            return UNLIMITED_ATTEMPTS
        return max(1, min(int(max_retries) + 1, UNLIMITED_ATTEMPTS))

    def enqueue(self, message: dramatiq.Message, *, delay: int | None = None) -> dramatiq.Message:
        """Store a message as a queued job row and wake the queue's consumers.

        ``delay`` (milliseconds) or an ``eta`` option (epoch milliseconds) sets
        ``available_at``; no delay queue exists and no worker holds delayed messages in
        memory. Priority is the actor's ``priority``, overridable per message with the
        ``priority`` option; lower runs first. The ``idempotency_key`` option makes a second
        send with the same key return the first job's message instead of a new job.

        Re-enqueueing a message that is running here (Dramatiq's own Retries middleware
        does that) reschedules its row instead of adding a duplicate.

        Raises:
          dramatiq.errors.ConnectionError: the database stayed unreachable after
            ``enqueue_retries`` attempts.
        """
        options = message.options
        delay_ms = int(delay or 0)
        if options.get("eta") is not None:
            delay_ms = max(delay_ms, int(options["eta"]) - current_millis())
        if "eta" in options:
            message = message.copy()
            message.options.pop("eta", None)

        self.emit_before("enqueue", message, delay)
        if isinstance(message, PgMessageProxy) and not message._settled:
            self.reschedule(message, delay_ms, None, replace_message=True)
            self.emit_after("enqueue", message, delay)
            return message

        actor = self.actors.get(message.actor_name)
        priority = options.get("priority", actor.priority if actor is not None else 0)
        key = options.get("idempotency_key")
        data, data_bytes = self.encode_message(message)
        job = NewJob(
            id=message.message_id,
            queue_name=message.queue_name,
            actor_name=message.actor_name,
            message=data,
            message_bytes=data_bytes,
            priority=int(priority),
            delay_ms=delay_ms,
            max_attempts=self._max_attempts(message),
            idempotency_key=str(key) if key is not None else None,
        )
        result = self._with_retries(lambda: self.store.enqueue(job))
        if not result.created and result.id != message.message_id:
            logger.debug("Idempotency key %r already used by job %s.", key, result.id)
            message = self.decode_message(result.message, result.message_bytes)
        self.emit_after("enqueue", message, delay)
        return message

    def _with_retries(self, fn):
        delay = 0.05
        for attempt in range(self.settings.enqueue_retries + 1):
            try:
                return fn()
            except BrokerConnectionError as e:
                # A pool timeout means the pool already spent its whole timeout trying to
                # get a connection; asking again would only multiply that wait.
                if attempt >= self.settings.enqueue_retries or isinstance(e.__cause__, PoolTimeout):
                    raise
                logger.warning("Enqueue failed on a connection error; retrying in %.2fs.", delay)
                time.sleep(delay)
                delay *= 4

    def reschedule(
        self,
        message: PgMessageProxy,
        delay_ms: int,
        error: str | None,
        *,
        replace_message: bool = False,
    ) -> bool:
        """Move a running message's row back to queued, runnable in ``delay_ms``. The
        following ack or nack of this message writes nothing. Returns False (and logs) if
        this worker no longer owns the attempt.

        Raises:
          dramatiq.errors.ConnectionError: the database stayed unreachable. The attempt is
            then left as it is (running, its lease no longer renewed): the reaper requeues
            it with backoff once the lease expires. It is never acked as a success.
        """
        data = data_bytes = None
        if replace_message:
            data, data_bytes = self.encode_message(message._message)
        # Settled whatever happens: a failed attempt whose retry could not be written must
        # not be acked as a success by the ack Dramatiq sends next.
        message._settled = True
        owned = self._with_retries(
            lambda: self.store.reschedule(
                message.attempt,
                message.queue_name,
                delay_ms,
                error,
                message=data,
                message_bytes=data_bytes,
            )
        )
        if not owned:
            logger.warning(
                "Could not reschedule job %s attempt %d: this worker no longer owns it.",
                message.attempt.id,
                message.attempt.attempt,
            )
        return owned

    # -- consuming -----------------------------------------------------------------------

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 30000) -> PostgresConsumer:
        """A consumer claiming rows of ``queue_name``; see :class:`PostgresConsumer`."""
        if queue_name not in self.queues:
            raise dramatiq.errors.QueueNotFound(queue_name)
        self.leases.start()
        return PostgresConsumer(self, queue_name, prefetch, timeout)

    # -- maintenance and tests -----------------------------------------------------------

    def flush(self, queue_name: str) -> None:
        """Drop the waiting and running jobs of a queue (finished history stays)."""
        self.store.flush(queue_name)

    def flush_all(self) -> None:
        """Drop the waiting and running jobs of every declared queue."""
        for queue_name in self.queues:
            self.flush(queue_name)

    def join(
        self,
        queue_name: str,
        *,
        interval: int = 50,
        timeout: int | None = None,
        fail_fast: bool = False,
    ) -> None:
        """Wait until no job of the queue is queued (delayed included) or running.

        Meant for tests, as with Dramatiq's own brokers.

        Parameters:
          queue_name(str): the queue.
          interval(int): milliseconds between two checks.
          timeout(int): give up after this many milliseconds.
          fail_fast(bool): raise :class:`JobFailed` as soon as a job of the queue fails.

        Raises:
          QueueJoinTimeout: the timeout elapsed.
          JobFailed: with ``fail_fast``, a job failed.
        """
        started = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        while True:
            if fail_fast and self.store.count_failed_since(queue_name, started):
                raise JobFailed(f"a job of queue {queue_name!r} failed")
            if self.store.count_unfinished(queue_name) == 0:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)
            time.sleep(interval / 1000)

    def close(self) -> None:
        """Write pending outcomes, stop the heartbeat and close this process's pool."""
        self.outcomes.flush(timeout=30)
        self.leases.stop()
        self.pool.close()
