"""Leases: the heartbeat that keeps outstanding attempts owned, and the reaper that
requeues attempts whose worker stopped renewing.

One :class:`LeaseKeeper` thread runs in each worker process (it starts with the first
consumer). Every ``heartbeat_interval`` (a third of the lease by default) it renews, in one
statement, the leases of every outstanding message of the process, prefetched and running,
except those of running actors declared with ``heartbeat=False``. Every ``reaper_interval`` it runs
the reaper: a bounded, ``SKIP LOCKED`` statement, so every process can run it at once and
an idle run costs one index probe.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from dramatiq.errors import BrokerConnectionError

from .jobs import Attempt

if TYPE_CHECKING:
    from .broker import PostgresBroker

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """Heartbeat and reaper of one process. See the module docstring."""

    def __init__(self, broker: PostgresBroker) -> None:
        self.broker = broker
        self.store = broker.store
        self.settings = broker.settings
        self._attempts: dict[str, tuple[Attempt, bool]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None

    # -- tracking ------------------------------------------------------------------------

    def track(self, attempt: Attempt) -> None:
        """Start renewing an attempt (a claimed message, prefetched or running)."""
        self.start()
        with self._lock:
            self._attempts[attempt.id] = (attempt, True)

    def started_without_heartbeat(self, attempt: Attempt) -> None:
        """An actor declared with ``heartbeat=False`` starts: give it one full lease from
        now and stop renewing it, so the lease expires ``lease_seconds`` after the start
        unless the actor renews it itself. (While the message waited in the worker's queue
        it was renewed like any other, so waiting never costs it its lease.)"""
        with self._lock:
            current = self._attempts.get(attempt.id)
            if current is None or current[0] != attempt:
                return
            self._attempts[attempt.id] = (attempt, False)
        self.store.renew([attempt], self.settings.lease_seconds)

    def untrack(self, attempt: Attempt) -> None:
        with self._lock:
            current = self._attempts.get(attempt.id)
            if current is not None and current[0] == attempt:
                del self._attempts[attempt.id]

    def tracked(self) -> list[Attempt]:
        with self._lock:
            return [attempt for attempt, renew in self._attempts.values() if renew]

    # -- the thread ----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                if self._pid != os.getpid():
                    # A forked child owns none of its parent's attempts.
                    self._attempts.clear()
                self._pid = os.getpid()
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._run, name="dramatiq-pg-leases", daemon=True
                )
                self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and self._pid == os.getpid() and thread.is_alive():
            thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        import time

        heartbeat = self.settings.heartbeat_interval
        reaper = self.settings.reaper_interval
        next_heartbeat = time.monotonic() + heartbeat
        # Reap soon after start: a restarted worker recovers what its predecessor left.
        next_reap = time.monotonic() + min(reaper, 1.0)
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_heartbeat:
                self._guard(self.renew)
                next_heartbeat = now + heartbeat
            if now >= next_reap:
                self._guard(self.reap)
                next_reap = now + reaper
            self._stop.wait(max(0.0, min(next_heartbeat, next_reap) - time.monotonic()))

    def _guard(self, fn) -> None:
        try:
            fn()
        except BrokerConnectionError as e:
            logger.warning("Lease maintenance could not reach the database: %s", e)
        except Exception:
            logger.exception("Lease maintenance failed.")

    # -- the work ------------------------------------------------------------------------

    def renew(self) -> set[str]:
        """Renew every tracked attempt; forget (and log) the ones no longer owned."""
        attempts = self.tracked()
        if not attempts:
            return set()
        owned = self.store.renew(attempts, self.settings.lease_seconds)
        for attempt in attempts:
            if attempt.id not in owned:
                # Either its outcome was just written, or the lease expired and another
                # worker owns the job now: stop renewing it in both cases.
                self.untrack(attempt)
        return owned

    def reap(self):
        """Requeue or fail running jobs whose lease expired (any worker's)."""
        result = self.store.reap(
            batch=self.settings.reaper_batch,
            backoff_base_ms=self.settings.backoff_base_ms,
            backoff_max_ms=self.settings.backoff_max_ms,
        )
        if result.requeued or result.failed:
            logger.warning(
                "Reaper: %d job(s) with expired leases requeued, %d failed (attempts exhausted).",
                len(result.requeued),
                len(result.failed),
            )
        return result
