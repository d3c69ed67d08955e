"""Leases: the heartbeat that keeps outstanding attempts owned, and the reaper that
requeues attempts whose worker stopped renewing.

One :class:`LeaseKeeper` thread runs in each worker process (it starts with the first
claim). Every ``heartbeat_interval`` (a third of the lease by default) it renews, in one
statement, the leases of every attempt the in-flight ledger holds (prefetched, running, or
waiting for its outcome to be written), except those of running actors declared with
``heartbeat=False``. The renewal also returns which of them an operator asked to abort,
which the ledger then stops: how a worker learns of an abort when no NOTIFY reaches it
(``listen=False``, a transaction-mode pooler), within a heartbeat. With the same beat the
process refreshes its row in the worker registry (:mod:`.workers`) and, when it renewed
attempts, has the job tables analyzed whose statistics fell far behind them
(:mod:`..jobs.statistics`). It writes the starts the ledger deferred, a moment after their
actors began (:meth:`.Ledger.record_starts`).
Every ``reaper_interval`` it runs the reaper: a
bounded, ``SKIP LOCKED`` statement, so every process can run it at once and an idle run
costs one index probe. After the database was unreachable, a process renews as soon as it
is back and waits a whole lease before reaping, so that no owner loses a live attempt to
an outage.

An idle process sends no reaper statement while no lease can have expired: a claim that
finds nothing also reports when the earliest lease of any running job expires
(:meth:`LeaseKeeper.leases_report`), and a reaper run due before then, with a report of
the last :data:`REPORT_FRESH_POLLS` poll intervals in hand, is skipped. A lease taken
after the report expires no sooner than a whole lease of this process's length after it,
so the report holds until then at the latest. A busy process's claims report nothing and
its reaper runs on its interval. (A lease shortened since the report by an explicit
``renew(lease_seconds=...)`` shorter than the report's age is reaped one interval late.)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from dramatiq.errors import BrokerConnectionError

from ..backoff import backoff_table
from ..control.workers import Presence
from ..jobs.rows import ReapedJob, ReapResult
from ..service import Service
from .core import WorkerCore
from .states import RETRY_CAP_SECONDS, START_RECORD_DELAY

logger = logging.getLogger("dramatiq_pg_broker.leases")

#: How many poll intervals an idle claim's lease report stays usable (see the module
#: docstring): an idle consumer sends one every poll interval.
REPORT_FRESH_POLLS = 2


@dataclasses.dataclass(eq=False, repr=False)
class LeaseKeeper(Service):
    """Heartbeat and reaper of one process. See the module docstring.

    Parameters:
      core(WorkerCore): the job store (renewals, the reaper's statement), the settings
        (the lease, the intervals, the reaper's batch and backoff), the in-flight ledger
        (the attempts this process holds) and the schema gate (nothing is renewed or
        reaped before it opens).
      presence(Presence): this process's row in the worker registry, refreshed at each
        beat.
      reaped_failed(callable): ``reaped_failed(job)`` for each job the reaper failed (its
        interruptions exhausted): the broker's
        :func:`~dramatiq_pg_broker.attempt.retries.end_reaped_job`, which runs the failure
        hooks of its middleware.
    """

    thread_name = "dramatiq-pg-leases"

    core: WorkerCore
    presence: Presence
    reaped_failed: Callable[[ReapedJob], None] = dataclasses.field(kw_only=True)

    def __post_init__(self) -> None:
        super().__init__()
        #: Set to wake the thread early: a start was deferred, or the keeper stops.
        self._wake = threading.Event()
        #: Whether the thread knows of deferred starts (it sets a timer for them).
        self._starts_armed = False
        #: A beat is due now, before its interval (see :meth:`renew_soon`).
        self._beat_due = False
        #: When the next deferred start is due (what the last record_starts() found).
        self._next_start_due: float | None = None
        #: Monotonic time before which this process does not reap: set after the database
        #: was unreachable, so that the owners of live attempts renew them first.
        self._reap_after = 0.0
        #: The last idle claim's lease report: (monotonic time it was sent, monotonic time
        #: before which no lease can have expired).
        self._quiet: tuple[float, float] | None = None

    # -- the thread ----------------------------------------------------------------------

    def reset(self) -> None:
        # A forked child holds none of its parent's leases, and no news from its claims.
        self._wake = threading.Event()
        self._starts_armed = False
        self._beat_due = False
        self._next_start_due = None
        self._reap_after = 0.0
        self._quiet = None

    def wake(self) -> None:
        self._wake.set()

    def starts_pending(self) -> None:
        """The ledger deferred a start: write it within :data:`START_RECORD_DELAY` or so."""
        if not self._starts_armed:
            self._starts_armed = True
            self._wake.set()

    def renew_soon(self) -> None:
        """The ledger renews an attempt again after a pause (a ``complete_in()`` block
        that held its row ended without a success, maybe late in the lease its start
        gave): beat now rather than at the next interval."""
        self._beat_due = True
        self._wake.set()

    def leases_report(self, sent: float, seconds_left: float) -> None:
        """A claim sent at ``sent`` (monotonic) found nothing, and the earliest lease of
        any running job expiring ``seconds_left`` later by the server's clock (``math.inf``:
        no job ran). A lease taken since expires no sooner than ``lease_seconds`` after
        ``sent``: until the earlier of the two, a reaper run would find nothing."""
        self._quiet = (sent, sent + min(seconds_left, self.core.settings.lease_seconds))

    def _nothing_expired(self, now: float) -> bool:
        """Whether a fresh lease report says that no lease can have expired yet."""
        quiet = self._quiet
        fresh = REPORT_FRESH_POLLS * self.core.settings.poll_interval
        return quiet is not None and now - quiet[0] <= fresh and now < quiet[1]

    def run(self) -> None:
        heartbeat = self.core.settings.heartbeat_interval
        reaper = self.core.settings.reaper_interval
        next_heartbeat = time.monotonic() + heartbeat
        # Reap soon after start: a restarted worker recovers what its predecessor left.
        next_reap = time.monotonic() + min(reaper, 1.0)
        next_starts: float | None = None
        while not self.stopping.is_set():
            now = time.monotonic()
            if self._starts_armed and next_starts is None:
                next_starts = now + START_RECORD_DELAY
            if next_starts is not None and now >= next_starts:
                # Disarm before looking, so that a start deferred meanwhile arms it again.
                self._starts_armed = False
                if self.guarded(self.record_starts):
                    next_starts = self._next_start_due
                else:
                    next_starts = now + RETRY_CAP_SECONDS
                if next_starts is not None:
                    self._starts_armed = True
            if now >= next_heartbeat or self._beat_due:
                self._beat_due = False
                if self.guarded(self.heartbeat):
                    next_heartbeat = now + heartbeat
                else:
                    # Unreachable: try again soon, so that leases are renewed within a
                    # moment of the server's return.
                    next_heartbeat = now + min(heartbeat, RETRY_CAP_SECONDS)
            if now >= next_reap and self.core.schema_gate.is_open:
                # (A worker whose schema handshake has not passed reaps nothing: see
                # handshake.SchemaGate. Renewals and starts concern claims it made after.)
                self.guarded(self.reap)
                next_reap = now + reaper
            wake_at = min(next_heartbeat, next_reap, next_starts or next_reap)
            self._wake.wait(max(0.0, wake_at - time.monotonic()))
            self._wake.clear()

    def guarded(self, fn) -> bool:
        """Run one piece of lease maintenance (``fn``); True if it ran, False if it failed.
        An unreachable database is not raised, and holds the next reaper run back by a
        lease; any other error is logged."""
        try:
            fn()
            return True
        except BrokerConnectionError as e:
            # Told once per outage by the process (outage.py), not at every try.
            logger.debug("Lease maintenance could not reach the database: %s", e)
            # The leases of this process's attempts (and maybe others') could not be
            # renewed: give every owner a whole lease to come back before reaping.
            self._reap_after = time.monotonic() + self.core.settings.lease_seconds
            return False
        except Exception:
            logger.exception("Lease maintenance failed.")
            return False

    # -- the work ------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """One beat: renew the leases, then refresh this process's registry row; a busy
        beat (it renewed attempts) also has the job tables analyzed whose statistics fell
        far behind them (:mod:`~..jobs.statistics`)."""
        owned = self.renew()
        self.presence.refresh()
        if owned:
            self.refresh_statistics()

    def refresh_statistics(self) -> None:
        """Analyze the job tables whose statistics fell far behind them. A failure is
        logged and leaves the leases alone: the next busy beat tries again."""
        try:
            analyzed = self.core.store.refresh_statistics()
        except BrokerConnectionError:
            raise
        except Exception:
            logger.exception("Refreshing the job tables' statistics failed.")
            return
        if analyzed:
            logger.info(
                "Analyzed %s: they held far more rows than their statistics counted.",
                ", ".join(analyzed),
            )

    def renew(self) -> set[str]:
        """Renew every attempt the ledger holds; the ledger lets go of those no longer
        owned, and stops those an operator asked to abort."""
        ledger = self.core.ledger
        with ledger.renewing() as attempts:
            if not attempts:
                return set()
            sent = time.monotonic()
            renewal = self.core.store.renew_leases(attempts, self.core.settings.lease_seconds)
            ledger.renewed(attempts, renewal.owned, sent + self.core.settings.lease_seconds)
        for job_id in renewal.abort_requested:
            ledger.abort(job_id)
        return renewal.owned

    def record_starts(self) -> None:
        """Write the starts the ledger deferred; remember when the next one is due."""
        self._next_start_due = self.core.ledger.record_starts()

    def reap(self) -> ReapResult | None:
        """Give back running jobs whose lease expired (any worker's); run Dramatiq's
        failure hooks for those that failed (interruptions exhausted)."""
        now = time.monotonic()
        if now < self._reap_after or self._nothing_expired(now):
            return None
        settings = self.core.settings
        result = self.core.store.reap(
            batch=settings.reaper_batch,
            backoff_ms=backoff_table(settings.backoff_base_ms, settings.backoff_max_ms),
            max_interruptions=settings.max_interruptions,
            lease_seconds=settings.lease_seconds,
        )
        if result.requeued or result.failed or result.released or result.aborted:
            logger.warning(
                "Reaper: of the jobs with expired leases, %d interrupted attempt(s) requeued, "
                "%d unstarted claim(s) given back, %d failed (interruptions exhausted), %d "
                "cancelled (an abort was requested).",
                len(result.requeued),
                len(result.released),
                len(result.failed),
                len(result.aborted),
            )
        for job in result.failed_jobs:
            self.reaped_failed(job)
        return result
