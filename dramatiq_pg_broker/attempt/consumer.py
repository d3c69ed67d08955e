"""PostgresConsumer: claims batches of job rows and hands them to Dramatiq.

Claiming: a consumer holds at most its window of messages (Dramatiq's prefetch, grown
while jobs are short, see :class:`ClaimWindow`), fills it in batches of at most half the
window, and claims again as soon as its outstanding messages fall to half the window. So a
busy worker pays one round trip per batch, not per message, and the next batch is claimed
while the workers still run the last one: right after a batch is handed over, not once it
is done. Messages sent one at a time while the worker threads are busy are claimed as they
come, up to the whole window, as Dramatiq's other brokers prefetch: Dramatiq then hands
what the worker holds to its threads in priority order.
A slot stays taken until the attempt's outcome is written, within the write-behind
allowance (see :mod:`.inflight`).

An idle consumer claims once (a claim that finds nothing reports, in the same statement,
when the earliest delayed job becomes runnable), then waits for a payload-free NOTIFY from
an enqueue, a retry or a release on its queue's channel, and claims again only when one
arrives, when its poll interval has passed, or when that delayed job becomes runnable: one
statement per queue per poll interval. It hears its channel through the process's one
LISTEN connection (:meth:`.listener.Listener.subscribe`), shared by every consumer and
blocking wait of the process: one, whatever its queues and threads.

Outcomes: ``ack``/``nack``/``requeue`` only tell the in-flight ledger, which owns every
attempt's state; the :class:`~.outcomes.OutcomeWriter` writes them.

Operator control arrives on the same channel, as payloads: ``abort:<job id>`` (the ledger
stops that job's attempt if this process holds it) and ``pause``. A busy consumer reads
them at least every :data:`NOTICE_INTERVAL`. A paused queue claims nothing (the claim
statement refuses it); when its consumer learns of the pause (that payload, or a claim
that reports it), it gives back the messages it claimed and has not started, uncharged, so
that none of them starts after the pause. Messages already running finish.

Queue limits (:mod:`.limits`): a consumer whose queue is limited claims with
:meth:`~.jobs.JobStore.claim_limited`, and only as many messages as its process's worker
threads can start at once (no prefetch: a message waiting for a thread would hold a place
of the limit that a worker on another host could use). A limited queue at its limit, or a
process with no free thread, looks again every :data:`LIMIT_RETRY_SECONDS`. When a
consumer learns that its queue became limited (the ``limit`` payload, or its periodic read
of the limits), it gives back, uncharged, the messages it claimed and has not started.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import dramatiq
from dramatiq.broker import Consumer
from dramatiq.errors import BrokerConnectionError

from ..control.limits import LIMIT_PAYLOAD, QueueLimits
from ..db.listener import Subscription, listener_for
from ..jobs.rows import ABORT_PAYLOAD_PREFIX, PAUSE_PAYLOAD, Attempt, ClaimedJob
from .claiming import ClaimWindow, PgMessageProxy, describe_error, describe_exception, new_owner_id
from .states import RETRY_CAP_SECONDS

if TYPE_CHECKING:
    from ..db.core import ProcessPool
    from .core import WorkerCore
    from .leases import LeaseKeeper

logger = logging.getLogger("dramatiq_pg_broker.consumer")


@dataclasses.dataclass(frozen=True)
class ConsumerParts:
    """What every consumer of a broker uses: the broker builds it once with its parts and
    hands it to each consumer it makes (:meth:`~dramatiq_pg_broker.PostgresBroker.consume`)."""

    #: The job store (claims, the look of a limited queue, dead letters), the settings,
    #: the in-flight ledger (every attempt claimed goes to it, and every outcome) and the
    #: schema gate (nothing is claimed before it opens): the lease keeper's too.
    core: WorkerCore
    #: Which queues are limited, and this process's free worker threads.
    queue_limits: QueueLimits
    #: The lease keeper, told when an empty claim reports the earliest lease.
    leases: LeaseKeeper
    #: The process pool, opened on first use: its ``url`` is where LISTEN connects.
    pool: ProcessPool
    #: ``decode_message(data, data_bytes)``: a claimed row's message (the broker's
    #: :meth:`~dramatiq_pg_broker.PostgresBroker.decode_message`).
    decode_message: Callable[[Any, bytes | None], dramatiq.Message]
    #: ``prepare(proxies)``: called once per claim with the messages it brought, before
    #: any is handed over, to read at once what several of them will need (a workflow's
    #: steps, their piped inputs: one statement per claim, not one per message). It
    #: must write nothing, return quickly for messages it has no business with, and may
    #: fail: a message it did not prepare is prepared where it runs.
    prepare: Callable[[list[PgMessageProxy]], None] | None = None


#: How often a consumer whose last claim found work reads its notifications.
BUSY_DRAIN_INTERVAL = 0.1

#: How often a consumer waiting for a free slot (its workers busy) reads its notifications:
#: an operator's abort of a running job reaches the worker this way.
NOTICE_INTERVAL = 0.25

#: How soon a consumer of a limited queue looks again when the queue was at its limit, or
#: its process had no free worker thread: a place under the limit frees up when a job of
#: the queue ends on any host, which is not announced.
LIMIT_RETRY_SECONDS = 0.025


class PostgresConsumer(Consumer):
    """Consumes one queue for one Dramatiq consumer thread. See the module docstring.

    Parameters:
      parts(ConsumerParts): what it uses of its broker, built by the broker.
      queue_name(str), prefetch(int), timeout(int): as Dramatiq's ``Broker.consume`` gives them.
    """

    def __init__(self, parts: ConsumerParts, queue_name: str, prefetch: int, timeout: int):
        self.store = parts.core.store
        self.settings = parts.core.settings
        self.ledger = parts.core.ledger
        self.schema_gate = parts.core.schema_gate
        self.queue_limits = parts.queue_limits
        self.leases = parts.leases
        self.pool = parts.pool
        self.decode_message = parts.decode_message
        self.prepare = parts.prepare
        self.queue_name = queue_name
        self.prefetch = max(1, prefetch)
        self.slots = self.ledger.slots(self.prefetch)
        #: How many messages this consumer may hold (see :class:`ClaimWindow`).
        self.claim_window = ClaimWindow(self.prefetch, self.settings.prefetch_growth, self.slots)
        self.timeout = max(0.0, timeout / 1000)
        self.owner = new_owner_id()
        self._buffer: deque[PgMessageProxy] = deque()
        #: The queue's channel, heard through the process's LISTEN connection (None before
        #: the first claim, and in poll-only mode).
        self._subscription: Subscription | None = None
        self._next_due: float | None = None
        #: When the last claim came back empty (None: claim without waiting).
        self._last_empty: float | None = None
        self._notified = False
        self._last_drain = 0.0
        #: Whether the last claim found the queue paused (logged once per pause).
        self._paused = False
        #: Whether the last claim brought fewer jobs than it asked for (the queue ran dry).
        self._short = False
        #: Whether the window is being filled (see :meth:`_may_claim`).
        self._filling = True
        #: Whether the last call handed over the last message of a short claim.
        self._handed_last = False
        #: Whether the queue was limited at the last claim (see :mod:`.limits`).
        self._limited = False
        #: What the limited queue's last claim found: "work", "empty" or "at limit".
        self._last_look = "work"

    @property
    def window(self) -> int:
        """How many messages this consumer may hold now (see :class:`ClaimWindow`)."""
        return self.claim_window.size

    # -- claiming ------------------------------------------------------------------------

    def __next__(self) -> PgMessageProxy | None:
        if self._buffer:
            return self._hand_over()
        if self._handed_last:
            # The message just handed over went to Dramatiq's work queue, whose worker
            # thread now waits for the GIL, which this thread would otherwise keep until
            # its next statement blocks (the claim that follows a short one: 0.1 to 0.2
            # ms of Python). Letting the worker thread run first starts the message that
            # much sooner; the claim that follows finds the queue empty anyway. Only after
            # a short claim: during a drain the claims come back full and the consumer
            # claims the next batch at once.
            self._handed_last = False
            time.sleep(0)
        deadline = time.monotonic() + self.timeout
        if not self.schema_gate.is_open:
            # The worker's schema handshake has not passed (handshake.SchemaGate).
            self.schema_gate.wait(self.timeout)
            return None
        while True:
            if self.ledger.closing:
                # Shutdown began: claim nothing more; Dramatiq stops this consumer soon.
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                return None
            try:
                if self._step(deadline):
                    return self._hand_over()
            except BrokerConnectionError as e:
                # Stay alive and try again shortly: Dramatiq would restart the consumer only
                # after several seconds, and claiming must resume within about a second of
                # the server's return.
                self._lost_connection(e)
                time.sleep(max(0.0, min(RETRY_CAP_SECONDS, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                return None

    def _hand_over(self) -> PgMessageProxy:
        """The next buffered message, noting when it is the last of a short claim."""
        message = self._buffer.popleft()
        self._handed_last = self._short and not self._buffer
        return message

    def _step(self, deadline: float) -> bool:
        """Claim if due, else wait for work or a free slot. True when a batch came in."""
        now = time.monotonic()
        if (
            self._last_empty is not None
            or self._subscription is None
            or now - self._last_drain >= BUSY_DRAIN_INTERVAL
        ):
            # While the last claim found work, the next claim is due whatever was
            # announced: reading the notifications can wait (each read is a blocking
            # call, which costs a busy process a GIL hand-over).
            self._drain_notifications()
            self._last_drain = now
        if self._may_claim() and self._claim_due():
            if self._claim():
                return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        # (The window may have shrunk in _claim: look again now.)
        if not self._may_claim():
            # Enough work in hand: wait for an outcome to free a slot, reading the
            # notifications (an abort) now and then meanwhile.
            self.slots.wait(min(remaining, NOTICE_INTERVAL))
        else:
            self._wait_for_work(remaining)
        return False

    def _may_claim(self) -> bool:
        """Whether this consumer has room to claim: it fills its window, in claims of at
        most half of it, then claims again once its outstanding messages fall to half the
        window. So a busy worker pays one round trip per batch, not per message, and the
        next batch is on its way while the workers run the last one. Filled to the whole
        window, as Dramatiq's other brokers fill their prefetch, whether the messages come
        in a batch or one at a time (sent while the worker threads are busy, each claimed
        as its send announces it): those a worker holds are handed to its threads in
        priority order by Dramatiq, and none waits in the table behind lower-priority ones
        the worker already holds."""
        held, window = self.slots.held, self.window
        if held <= window // 2:
            self._filling = True
        elif held >= window:
            self._filling = False
        return self._filling and held < window

    def _lost_connection(self, error: Exception) -> None:
        # The process's outage lines (see outage.py) tell the story once for every
        # consumer, not here at every try.
        logger.debug("Queue %r cannot reach the database: %s", self.queue_name, error)
        # Notifications sent while the connection was down are lost: claim once it is back.
        self._notified = True

    def _claim_due(self) -> bool:
        """Whether to claim now: something announced work, the last claim was not empty,
        a delayed job became runnable, or the poll interval passed."""
        if self._notified or self._last_empty is None:
            return True
        now = time.monotonic()
        if self._next_due is not None and now >= self._next_due:
            return True
        return now - self._last_empty >= self.settings.poll_interval

    def _claim(self) -> bool:
        lease = self.settings.lease_seconds
        sent = time.monotonic()
        window = self.claim_window.adapt(sent)
        # At most half the window at once: the claim after this one is due as soon as
        # this batch is handed over, and overlaps its running.
        limit = min(window - self.slots.held, window - window // 2)
        if limit <= 0:
            # The window just shrank below what is held: wait for slots instead.
            return False
        limits = self.queue_limits
        # Read the limits if a second old while the queue has work, and at a claim that a
        # notification prompted: the look the listener gives when its connection is back
        # stands for every announcement lost meanwhile, a limit's included.
        busy = self._last_empty is None or self._notified
        if limits.limit_of(self.queue_name, busy=busy) is not None:
            self._became_limited()
            # Only what this process's threads can start now: no prefetch.
            free = limits.free_threads()
            if free is not None and free <= 0:
                self._no_free_thread()
                return False
            if free is not None:
                limit = min(limit, free)
            self._notified = False
            claim = self.store.claim_limited(self.queue_name, limit, self.owner, lease)
            limits.fed(self.queue_name)
            self._last_look = "at limit" if claim.at_limit else "work" if claim.jobs else "empty"
            if claim.queue_limit is None:
                # The limit was cleared and this process has not heard yet.
                limits.invalidate()
            if claim.at_limit:
                self._wait_under_limit()
                return False
        else:
            self._limited = False
            reserved = limits.reserved()
            if reserved:
                # A limited queue of this process waits for a thread: leave it the next
                # ones (see QueueLimits.hungry).
                free = limits.free_threads()
                if free is not None and free - reserved < limit:
                    limit = free - reserved
                    if limit <= 0:
                        self._wait_under_limit()
                        return False
            self._notified = False
            claim = self.store.claim_or_wait(self.queue_name, limit, self.owner, lease)
        self._short = len(claim.jobs) < limit
        self.claim_window.claimed(
            sent=sent,
            returned=time.monotonic(),
            full=len(claim.jobs) >= limit,
            # Every message handed over before this claim was done when it came back: the
            # workers ran dry while it was on its way.
            starved=self.slots.in_use == 0,
        )
        if not claim.jobs:
            if claim.lease_seconds_left is not None:
                self.leases.leases_report(sent, claim.lease_seconds_left)
            self._last_empty = time.monotonic()
            wait = claim.seconds_until_available
            self._next_due = None if wait is None else self._last_empty + max(0.0, wait)
            if claim.paused:
                self._queue_paused()
            elif self._paused:
                self._paused = False
                logger.info("Queue %r was resumed.", self.queue_name)
            return False
        if self._paused:
            self._paused = False
            logger.info("Queue %r was resumed.", self.queue_name)
        self._last_empty = None
        undecodable: list[tuple[Attempt, str]] = []
        claimed: list[PgMessageProxy] = []
        for job in claim.jobs:
            if job.abort_requested:
                # An operator aborted it (a worker of the previous release requeued it
                # anyway): it ends cancelled without running.
                attempt = Attempt(job.id, self.owner, job.attempts)
                self.ledger.claimed(self.slots, attempt, leased_until=sent + lease)
                self.ledger.abort(job.id)
                continue
            proxy = self._proxy(job, sent + lease, undecodable)
            if proxy is not None:
                claimed.append(proxy)
        if claimed and self.prepare is not None:
            try:
                self.prepare(claimed)
            except Exception as e:
                # Nothing is lost: each message is prepared where it runs instead.
                logger.debug("Could not prepare %d claimed message(s): %s", len(claimed), e)
        self._buffer.extend(claimed)
        if undecodable:
            # After the batch is in hand, so that a failure to write these loses none of it.
            try:
                self.store.fail([a for a, _ in undecodable], [e for _, e in undecodable])
            except BrokerConnectionError as e:
                logger.warning(
                    "Could not dead-letter %d undecodable message(s) (%s); their leases "
                    "expire and they are tried again.",
                    len(undecodable),
                    e,
                )
        return bool(self._buffer)

    def _proxy(
        self, job: ClaimedJob, leased_until: float, undecodable: list[tuple[Attempt, str]]
    ) -> PgMessageProxy | None:
        attempt = Attempt(job.id, self.owner, job.attempts)
        try:
            message = self.decode_message(job.message, job.message_bytes)
        except Exception as e:
            # A message nobody can decode is dead-lettered with the reason, never dropped.
            logger.error("Job %s has a message that cannot be decoded: %s", job.id, e)
            undecodable.append((attempt, f"cannot decode message: {describe_exception(e)}"))
            return None
        # Dramatiq's convention: options["retries"] counts the earlier failed attempts
        # (its Retries middleware decides with it). Interruptions are not retries.
        if job.failures:
            message.options["retries"] = job.failures
        else:
            message.options.pop("retries", None)
        # The row's available_at already did the waiting. An eta left in a stored message
        # (one written by other means than enqueue, which strips it) would send the message
        # to Dramatiq's in-memory delay queue, which re-enqueues and acks the original.
        message.options.pop("eta", None)
        self.ledger.claimed(
            self.slots,
            attempt,
            leased_until=leased_until,
            start_first=job.abandoned_claims > 0,
        )
        return PgMessageProxy(message, attempt)

    def _wait_under_limit(self) -> None:
        """The queue is at its limit, or this process has no free thread: look again
        after :data:`LIMIT_RETRY_SECONDS` (or at once if something is announced)."""
        self._last_empty = time.monotonic()
        self._next_due = self._last_empty + LIMIT_RETRY_SECONDS
        self._short = True

    def _no_free_thread(self) -> None:
        """A limited queue's consumer found every worker thread of its process taken. If
        its queue has jobs it may run now (its last claim found some, or something was
        announced, or a look says so: one statement), it asks the process's other
        consumers to leave it the next free thread (:meth:`.QueueLimits.hungry`) and looks
        again soon. A queue at its limit looks again soon without asking (the limit, not
        the threads, holds it back); an empty one waits as an idle consumer does."""
        limits = self.queue_limits
        if self._last_look == "at limit" and not self._notified:
            if self.store.limited_room(self.queue_name, self.settings.lease_seconds) <= 0:
                limits.fed(self.queue_name)
                self._wait_under_limit()
                return
            self._last_look = "work"
        elif self._last_look == "empty" and not self._notified:
            peek = self.store.claim_or_wait(self.queue_name, 0, self.owner, 0)
            wait = peek.seconds_until_available
            if peek.paused or wait is None or wait > 0:
                limits.fed(self.queue_name)
                self._last_empty = time.monotonic()
                self._next_due = None if wait is None else self._last_empty + max(0.0, wait)
                return
            self._last_look = "work"
        limits.hungry(self.queue_name)
        self._wait_under_limit()

    def _became_limited(self) -> None:
        """The queue is limited (now, or since the last claim): the first time, give back
        what this consumer claimed and has not started, claimed before the limit was
        known here."""
        if self._limited:
            return
        self._limited = True
        self._give_back("has a limit now")

    def _wait_for_work(self, remaining: float) -> None:
        wait = remaining
        if self._last_empty is not None:
            wait = min(wait, self._last_empty + self.settings.poll_interval - time.monotonic())
        if self._next_due is not None:
            # At least a few milliseconds, so that a job due right now but claimed by
            # another consumer can never make this one spin on empty claims.
            wait = min(wait, max(0.005, self._next_due - time.monotonic() + 0.001))
        if wait <= 0:
            return
        subscription = self._listen()
        if subscription is None:
            time.sleep(wait)
            return
        # Not listening (the connection is being opened, or the server is away or has no
        # slot for it): the wait is the poll interval's at most, so the consumer polls.
        for payload in subscription.wait(wait):
            self._notice(payload)

    def _listen(self) -> Subscription | None:
        """The queue's channel, subscribed to on first use; None in poll-only mode. The
        process's LISTEN connection is a comfort (claims within milliseconds), never a
        condition: while it cannot be opened (the server has no free slot for it, or is
        unreachable) the consumer polls every ``poll_interval`` through the pool, and the
        connection's return delivers a "look" (the listener says why at DEBUG only; the
        process's outage and saturation lines tell the story, see :mod:`.outage`)."""
        if not self.settings.listen:
            return None
        if self._subscription is None:
            self._subscription = listener_for(self.pool.url).subscribe(
                self.store.channel(self.queue_name)
            )
            # A limit changed while nobody listened is not announced again: read them.
            self.queue_limits.invalidate()
        return self._subscription

    def _drain_notifications(self) -> None:
        # Notifications that arrived while we were busy only say "look": the claim that
        # follows sees every row they announced. Draining before the claim (never after)
        # means a notification for a row committed after the claim's snapshot is never
        # lost. For the same reason the subscription starts here, before the first claim,
        # not when the consumer first goes idle; until its LISTEN takes effect (which
        # delivers a "look"), the consumer claims as it would without notifications.
        subscription = self._listen()
        if subscription is not None:
            for payload in subscription.take():
                self._notice(payload)

    def _notice(self, payload: str) -> None:
        """One notification on the queue's channel: work to look at (no payload), an
        operator's abort of a job (``abort:<id>``), or a pause."""
        if payload.startswith(ABORT_PAYLOAD_PREFIX):
            self.ledger.abort(payload[len(ABORT_PAYLOAD_PREFIX) :])
        elif payload == PAUSE_PAYLOAD:
            self._queue_paused()
        elif payload == LIMIT_PAYLOAD:
            limits = self.queue_limits
            limits.invalidate()
            self._notified = True
            if limits.limit_of(self.queue_name, busy=True) is not None:
                self._became_limited()
        else:
            self._notified = True

    def _queue_paused(self) -> None:
        """An operator paused this queue: give back, uncharged, every message this consumer
        claimed that has not started (in its buffer, or handed to Dramatiq and waiting for
        a worker thread). Messages already running finish."""
        if not self._paused:
            self._paused = True
            logger.info(
                "Queue %r is paused: nothing is claimed until it is resumed.", self.queue_name
            )
        self._give_back("is paused")

    def _give_back(self, why: str) -> None:
        """Give back, uncharged, every message this consumer claimed that has not started
        (in its buffer, or handed to Dramatiq and waiting for a worker thread)."""
        self._buffer.clear()
        try:
            released = self.ledger.release(self.ledger.claimed_by(self.owner))
        except BrokerConnectionError as e:
            logger.warning(
                "Queue %r %s but its unstarted messages could not be given back (%s); "
                "their leases expire and they go back uncharged.",
                self.queue_name,
                why,
                e,
            )
            return
        if released:
            logger.info(
                "Queue %r %s: returned %d unstarted message(s).",
                self.queue_name,
                why,
                len(released),
            )

    # -- outcomes ------------------------------------------------------------------------

    def ack(self, message: PgMessageProxy) -> None:
        self.ledger.settle(message.attempt, "complete")

    def nack(self, message: PgMessageProxy) -> None:
        self.ledger.settle(message.attempt, "fail", describe_error(message))

    def requeue(self, messages) -> None:
        """Give prefetched, unstarted messages back to the queue at once, uncharged."""
        attempts = [m.attempt for m in messages if isinstance(m, PgMessageProxy)]
        if not attempts:
            return
        released = self.ledger.release(attempts)
        if released:
            logger.info(
                "Returned %d unstarted message(s) to queue %r.", len(released), self.queue_name
            )

    def close(self) -> None:
        buffered = list(self._buffer)
        self._buffer.clear()
        try:
            if buffered:
                self.requeue(buffered)
        except BrokerConnectionError:
            logger.warning(
                "Could not return %d claimed message(s); their leases will expire and they "
                "go back uncharged.",
                len(buffered),
            )
        finally:
            subscription, self._subscription = self._subscription, None
            if subscription is not None:
                subscription.close()
