"""The outcome writer: acks and nacks written in batches from one thread per process.

Worker threads only hand their outcome over (through the :class:`~.inflight.Ledger`); the
writer takes everything that accumulated while its previous statement ran and writes it as
one guarded statement per kind (group commit). An outcome is durable one round trip after
the actor returns; a crash before that loses no job: the attempt is still ``running`` and
runs again once its lease expires (at-least-once). Until an outcome is written its attempt
keeps its prefetch slot and its lease is renewed, so the queue of outcomes is bounded by the
process's prefetch, and an owner that is merely waiting for the database keeps its jobs.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from dramatiq.errors import BrokerConnectionError

from ..jobs.rows import Attempt
from ..jobs.store import JobStore
from ..service import Service
from .inflight import Ledger
from .states import RETRY_CAP_SECONDS

logger = logging.getLogger("dramatiq_pg_broker.outcomes")

#: The most outcomes one statement writes.
MAX_BATCH = 1000

#: The most outcomes waiting for the writer; a worker thread handing in one more waits.
MAX_QUEUED = 10_000

#: (kind, attempt, detail): the error of a ``fail``, the skip of a ``skip`` (a dict).
Outcome = tuple[str, Attempt, Any]


class OutcomeWriter(Service):
    """Writes acks and nacks in batches. See the module docstring."""

    thread_name = "dramatiq-pg-outcomes"

    def __init__(self, store: JobStore, ledger: Ledger, max_batch: int = MAX_BATCH) -> None:
        super().__init__()
        self.store = store
        self.ledger = ledger
        self.max_batch = max_batch
        self._queue: queue.Queue[Outcome | None] = queue.Queue(MAX_QUEUED)

    def submit(self, kind: str, attempt: Attempt, error: Any) -> None:
        """Queue one outcome (``complete``, ``fail``, ``abort`` or ``skip``). Only the
        ledger calls this."""
        self.start()
        self._queue.put((kind, attempt, error))

    def reset(self) -> None:
        # A forked child must not write (or wait on) its parent's outcomes.
        self._queue = queue.Queue(MAX_QUEUED)

    def wake(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # the writer is busy, and looks at `stopping` after this batch

    def run(self) -> None:
        while not self.stopping.is_set():
            batch = [self._queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            outcomes = [outcome for outcome in batch if outcome is not None]
            try:
                if outcomes:
                    self._write(outcomes)
            except Exception:  # pragma: no cover - _write handles its own errors
                logger.exception("The outcome writer failed on %d outcome(s).", len(outcomes))
                for _, attempt, _ in outcomes:
                    self.ledger.unwritable(attempt)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _write(self, batch: list[Outcome]) -> None:
        completed = [(attempt, None) for kind, attempt, _ in batch if kind == "complete"]
        failed = [(attempt, error) for kind, attempt, error in batch if kind == "fail"]
        aborted = [(attempt, None) for kind, attempt, _ in batch if kind == "abort"]
        skipped = [(attempt, skip) for kind, attempt, skip in batch if kind == "skip"]
        ledger = self.ledger
        # Each statement is retried on its own: one that committed is never sent again (a
        # second run would find its rows no longer running and report them as lost).
        for items, statuses, write in (
            (completed, ("succeeded",), lambda items: self.store.complete([a for a, _ in items])),
            (
                failed,
                # A failure ends a job whose abort was requested cancelled (fail_jobs).
                ("failed", "cancelled"),
                lambda items: self.store.fail([a for a, _ in items], [e for _, e in items]),
            ),
            (
                aborted,
                ("cancelled",),
                lambda items: self.store.abort_attempts([a for a, _ in items]),
            ),
            (
                skipped,
                ("cancelled",),
                lambda items: self.store.cancel_skipped(
                    [a for a, _ in items], [s for _, s in items]
                ),
            ),
        ):
            if not items:
                continue
            owned, unwritten = self._write_batch(items, write)
            owned = owned | self._written_before(statuses, items, owned | unwritten)
            for attempt, _ in items:
                if attempt.id in unwritten:
                    ledger.unwritable(attempt)
                else:
                    ledger.written(attempt, attempt.id in owned)

    def _written_before(
        self, statuses: tuple[str, ...], items: list[tuple[Attempt, Any]], known: set[str]
    ) -> set[str]:
        """Of the attempts a statement found no longer running, those whose job already
        ended with one of ``statuses`` at that attempt: a try before committed and its
        reply was lost to a dropped connection. They were written, not lost (no warning for
        a job that is fine). Anything else, or a database that cannot answer, leaves them
        lost."""
        missing = [attempt for attempt, _ in items if attempt.id not in known]
        if not missing:
            return set()
        try:
            found = self.store.finished_attempts(missing, statuses)
        except Exception as e:  # the warning then says lost, as before this check
            logger.debug("Could not check whether lost outcomes were written: %s", e)
            return set()
        for attempt in missing:
            if attempt.id in found:
                logger.debug(
                    "Job %s attempt %d was already %s: an earlier try of its outcome "
                    "committed as the connection dropped.",
                    attempt.id,
                    attempt.attempt,
                    " or ".join(statuses),
                )
        return found

    def _write_batch(
        self, items: list[tuple[Attempt, Any]], write: Callable[[list], set[str]]
    ) -> tuple[set[str], set[str]]:
        """Write ``items`` as one statement; returns the ids still owned and the ids that
        could not be written. If the statement fails for a reason other than the
        connection (a row the database refuses), each item is written on its own, so that
        one bad outcome affects only itself."""
        try:
            return self._until_written(lambda: write(items)), set()
        except Exception as e:
            if len(items) == 1:
                return set(), self._give_up(items, e)
            logger.warning(
                "Writing %d outcome(s) at once failed (%s); writing them one by one.",
                len(items),
                e,
            )
        owned: set[str] = set()
        unwritten: set[str] = set()
        for item in items:
            try:
                owned |= self._until_written(lambda item=item: write([item]))
            except Exception as e:
                unwritten |= self._give_up([item], e)
        return owned, unwritten

    @staticmethod
    def _give_up(items: list[tuple[Attempt, Any]], error: Exception) -> set[str]:
        for attempt, _ in items:
            logger.error(
                "Could not write the outcome of job %s attempt %d (%s: %s); it runs again "
                "once its lease expires.",
                attempt.id,
                attempt.attempt,
                type(error).__name__,
                error,
            )
        return {attempt.id for attempt, _ in items}

    @staticmethod
    def _until_written(write: Callable[[], set[str]]) -> set[str]:
        """Run a write until the database takes it, retrying connection errors with a
        short, capped pause (the writer resumes within a fraction of a second of the
        server's return)."""
        delay = 0.05
        while True:
            try:
                return write()
            except BrokerConnectionError as e:
                # Told once per outage by the process (outage.py), not at every try.
                logger.debug("Could not write outcomes, retrying in %.2fs: %s", delay, e)
                time.sleep(delay)
                delay = min(delay * 2, RETRY_CAP_SECONDS)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted outcome is written. Returns False on timeout."""
        if not self._process.here:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True
