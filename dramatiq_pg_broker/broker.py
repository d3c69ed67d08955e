"""PostgresBroker: a Dramatiq broker that stores every message as a job row.

Swap one line::

    from dramatiq_pg_broker import PostgresBroker
    dramatiq.set_broker(PostgresBroker(url="postgresql://app@db/app"))

and run workers with the standard CLI (``dramatiq your_module``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import dramatiq
from dramatiq.errors import QueueJoinTimeout
from dramatiq.middleware import AgeLimit, CurrentMessage, Middleware, MiddlewareError
from dramatiq.middleware.retries import Retries as DramatiqRetries
from psycopg_pool import ConnectionPool

from .attempt.consumer import ConsumerParts, PostgresConsumer
from .attempt.core import WorkerCore
from .attempt.current import AbortGuard, CurrentParts, JobContext, running_attempt
from .attempt.inflight import Ledger
from .attempt.lanes import LaneKeeper
from .attempt.leases import LeaseKeeper
from .attempt.outcomes import OutcomeWriter
from .attempt.retries import Retries, end_reaped_job
from .attempt.skips import SkipRecorder
from .config import Settings
from .control.limits import QueueLimits
from .control.workers import Presence
from .db.core import ProcessPool
from .db.handshake import SchemaGate
from .errors import PgBrokerError
from .history.periodic import Periodic, Schedule, Scheduler
from .jobs.store import JobStore
from .sending import messages
from .sending.blocks import Batch
from .sending.sender import Sender, TransactionBlock
from .sending.unique import UNIQUE_OPTIONS
from .workflows.runs import store_of
from .workflows.steps import WorkflowSteps

logger = logging.getLogger(__name__)


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
      middleware(list[Middleware]): as for any Dramatiq broker. The default is Dramatiq's
        default middleware, with this package's :class:`~dramatiq_pg_broker.Retries` in
        place of Dramatiq's (it reschedules the same row), and Dramatiq's
        ``CurrentMessage`` added last, so that ``CurrentMessage.get_current_message()``
        works in actors without setting anything up (Dramatiq's own default list lacks
        it, and Dramatiq users reach for it first). An application that adds one of these
        kinds itself (``CurrentMessage``, as Dramatiq 2's docs say; ``Retries`` or
        ``TimeLimit`` with its own settings) replaces the default one: see
        :meth:`add_middleware`. A middleware list you pass is kept as it is.
      schedules(list[Schedule]): periodic schedules the workers run (see
        :mod:`dramatiq_pg_broker.periodic`; ``@periodic`` above an actor adds to it).
      queue_limits(dict[str, int]): at most this many jobs of each named queue run at a
        time across every worker (``{"partner_api": 5}``; the ``queue_limits`` setting).
        Each worker process writes them before its first claim; a limit an operator set
        with the CLI or the admin API wins over it (see :mod:`dramatiq_pg_broker.limits`).
      settings(Settings): every other knob (see :class:`Settings`); keyword arguments win.
      store(JobStore): the job store every statement of the broker goes through (default:
        one on the pool). The worker side (consumers, the in-flight ledger, the outcome
        writer, the heartbeat) calls only its transition methods, so a test can pass an
        in-memory stand-in of them.
      **options: any other :class:`Settings` field (``poll_interval``, ``events``, ...).

    A skipped message (a middleware raised ``SkipMessage``: dramatiq-abort's cancel of a job
    that has not started, say) ends ``cancelled``, not ``succeeded``, with an event saying
    who skipped it; see :mod:`dramatiq_pg_broker.skips`.

    The broker adds six middleware of its own: :class:`~dramatiq_pg_broker.current.JobContext`
    (the in-flight ledger's view of the worker: it skips a message this process no longer
    owns) right after ``AgeLimit``, or first when there is no ``AgeLimit``, so that no
    other middleware sees such a message start; then, appended in this order, the schema
    gate, the periodic scheduler, the queue limits, the worker registry and, last, the abort
    guard (its after-hooks run first).
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
        schedules: list[Schedule] | None = None,
        settings: Settings | None = None,
        store: JobStore | None = None,
        **options: Any,
    ) -> None:
        given = {"url": url, "schema": schema, "listen": listen, "lease_seconds": lease_seconds}
        given.update(options)
        if settings is not None:
            settings = dataclasses.replace(
                settings, **{k: v for k, v in given.items() if v is not None}
            )
        else:
            settings = Settings.load(**given)
        self.settings = settings
        if settings.log_level:
            logging.getLogger("dramatiq_pg_broker").setLevel(settings.log_level.upper())

        #: The middleware the broker installed by default, each with the kind an
        #: application's instance of which replaces it (see :meth:`add_middleware`).
        self._defaults: dict[type[Middleware], Middleware] = {}
        defaults = middleware is None
        if defaults:
            middleware = [
                Retries() if m is DramatiqRetries else m()
                for m in dramatiq.middleware.default_middleware
            ]
            middleware.append(CurrentMessage())
        super().__init__(middleware=middleware)
        #: Unique jobs are the send path's (see :mod:`.sending.unique`), no middleware's.
        self.actor_options |= UNIQUE_OPTIONS
        if defaults:
            kinds = [*dramatiq.middleware.default_middleware, CurrentMessage]
            self._defaults = dict(zip(kinds, self.middleware, strict=True))
        self.queues: dict[str, None] = {}
        self.schedules: list[Schedule] = []

        # The parts, each given what it uses, no I/O. None of them reads the broker's
        # attributes: where one calls back into it (the scheduler's sends, the send path's
        # hooks, the reaper's failure hooks, which Dramatiq hands the broker), it holds that
        # one bound function.
        # Sends wait for a running migration (see ProcessPool), bounded by the setting.
        self.pool = ProcessPool(settings, pool=pool, migration_wait=settings.migration_wait_seconds)
        self.store = (
            store
            if store is not None
            else JobStore(self.pool, settings.schema, events=settings.events)
        )
        #: Every attempt this process holds: the one owner of their states.
        self.ledger = Ledger(self.store, settings)
        #: A worker claims nothing before the schema handshake passes (see SchemaGate).
        self.schema_gate = SchemaGate(self.pool)
        #: This process in the worker registry (see :mod:`.workers`).
        self.presence = Presence(
            pool=self.pool,
            settings=settings,
            ledger=self.ledger,
            schema_gate=self.schema_gate,
            actors=self.actors,
            queues=self.queues,
        )
        # What the lease keeper and every consumer claim, hold and renew attempts with.
        core = WorkerCore(
            store=self.store, settings=settings, ledger=self.ledger, schema_gate=self.schema_gate
        )
        self.leases = LeaseKeeper(
            core,
            self.presence,
            # Dramatiq's failure hooks (Retries, callbacks, Results) are handed the broker.
            reaped_failed=functools.partial(end_reaped_job, self),
        )
        #: Empties the jobs table's lanes in turn (a worker process's, with its consumers).
        self.lanes = LaneKeeper(self.store, self.schema_gate, max_moved=settings.lane_max_moved)
        self.outcomes = OutcomeWriter(self.store, self.ledger)
        self.ledger.connect(leases=self.leases, outcomes=self.outcomes)
        #: The send path: every enqueue goes through it.
        self.sender = Sender(
            store=self.store,
            settings=settings,
            pool=self.pool,
            ledger=self.ledger,
            running=functools.partial(running_attempt, self.ledger),
            actors=self.actors,
            middleware=self.middleware,
            emit_before=self.emit_before,
            emit_after=self.emit_after,
            emitter=self._emitter,
        )
        self.periodic = Periodic(
            schema_gate=self.schema_gate,
            settings=settings,
            new_scheduler=functools.partial(
                Scheduler,
                pool=self.pool,
                settings=settings,
                schedules=self.schedules,
                actors=self.actors,
                enqueue=self.enqueue,
            ),
        )
        #: Which queues are limited, and the worker's free threads (see :mod:`.limits`).
        self.queue_limits = QueueLimits(
            store=self.store, ledger=self.ledger, settings=settings, pool=self.pool
        )
        #: A workflow step's piped input and result (see :mod:`.workflows`).
        workflow_steps = WorkflowSteps(store_of(self))
        #: What every consumer of this broker uses (see :meth:`consume`).
        self._consumer_parts = ConsumerParts(
            core=core,
            queue_limits=self.queue_limits,
            leases=self.leases,
            pool=self.pool,
            decode_message=self.decode_message,
            prepare=workflow_steps.prepare,
        )
        #: Who skipped a message and why: run before every middleware's after_skip_message
        #: (see emit_after), so a skip ends cancelled before a result is stored as None.
        self.skips = SkipRecorder(self.ledger)

        # The broker's own middleware, in this order.
        context = JobContext(
            CurrentParts(
                ledger=self.ledger,
                store=self.store,
                settings=settings,
                sender=self.sender,
                actors=self.actors,
            )
        )
        if any(isinstance(m, AgeLimit) for m in self.middleware):
            # AgeLimit only skips messages too old to run: Dramatiq keeps it first.
            self.add_middleware(context, after=AgeLimit)
        else:
            first = type(self.middleware[0]) if self.middleware else None
            self.add_middleware(context, before=first)
        self.add_middleware(self.schema_gate)
        self.add_middleware(self.periodic)
        self.add_middleware(self.queue_limits)
        self.add_middleware(self.presence)
        self.add_middleware(workflow_steps)
        # Last, so that its after-hooks run first (see AbortGuard).
        self.add_middleware(AbortGuard(self.ledger))
        for schedule in schedules or ():
            self.add_schedule(schedule)

    def add_middleware(
        self,
        middleware: Middleware,
        *,
        before: type[Middleware] | None = None,
        after: type[Middleware] | None = None,
    ) -> None:
        """Dramatiq's ``add_middleware``, except that an instance of a kind the broker
        installed by default (Dramatiq's defaults, with this package's ``Retries``, and
        ``CurrentMessage``) replaces that default, silently, at its place unless
        ``before`` or ``after`` says otherwise: one ``CurrentMessage`` (the one Dramatiq 2's
        docs tell applications to add), and the application's settings for ``Retries``,
        ``TimeLimit``, ``AgeLimit`` and the others, not two instances of which the stricter
        wins, or which retry a failure or send a callback or a pipeline's next message
        twice. Dramatiq warns of a second instance of any other middleware, as always (two
        of a list passed to the constructor included: that list is kept as it is).
        ``Retries`` of this package take the broker's settings for what they were not
        given, wherever they come from."""
        replaced = next((kind for kind in self._defaults if isinstance(middleware, kind)), None)
        place = None
        if replaced is not None:
            default = self._defaults.pop(replaced)
            place = self.middleware.index(default)
            self.middleware.remove(default)
            logger.debug("%r replaces the broker's default %r.", middleware, default)
        super().add_middleware(middleware, before=before, after=after)
        if place is not None and before is None and after is None:
            self.middleware.remove(middleware)
            self.middleware.insert(place, middleware)
        if isinstance(middleware, Retries):
            middleware.configure(self.settings)

    def add_schedule(self, schedule: Schedule) -> None:
        """Run ``schedule`` in the workers (what ``@periodic`` above an actor does).

        Raises:
          ConfigurationError: another schedule has the same name.
        """
        from .history.periodic import add_schedule

        add_schedule(self, schedule)

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        """Dramatiq's ``emit_after``; a skipped message first goes through
        :class:`~dramatiq_pg_broker.skips.SkipRecorder`, whatever the middleware order: a
        skip that did not fail is written ``cancelled`` before the Results middleware
        (usually added last, so its after-hooks run first) stores None for it."""
        if signal == "skip_message":
            try:
                self.skips.after_skip_message(self, *args, **kwargs)
            except Exception:
                logger.critical(
                    "Unexpected failure in after_skip_message of %r.", self.skips, exc_info=True
                )
        super().emit_after(signal, *args, **kwargs)

    def _emitter(self, when: str, signal: str) -> Callable[..., None]:
        """``emit_before(signal, ...)`` (``when``: ``before``) or ``emit_after``, as
        Dramatiq's broker runs them, over only the middleware that define that hook, looked
        up once: a batch of 100,000 messages otherwise spends a good part of its time
        calling the base class's empty hooks (the send path's batches use it)."""
        name = f"{when}_{signal}"
        base = getattr(Middleware, name)
        order = self.middleware if when == "before" else list(reversed(self.middleware))
        hooks = [
            (m, getattr(m, name))
            for m in order
            if getattr(type(m), name, base) is not base or name in getattr(m, "__dict__", {})
        ]

        def emit(*args: Any) -> None:
            for middleware, hook in hooks:
                try:
                    hook(self, *args)
                except MiddlewareError:
                    if when == "before":
                        raise
                    self.logger.critical(
                        "Unexpected failure in %s of %r.", name, middleware, exc_info=True
                    )
                except Exception:
                    self.logger.critical(
                        "Unexpected failure in %s of %r.", name, middleware, exc_info=True
                    )

        return emit

    # -- declaring -----------------------------------------------------------------------

    def declare_queue(self, queue_name: str) -> None:
        """Declare a queue. No I/O: a queue is just a ``queue_name`` on job rows."""
        if queue_name not in self.queues:
            self.emit_before("declare_queue", queue_name)
            self.queues[queue_name] = None
            self.emit_after("declare_queue", queue_name)

    # -- sending -------------------------------------------------------------------------

    def enqueue(self, message: dramatiq.Message, *, delay: int | None = None) -> dramatiq.Message:
        """Store a message as a queued job row and wake the queue's consumers.

        ``delay`` (milliseconds) or an ``eta`` option (epoch milliseconds) sets
        ``available_at``; no delay queue exists and no worker holds delayed messages in
        memory. Priority is the actor's ``priority``, overridable per message with the
        ``priority`` option; lower runs first. The ``idempotency_key`` option makes a second
        send of the same actor with the same key return the first job's message instead of
        a new job. The ``unique`` option (``unique=True``, or ``unique_for`` in
        milliseconds; also an actor option) keeps at most one job per actor, queue and
        arguments while one waits or runs (and for ``unique_for`` from its send): a second
        send returns the existing job's message (see :mod:`.sending.unique`).

        The send returns once its row is committed, and flushed to the server's WAL unless
        the message's ``durable`` option (default: the ``durable_sends`` setting) is False.
        Sends through the pool from several threads at once share statements and commits.

        Enqueueing a message whose id is already a job (``message.copy()``, as snooze
        patterns and Dramatiq's own Retries do) reschedules that row if it is waiting or
        running, with the new message and delay; for the attempt this thread runs (a
        retry), the row is rescheduled when Dramatiq acks or nacks the message, after
        every middleware's ``after_process_message``.

        Raises:
          InvalidMessage: an option is out of range (``priority``, ``delay``, ``eta``,
            ``max_retries``, ``idempotency_key``, ``unique``, ``unique_for``; a unique job
            with an ``idempotency_key``, or with arguments that are not JSON values) or the
            encoder cannot encode a value.
          JobAlreadyFinished: the message's id is a job that already finished.
          dramatiq.errors.ConnectionError: the database stayed unreachable after
            ``enqueue_retries`` attempts.
        """
        return self.sender.send(message, delay)

    def enqueue_many(
        self, messages: Iterable[dramatiq.Message], *, delay: int | None = None
    ) -> list[dramatiq.Message]:
        """Send many messages in one transaction: from 200 messages on, COPY straight into
        the jobs table (and the ``created`` events into theirs), each message checked and
        encoded while the server writes the ones before it; smaller batches, and any batch
        in which a message conflicts with a stored job (an idempotency key or id already
        used, an id repeated), are written with one statement per 10,000 messages that
        resolves the conflicts. Each message is handled as :meth:`enqueue` handles one
        (idempotency keys, priorities, delays, re-enqueued ids); nothing is written if any
        message is refused.

        Inside :meth:`batch`, the messages join the batch; inside :meth:`transaction`, they
        are written in the application's transaction.

        Returns:
          list[Message]: the stored messages in order (for an idempotency key already used,
          the existing job's message).

        Raises:
          InvalidMessage: message ``i`` is refused (the error names ``i``).
          JobAlreadyFinished: message ``i``'s id is a job that already finished.
        """
        return self.sender.enqueue_many(messages, delay)

    def batch(self) -> contextlib.AbstractContextManager[Batch]:
        """Collect every send of this thread in the block, and write them together at its
        end (see :meth:`enqueue_many`): a loop of ``actor.send()`` or a
        ``group([...]).run()`` becomes one round trip.

        A send in the block returns its message at once, before it is written; a send whose
        idempotency key is already used still returns its own message (the existing job is
        what is stored). If the block raises, nothing is written. A batch block inside
        another joins it; inside :meth:`transaction`, the batch is written in that
        transaction.

        Raises:
          InvalidMessage: at the send that is refused (nothing of the block is written).
          JobAlreadyFinished: at the end of the block, naming the message's index.
        """
        return self.sender.batch()

    def transaction(self, conn: Any) -> TransactionBlock:
        """Send inside the application's own transaction: every send of this thread in the
        block is written on ``conn``, so the job commits with the application's writes
        (and its NOTIFY reaches workers at that commit) or disappears with a rollback.

        ``with broker.transaction(conn)`` for a synchronous connection, ``async with
        broker.transaction(conn)`` for a psycopg ``AsyncConnection`` or a SQLAlchemy
        ``AsyncSession`` or ``AsyncConnection``: there the sends are collected and written
        on ``conn`` when the block ends, or at :meth:`write_pending_sends` (see
        :mod:`dramatiq_pg_broker.async_sending`).

        ``conn`` is a psycopg 3 ``Connection`` (autocommit or not): the block is then
        ``conn.transaction()``, which begins a transaction and commits it at the end of the
        block (or rolls it back if the block raises), or is a savepoint when a transaction
        is already open on ``conn``. Or a SQLAlchemy 2 ``Session`` or ``Connection`` on the
        ``postgresql+psycopg`` driver: the sends join its transaction (begun if needed),
        which the application commits or rolls back as usual, after the block or inside
        it (an async block writes what it collected just before that COMMIT, see
        :mod:`dramatiq_pg_broker.app_transactions`). Once that transaction has ended
        inside the block, a send in it raises ``TransactionError`` instead of writing.

        Blocks nest (the innermost one's connection is used). The block belongs to the
        thread (or asyncio task) that entered it: sends from other threads go through the
        broker's pool as usual.

        Yields:
          psycopg.Connection: the connection the sends are written on (a psycopg
          ``AsyncConnection`` in an ``async with`` block).

        Raises:
          TransactionError: ``conn`` is not one of the above (or an asyncio connection in a
            ``with`` block, a synchronous one in an ``async with`` block), or reaches
            another database (another name or another server) than the broker's; or, from
            a send or the block's end, the SQLAlchemy transaction the block joined ended
            inside it (nothing is then written).
        """
        return self.sender.transaction(conn)

    async def write_pending_sends(self) -> list[dramatiq.Message]:
        """Write the sends collected so far by the innermost ``async with
        broker.transaction(conn)`` block of this task, on its connection, now (they are
        otherwise written when the block ends). A send whose idempotency key was already
        used learns its job here: the returned list holds, in order, each send's stored
        message (the existing job's for such a key).

        Raises:
          TransactionError: no ``async with broker.transaction()`` block is open.
          JobAlreadyFinished: a message's id is a job that already finished.
        """
        from .sending.async_sending import innermost, write_pending

        return await write_pending(self.sender, innermost(self.sender))

    async def enqueue_async(
        self, message: dramatiq.Message, *, delay: int | None = None
    ) -> dramatiq.Message:
        """:meth:`enqueue` for asyncio code, without blocking the event loop: the send runs
        in a thread of the loop's default executor (through the pool, as ``enqueue``
        sends), or, inside an ``async with broker.transaction()`` block, is collected by it
        (no I/O). :func:`dramatiq_pg_broker.send_async` is the same for an actor and its
        arguments.

        A cancelled call may still have sent the message: the thread finishes its send.

        Raises:
          As :meth:`enqueue`.
        """
        from .sending.async_sending import enqueue_async

        return await enqueue_async(self.sender, message, delay)

    def decode_message(self, data: Any, data_bytes: bytes | None) -> dramatiq.Message:
        """Rebuild a message from its row (see :func:`dramatiq_pg_broker.messages.decode`)."""
        return messages.decode(data, data_bytes)

    # -- consuming -----------------------------------------------------------------------

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 30000) -> PostgresConsumer:
        """A consumer claiming rows of ``queue_name``; see :class:`PostgresConsumer`."""
        if queue_name not in self.queues:
            raise dramatiq.errors.QueueNotFound(queue_name)
        self.leases.start()
        if self.settings.lane_max_moved > 0:
            self.lanes.start()
        return PostgresConsumer(self._consumer_parts, queue_name, prefetch, timeout)

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
        # The server's clock, which also wrote finished_at: this host's may differ. A
        # failure up to a second before the call counts (a job sent just before join).
        started = self.store.server_now() - dt.timedelta(seconds=1) if fail_fast else None
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        while True:
            # Unfinished first: a job that fails between the two counts is then still seen
            # by the failure count, instead of the queue just looking finished.
            unfinished = self.store.count_unfinished(queue_name)
            if fail_fast and self.store.count_failed_since(queue_name, started):
                raise JobFailed(f"a job of queue {queue_name!r} failed")
            if unfinished == 0:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)
            time.sleep(interval / 1000)

    def close(self) -> None:
        """Stop the scheduler, write pending outcomes, stop the outcome writer and the
        heartbeat, send the wake-ups this process's sends owe (see
        :mod:`~dramatiq_pg_broker.sending.notifier`), and close this process's pool."""
        if self.periodic.scheduler is not None:
            self.periodic.scheduler.stop()
        self.outcomes.flush(timeout=30)
        self.outcomes.stop()
        self.leases.stop()
        self.lanes.stop()
        self.sender.close()
        self.pool.close()
