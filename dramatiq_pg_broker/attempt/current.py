"""The current job, for actors: renew the lease, report progress.

::

    from dramatiq_pg_broker import current_job

    @dramatiq.actor(heartbeat=False)      # no automatic lease renewal for this actor
    def export(report_id):
        job = current_job()
        for i, chunk in enumerate(chunks(report_id)):
            write(chunk)
            job.progress({"done": i + 1})   # a `progress` event; renews the lease too
            job.renew()                     # or just renew (a `lease_renewed` event)

Both return False when the worker no longer owns the attempt (its lease expired and another
worker took the job): the actor may then stop, since its outcome will be discarded.

An operator's abort raises :class:`~.errors.JobAborted` in the actor's thread. An actor
that must not be interrupted at an arbitrary instruction (it holds a resource it has to
release, or spends minutes inside C code that no exception can interrupt) is declared
``interrupt_on_abort=False`` and checks for itself, where it is safe to stop::

    @dramatiq.actor(interrupt_on_abort=False)
    def rebuild_index(shard):
        job = current_job()
        for batch in batches(shard):
            job.raise_if_aborted()          # JobAborted if an operator asked to stop
            index(batch)                    # a long call into C code

``job.abort_requested`` says the same without raising. Whatever such an actor raises once
the abort was requested ends the job cancelled; if it returns normally, it succeeded.

An actor whose work is database writes can commit the job's success with them, in one
transaction (:meth:`CurrentJob.complete_in`, :mod:`.completion`)::

    @dramatiq.actor
    def charge(order_id):
        with psycopg.connect(APP_URL) as conn, current_job().complete_in(conn):
            conn.execute("INSERT INTO charges (order_id) VALUES (%s)", (order_id,))
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import threading
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import dramatiq
from dramatiq.middleware import Middleware, SkipMessage

from ..config import Settings
from ..errors import JobAborted
from ..sending.sender import RunningAttempt, Sender
from .claiming import PgMessageProxy, describe_exception
from .states import State

if TYPE_CHECKING:
    from ..jobs.store import JobStore
    from .completion import CompletionBlock
    from .inflight import Ledger

logger = logging.getLogger("dramatiq_pg_broker.current")


@dataclasses.dataclass(frozen=True)
class CurrentParts:
    """What the current job and the middleware that starts it use: the broker builds it
    once with its parts."""

    #: The in-flight ledger: the attempt's state, its lease, its abort.
    ledger: Ledger
    #: The job store: ``progress`` events, a ``complete_in`` block's success.
    store: JobStore
    #: The broker's settings (the lease length).
    settings: Settings
    #: The send path: a ``complete_in`` block's connection must reach the broker's database.
    sender: Sender
    #: The broker's actors (their ``heartbeat`` and ``interrupt_on_abort`` options).
    actors: Mapping[str, dramatiq.Actor]


#: A context variable, not a thread-local: async actors run on Dramatiq's event loop thread,
#: and the coroutine inherits the worker thread's context (as Dramatiq's CurrentMessage does).
_current: contextvars.ContextVar[CurrentJob | None] = contextvars.ContextVar(
    "dramatiq_pg_broker_current_job", default=None
)


#: Whether this context is inside an actor's function (see
#: :func:`_succeeded_whatever_it_raises`).
_in_actor: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "dramatiq_pg_broker_in_actor", default=False
)


class CurrentJob:
    """The job row behind the message an actor is running."""

    def __init__(self, parts: CurrentParts, message: PgMessageProxy) -> None:
        self.parts = parts
        self.message = message
        #: Children spawned by this attempt so far (each one's id follows from its rank).
        self._spawned = 0

    @property
    def id(self) -> str:
        return self.message.attempt.id

    @property
    def attempt(self) -> int:
        """This attempt's number, from 1."""
        return self.message.attempt.attempt

    @property
    def broker(self) -> dramatiq.Broker:
        """The broker running this job (deprecated: use ``dramatiq.get_broker()`` or the
        actor's ``broker``). Kept for actors written against 0.1.0; it is read from the
        running actor, so the current job holds no reference to the broker itself."""
        warnings.warn(
            "current_job().broker is deprecated: use dramatiq.get_broker() or the actor's broker",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.parts.actors[self.message.actor_name].broker

    def renew(self, lease_seconds: float | None = None) -> bool:
        """Extend this attempt's lease (default: the broker's lease length) and record a
        ``lease_renewed`` event. Returns False if the attempt is no longer owned.

        Inside a ``complete_in()`` block whose transaction holds the job's row (a
        REPEATABLE READ or SERIALIZABLE block from its start; any block once its success
        is written in a transaction still open), it writes nothing and returns True: that
        transaction's lock holds the job.

        Raises:
          JobBusy: another transaction (the application's own lock on the job's row) held
            the row for :data:`~dramatiq_pg_broker.attempt.states.ROW_WAIT_SECONDS`;
            nothing was written.
        """
        seconds = lease_seconds or self.parts.settings.lease_seconds
        return self.parts.ledger.renew(self.message.attempt, seconds, record=True)

    def progress(self, data: Any, *, lease_seconds: float | None = None) -> bool:
        """Record a ``progress`` event with ``data`` (anything JSON can hold) and renew the
        lease. Returns False if the attempt is no longer owned.

        Inside a ``complete_in()`` block whose transaction holds the job's row (see
        :meth:`renew`), only the event is recorded (at once, whatever that transaction
        does later); the lease is left to the row's lock.

        Raises:
          JobBusy: as for :meth:`renew`.
        """
        seconds = lease_seconds or self.parts.settings.lease_seconds
        return self.parts.ledger.progress(self.message.attempt, data, seconds)

    def complete_in(self, conn: Any) -> CompletionBlock:
        """A block whose transaction also records this job's success: when it commits,
        the job has succeeded, and the worker writes no other outcome for this attempt
        (exactly-once effects for database work; see the exactly-once guide). Put it last
        in the actor: nothing done after it can make the job fail.

        ``with`` it for a psycopg ``Connection``, a SQLAlchemy ``Session`` or
        ``Connection``, or a Django connection (``django.db.connection``); ``async with``
        it for a psycopg ``AsyncConnection`` or a SQLAlchemy ``AsyncSession`` or
        ``AsyncConnection``. With no transaction open on it, the block begins one and
        commits it at its end; inside one, the block is a savepoint and the job succeeds
        when the application commits. The connection must reach the broker's database.

        A SQLAlchemy ``commit()`` inside the block commits the job's success with it
        (psycopg and Django refuse such a commit themselves). Every isolation level
        works; at REPEATABLE READ and SERIALIZABLE, a transaction that read before the
        block is refused at once (``TransactionError``). An exception the actor raises
        after the block committed is logged, and Dramatiq sees a success (result None). A
        block that raised (a serialization failure, a failed commit) left nothing: the
        actor may run it again in the same attempt.

        Parameters:
          conn: the application's connection, session or Django connection.

        Raises:
          LostOwnership: when the block ends, the attempt is no longer this worker's (its
            lease expired and another worker took the job, or an operator aborted it):
            nothing is committed, the block's transaction or savepoint rolls back.
          TransactionError: ``conn`` is of a kind the block cannot use, reaches another
            database, its transaction ended inside the block (a rollback), or it is a
            REPEATABLE READ or SERIALIZABLE transaction that read before the block.
        """
        from .completion import CompletionBlock

        return CompletionBlock(self, conn)

    def spawn(self, *messages: dramatiq.Message) -> list[dramatiq.Message]:
        """Add children to this workflow step and send their jobs: the next step waits
        for them as for this one (fan-out decided at run time). Children are ordinary
        messages (``actor.message(...)``); their results are not piped on. An attempt
        that runs again spawns nothing twice: the nth child of a step has the same id in
        every attempt.

        Parameters:
          messages: the children's messages.

        Returns:
          list[Message]: the children as sent (their ids are their jobs').

        Raises:
          NotAWorkflowStep: this job is not a workflow's step.
          WorkflowInvalidTransition: the step's part of the workflow is over.
        """
        from ..workflows.runs import store_of
        from ..workflows.steps import spawn

        broker = self.parts.actors[self.message.actor_name].broker
        return spawn(self, store_of(broker), self.parts.sender, messages)

    @property
    def abort_requested(self) -> bool:
        """Whether an operator asked for this job's abort. No database query: the worker
        learns it from a notification (or its lease heartbeat) and remembers it."""
        return self.parts.ledger.abort_requested(self.message.attempt)

    def raise_if_aborted(self) -> None:
        """Raise :class:`~.errors.JobAborted` if an operator asked for this job's abort:
        the cooperative check of an actor declared ``interrupt_on_abort=False``.

        Raises:
          JobAborted: the abort was requested.
        """
        if self.abort_requested:
            raise JobAborted(f"job {self.id} was aborted")


def current_job() -> CurrentJob | None:
    """The job of the message this thread is processing, or None outside an actor (or for
    a message that did not come from a PostgresBroker)."""
    return _current.get()


def _succeeded_whatever_it_raises(fn: Any, ledger: Ledger) -> Any:
    """``fn`` (an actor's function), such that an exception it raises after its job's
    success committed in a ``complete_in()`` block is logged with the job's id and not
    raised: the job has succeeded (its row says so), and every middleware is to see a
    success, as its row does: a pipeline's next message is sent, ``on_success`` runs
    and not ``on_failure``, and a results backend stores None (the actor returned no
    value). Outside a job of this broker, or before such a commit, ``fn`` is unchanged."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _in_actor.get():
            # An actor called as a function from inside another actor: only what the
            # worker called is the job's.
            return fn(*args, **kwargs)
        token = _in_actor.set(True)
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            job = _current.get()
            if job is None or not ledger.succeeded_in_transaction(job.message.attempt):
                raise
            logger.error(
                "Job %s attempt %d raised %s after the transaction of its complete_in() "
                "block committed: the job succeeded (its result is None), the exception is "
                "not a failure.",
                job.id,
                job.attempt,
                type(e).__name__,
                exc_info=True,
            )
            return None
        finally:
            _in_actor.reset(token)

    call.guards_completion = True  # type: ignore[attr-defined]
    return call


def running_attempt(ledger: Ledger, message: dramatiq.Message) -> RunningAttempt | None:
    """The attempt of ``message`` that this thread's actor runs and has not settled, if
    any: ``message`` is the proxy Dramatiq's worker handed to the middleware (the Retries
    middleware sends it again), or a copy of the current job's message sent from inside
    its actor. The send path takes a send of it for that attempt's retry."""
    if isinstance(message, PgMessageProxy):
        proxy = message
    else:
        job = _current.get()
        if job is None or job.id != message.message_id:
            return None
        proxy = job.message
    if ledger.state_of(proxy.attempt) is not State.STARTED:
        return None
    exception = proxy._exception
    return RunningAttempt(proxy, describe_exception(exception) if exception is not None else None)


