"""The ledger's side of the heartbeat: starts written before the actors run, and the
renewal of every lease the process holds (a part of :class:`.inflight.Ledger`)."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from dramatiq.errors import BrokerConnectionError

from ..jobs.rows import Attempt
from .states import RETRY_CAP_SECONDS, ROW_WAIT_SECONDS, START_RECORD_DELAY, State

logger = logging.getLogger("dramatiq_pg_broker.inflight")


class HeartbeatBook:
    """Starts and renewals of the attempts the ledger holds."""

    # -- starting ------------------------------------------------------------------------

    def start(self, attempt: Attempt, *, record_first: bool = False) -> bool:
        """claimed -> started, just before the actor runs. Returns False (the message must
        not run) if this process no longer holds the attempt: it was released at shutdown,
        or its lease was lost.

        The start is written later, by :meth:`record_starts`, while the lease is surely
        held; otherwise (and with ``record_first``, or for a job with an abandoned claim) it
        is written now, by one guarded statement group-committed with other threads'
        starts, and a lost claim is found before the actor runs. While the database is
        unreachable that write is retried, at least twice a second: its guard, not a local
        clock, says whether the claim is still this process's.
        """
        self._check_fork()
        with self._lock:
            entry = self._get(attempt, State.CLAIMED)
            if entry is None:
                self._refuse("start", attempt)
                return False
            now = time.monotonic()
            if (
                not (record_first or entry.start_first or self._closing)
                and entry.leased_until - now > self.settings.lease_seconds / 2
            ):
                entry.state = State.STARTED
                entry.began = now
                deferred = True
            else:
                deferred = False
        if deferred:
            self._leases().starts_pending()
            return True
        delay = 0.05
        while True:
            with self._lock:
                if self._get(attempt, State.CLAIMED) is None:
                    return False
            if self._closing:
                # Shutdown began after the worker took it: it goes back instead.
                try:
                    self.release([attempt])
                except BrokerConnectionError:
                    pass
                return False
            try:
                owned = self._starts.submit(attempt)
                break
            except BrokerConnectionError as e:
                # Told once per outage by the process (outage.py), not at every try.
                logger.debug("Could not record the start of job %s, retrying: %s", attempt.id, e)
                time.sleep(delay)
                delay = min(delay * 2, RETRY_CAP_SECONDS)
        with self._lock:
            entry = self._get(attempt, State.CLAIMED)
            if entry is None:
                return False
            if attempt.id not in owned:
                logger.warning(
                    "Job %s attempt %d was lost before it started (its lease expired and the "
                    "job went to another worker); it is not run here.",
                    attempt.id,
                    attempt.attempt,
                )
                self._finish(entry)
                return False
            entry.state = State.STARTED
            entry.start_recorded = True
            return True

    def record_starts(self) -> float | None:
        """Write, in one statement, the starts of attempts whose actors began at least
        :data:`START_RECORD_DELAY` ago and have no outcome yet, and of attempts let go
        without an outcome before their start was written. A running attempt the statement
        finds owned by someone else is lost: it is let go (its outcome will be refused).
        Returns the monotonic time the next unwritten start is due, or None.

        Raises:
          dramatiq.errors.ConnectionError: the database is unreachable; nothing changed.
        """
        self._check_fork()
        now = time.monotonic()
        later: list[float] = []
        with self._lock:
            orphans, self._orphans = self._orphans, []
            due: list[Attempt] = list(orphans)
            for entry in self._entries.values():
                if entry.state is not State.STARTED or entry.start_recorded:
                    continue
                if entry.completion is not None:
                    # Its row is locked by the application's transaction: the start would
                    # wait for it (and a committed success needs none).
                    continue
                if entry.began + START_RECORD_DELAY <= now:
                    due.append(entry.attempt)
                else:
                    later.append(entry.began + START_RECORD_DELAY)
            self._heartbeat_writing.update(a.id for a in due)
        if due:
            try:
                owned = self.store.start(due, None)
            except BaseException:
                with self._lock:
                    self._orphans.extend(orphans)
                raise
            finally:
                self._heartbeat_wrote(due)
            with self._lock:
                for attempt in due[len(orphans) :]:
                    entry = self._get(attempt, State.STARTED)
                    if entry is None or entry.completion is not None:
                        continue  # its outcome came meanwhile, or a complete_in() block
                    if attempt.id in owned:
                        entry.start_recorded = True
                    else:
                        logger.warning(
                            "Lost job %s attempt %d while its actor ran: its lease expired "
                            "and another worker may run it.",
                            attempt.id,
                            attempt.attempt,
                        )
                        self._finish(entry)
        return min(later) if later else None

    def _write_starts(self, attempts: list[Attempt]) -> set[str]:
        return self.store.start(attempts, self.settings.lease_seconds)

    def claimed_by(self, owner: str) -> list[Attempt]:
        """The attempts of one consumer (its lease owner id) that are claimed and have not
        started: what it gives back when its queue is paused."""
        with self._lock:
            return [
                e.attempt
                for e in self._entries.values()
                if e.state is State.CLAIMED and e.attempt.owner == owner
            ]

    # -- leases --------------------------------------------------------------------------

    def renewable(self) -> list[Attempt]:
        """Attempts whose leases the heartbeat renews."""
        self._check_fork()
        with self._lock:
            return [e.attempt for e in self._entries.values() if e.renew]

    @contextlib.contextmanager
    def renewing(self) -> Iterator[list[Attempt]]:
        """:meth:`renewable`, held as being written until the block ends: a
        ``complete_in()`` block waits for the statement to be done with its attempt before
        it takes the row's lock (:meth:`completing`), so that the heartbeat never waits
        for an application's transaction."""
        with self._lock:
            attempts = self.renewable()
            self._heartbeat_writing.update(a.id for a in attempts)
        try:
            yield attempts
        finally:
            self._heartbeat_wrote(attempts)

    def _heartbeat_wrote(self, attempts: Iterable[Attempt]) -> None:
        with self._lock:
            self._heartbeat_writing.subtract(a.id for a in attempts)
            self._heartbeat_writing += collections.Counter()  # drops the zeros
            self._heartbeat_done.notify_all()

    def renewed(
        self, attempts: Sequence[Attempt], owned: set[str], leased_until: float | None = None
    ) -> None:
        """A renewal returned ``owned``: let go of the attempts it did not renew (lost).
        ``leased_until``: the monotonic time until which the renewed leases surely hold."""
        with self._lock:
            for attempt in attempts:
                entry = self._entries.get(attempt.id)
                if entry is None or entry.attempt != attempt or entry.state is State.DONE:
                    continue
                if entry.completion is not None:
                    # Renewed just before a complete_in() block took the row: the block
                    # and its transaction say what happened to it, not this renewal.
                    continue
                if attempt.id in owned:
                    if leased_until is not None:
                        entry.leased_until = max(entry.leased_until, leased_until)
                    continue
                if entry.state is not State.RESCHEDULING:
                    # Its outcome was just written, or the lease expired and another
                    # worker owns the job now.
                    if entry.state is not State.OUTCOME_QUEUED:
                        logger.warning(
                            "Lost job %s attempt %d: its lease expired and another worker "
                            "may run it.",
                            attempt.id,
                            attempt.attempt,
                        )
                    self._finish(entry)

    # -- the actor's own calls -------------------------------------------------------------

    def renew(self, attempt: Attempt, lease_seconds: float, *, record: bool = False) -> bool:
        """An explicit renewal by the running actor. Returns False if no longer owned.

        While a ``complete_in()`` block's transaction holds the job's row
        (:meth:`holds_row`), nothing is written and True is returned: that transaction's
        lock holds the job (the reaper passes a locked row by), and a renewal would wait
        for it in the very thread that holds it. Otherwise the statement waits at most
        :data:`~.states.ROW_WAIT_SECONDS` for the row.

        Raises:
          JobBusy: a transaction the worker does not know of (the application's own lock
            on the job's row) held the row for all of that wait; nothing was written.
        """
        if self.holds_row(attempt):
            return True
        owned = self.store.renew(
            [attempt], lease_seconds, record=record, lock_wait=ROW_WAIT_SECONDS
        )
        return attempt.id in owned

    def progress(self, attempt: Attempt, data: Any, lease_seconds: float) -> bool:
        """A ``progress`` event with ``data`` from the running actor, and a renewed lease.
        Returns False if no longer owned.

        While a ``complete_in()`` block's transaction holds the job's row
        (:meth:`holds_row`), the event alone is recorded, and the row is left alone: a
        write would wait for that transaction's lock, or, at REPEATABLE READ or
        SERIALIZABLE, come after the block's snapshot and fail the block's success. As
        for :meth:`renew`, the statement that writes the row waits at most
        :data:`~.states.ROW_WAIT_SECONDS` for it.

        Raises:
          JobBusy: a transaction the worker does not know of held the row for all of that
            wait; nothing was written.
        """
        if self.holds_row(attempt):
            return self.store.progress_event(attempt, data)
        return self.store.progress(attempt, data, lease_seconds, lock_wait=ROW_WAIT_SECONDS)