class JobContext(Middleware):
    """Connects Dramatiq's worker to the in-flight ledger, and makes :func:`current_job`
    work. It declares the ``heartbeat`` actor option (``heartbeat=False`` turns automatic
    lease renewal off for an actor) and ``interrupt_on_abort`` (``False``: an operator's
    abort does not raise in the actor's thread; the actor checks
    ``current_job().abort_requested`` itself).

    - before a message runs: the ledger marks it started (the database learns it a moment
      later, or at once for a ``heartbeat=False`` actor), or the message is skipped when
      this process no longer owns it (released at shutdown, or its lease was lost while
      it waited);
    - when shutdown begins: prefetched messages that have not started go back at once;
    - while the actor runs, the ledger knows its thread, so that an abort can be raised
      there; it forgets it as soon as Dramatiq's after-hooks reach this middleware;
    - when an actor raises: the ledger remembers it, so no ack can record a success
      (without a Retries middleware, Dramatiq acks a message whose actor raised: the job
      is recorded failed, not succeeded);
    - when an actor is declared, its function is wrapped so that an exception raised
      after its ``complete_in()`` block committed reaches no middleware: the job has
      succeeded, and Dramatiq is told so (see :func:`_succeeded_whatever_it_raises`).

    The broker puts it right after ``AgeLimit`` (first without one), so a skipped message
    reaches no other middleware's ``before_process_message``.

    Parameters:
      parts(CurrentParts): what it and each :class:`CurrentJob` use, built by the broker.
    """

    #: Its documented path: a skip it raises names it so in the job's events, as before
    #: the module moved into attempt/.
    __module__ = "dramatiq_pg_broker.current"

    def __init__(self, parts: CurrentParts) -> None:
        self.parts = parts
        self.ledger = parts.ledger

    @property
    def actor_options(self) -> set[str]:
        return {"heartbeat", "interrupt_on_abort"}

    def after_declare_actor(self, broker, actor) -> None:
        if not getattr(actor.fn, "guards_completion", False):
            actor.fn = _succeeded_whatever_it_raises(actor.fn, self.ledger)

    def before_worker_boot(self, broker, worker) -> None:
        self.ledger.open()

    def before_worker_shutdown(self, broker, worker) -> None:
        self.ledger.begin_shutdown()

    def before_process_message(self, broker, message) -> None:
        if not isinstance(message, PgMessageProxy):
            return
        actor = self.parts.actors.get(message.actor_name)
        own_lease = actor is not None and actor.options.get("heartbeat") is False
        if not self.ledger.start(message.attempt, record_first=own_lease):
            # Another worker runs (or ran) this job: no hook here may record a result for
            # it (Dramatiq's Results middleware stores None for a skipped message).
            message.options["store_results"] = False
            raise SkipMessage(f"job {message.attempt.id} is no longer owned by this worker")
        interrupt = actor is None or actor.options.get("interrupt_on_abort") is not False
        if not self.ledger.running_in(message.attempt, threading.get_ident(), interrupt=interrupt):
            message.options["store_results"] = False
            raise SkipMessage(f"job {message.attempt.id} was aborted before its actor started")
        _current.set(CurrentJob(self.parts, message))
        if own_lease:
            # The start gave it a full lease; from here on only the actor renews it.
            self.ledger.stop_renewing(message.attempt)

    def after_process_message(self, broker, message, *, result=None, exception=None) -> None:
        _current.set(None)
        if isinstance(message, PgMessageProxy):
            self.ledger.left(message.attempt)
            self.ledger.resolve_completion(message.attempt)
        if exception is not None and isinstance(message, PgMessageProxy):
            self.ledger.failed_with(message.attempt, describe_exception(exception))

    def after_skip_message(self, broker, message) -> None:
        _current.set(None)
        if isinstance(message, PgMessageProxy):
            self.ledger.left(message.attempt)


class AbortGuard(Middleware):
    """Tells the ledger that an actor returned, from the first after-hook Dramatiq runs:
    the broker adds it last to its middleware list (after-hooks run in reverse order), so
    that once the actor is done, no abort is raised in its thread while the other
    middleware post-process the message (a pipeline's next message, a callback). Hooks of
    middleware added later still run before it; :class:`JobContext` does the same at the
    end, whatever the order.

    Parameters:
      ledger(Ledger): the broker's in-flight ledger.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def after_process_message(self, broker, message, *, result=None, exception=None) -> None:
        if isinstance(message, PgMessageProxy):
            self.ledger.left(message.attempt)
            # Before the Retries middleware asks for a retry: an actor that raised after
            # its complete_in() block committed succeeded, and is not retried.
            self.ledger.resolve_completion(message.attempt)

    def after_skip_message(self, broker, message) -> None:
        if isinstance(message, PgMessageProxy):
            self.ledger.left(message.attempt)
