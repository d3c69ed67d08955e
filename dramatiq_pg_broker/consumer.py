"""PostgresConsumer: claims batches of job rows, hands them to Dramatiq, and writes outcomes.

Claiming: a consumer claims up to ``prefetch - outstanding`` rows in one statement once
its outstanding messages fall to half the prefetch, so a busy worker pays one round trip
per batch, not per message. An idle consumer waits on LISTEN (its own connection) for a
payload-free NOTIFY from an enqueue, at most until its poll interval or the moment the
earliest delayed job becomes runnable, whichever comes first.

Outcomes: Dramatiq calls ``ack``/``nack`` from its worker threads. They are handed to one
:class:`OutcomeWriter` thread per process, which writes everything that accumulated while
its previous statement ran as one guarded statement per kind (group commit). An outcome is
durable one round trip after the actor returns; a crash before that loses no job: the
attempt is still ``running`` and runs again once its lease expires (at-least-once).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

import dramatiq
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.errors import BrokerConnectionError

from .db import connect, translate_errors
from .jobs import Attempt, ClaimedJob

if TYPE_CHECKING:
    from .broker import PostgresBroker

logger = logging.getLogger(__name__)


def new_owner_id() -> str:
    """A lease owner id: ``host:pid:thread:random``, unique per consumer instance."""
    return (
        f"{socket.gethostname()}:{os.getpid()}:{threading.current_thread().name}:"
        f"{uuid.uuid4().hex[:8]}"
    )


def describe_error(message: MessageProxy) -> str:
    """The text kept in ``last_error`` for a failed attempt."""
    exc = getattr(message, "_exception", None)
    if exc is None:
        return "message rejected"
    text = str(exc)
    error = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    # PostgreSQL text cannot hold NUL characters: one in an exception's text would make the
    # outcome (or the retry) impossible to write.
    return error.replace("\x00", "\\x00")


class PgMessageProxy(MessageProxy):
    """A Dramatiq message proxy that remembers which attempt of which job row it is."""

    def __init__(self, message: dramatiq.Message, attempt: Attempt, consumer: PostgresConsumer):
        super().__init__(message)
        self._attempt = attempt
        self._consumer = consumer
        #: True once the attempt's outcome was decided elsewhere (a retry rescheduled the
        #: row), so the ack or nack that Dramatiq sends next must not write anything.
        self._settled = False

    @property
    def attempt(self) -> Attempt:
        return self._attempt


class PostgresConsumer(Consumer):
    """Consumes one queue for one Dramatiq consumer thread. See the module docstring."""

    def __init__(self, broker: PostgresBroker, queue_name: str, prefetch: int, timeout: int):
        self.broker = broker
        self.store = broker.store
        self.settings = broker.settings
        self.queue_name = queue_name
        self.prefetch = max(1, prefetch)
        # Claim again once outstanding messages fall to this many: batches, not trickles.
        self.low_water = self.prefetch // 2
        self.timeout = max(0.0, timeout / 1000)
        self.owner = new_owner_id()
        self._buffer: deque[PgMessageProxy] = deque()
        self._outstanding = 0
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._listen_conn = None
        self._next_due: float | None = None

    # -- claiming ------------------------------------------------------------------------

    def __next__(self) -> PgMessageProxy | None:
        if self._buffer:
            return self._buffer.popleft()
        deadline = time.monotonic() + self.timeout
        while True:
            self._drain_notifications()
            if self._outstanding <= self.low_water:
                if self._claim():
                    return self._buffer.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self._outstanding > self.low_water:
                # Enough work in hand: wait for an outcome to free a slot.
                self._settled.wait(remaining)
                self._settled.clear()
            else:
                self._wait_for_work(remaining)

    def _claim(self) -> bool:
        limit = self.prefetch - self._outstanding
        jobs = self.store.claim(self.queue_name, limit, self.owner, self.settings.lease_seconds)
        if not jobs:
            self._refresh_next_due()
            return False
        for job in jobs:
            proxy = self._proxy(job)
            if proxy is not None:
                self._buffer.append(proxy)
        return bool(self._buffer)

    def _proxy(self, job: ClaimedJob) -> PgMessageProxy | None:
        attempt = Attempt(job.id, self.owner, job.attempts)
        try:
            message = self.broker.decode_message(job.message, job.message_bytes)
        except Exception as e:
            # A message nobody can decode is dead-lettered with the reason, never dropped.
            logger.error("Job %s has a message that cannot be decoded: %s", job.id, e)
            self.store.fail([attempt], [f"cannot decode message: {type(e).__name__}: {e}"])
            return None
        if job.attempts > 1:
            # Dramatiq's convention: options["retries"] counts the earlier attempts.
            message.options["retries"] = job.attempts - 1
        # The row's available_at already did the waiting. An eta left in a stored message
        # (one written by other means than enqueue, which strips it) would send the message
        # to Dramatiq's in-memory delay queue, which re-enqueues and acks the original.
        message.options.pop("eta", None)
        with self._lock:
            self._outstanding += 1
        self.broker.leases.track(attempt)
        return PgMessageProxy(message, attempt, self)

    def _refresh_next_due(self) -> None:
        seconds = self.store.seconds_until_available(self.queue_name)
        self._next_due = None if seconds is None else time.monotonic() + max(0.0, seconds)

    def _wait_for_work(self, remaining: float) -> None:
        wait = min(remaining, self.settings.poll_interval)
        if self._next_due is not None:
            # At least a few milliseconds, so that a job due right now but claimed by
            # another consumer can never make this one spin on empty claims.
            wait = min(wait, max(0.005, self._next_due - time.monotonic() + 0.001))
        if wait <= 0:
            return
        conn = self._listener()
        if conn is None:
            time.sleep(wait)
            return
        with translate_errors():
            for _ in conn.notifies(timeout=wait, stop_after=1):
                pass

    def _listener(self):
        if not self.settings.listen:
            return None
        if self._listen_conn is None:
            conn = connect(self.broker.pool.url)
            try:
                with translate_errors():
                    conn.execute(f"LISTEN {_quote_ident(self.store.channel(self.queue_name))}")
            except BaseException:
                conn.close()
                raise
            self._listen_conn = conn
        return self._listen_conn

    def _drain_notifications(self) -> None:
        # Notifications that arrived while we were busy are stale: the claim that follows
        # sees every row they announced. Draining before the claim (never after) means a
        # notification for a row committed after the claim's snapshot is never lost. For
        # the same reason the LISTEN starts here, before the first claim, not when the
        # consumer first goes idle.
        conn = self._listener()
        if conn is not None:
            with translate_errors():
                for _ in conn.notifies(timeout=0):
                    pass

    # -- outcomes ------------------------------------------------------------------------

    def ack(self, message: PgMessageProxy) -> None:
        self.broker.outcomes.complete(message)

    def nack(self, message: PgMessageProxy) -> None:
        self.broker.outcomes.fail(message, describe_error(message))

    def requeue(self, messages) -> None:
        """Give prefetched, unstarted messages back to the queue at once, uncharged."""
        proxies = [m for m in messages if isinstance(m, PgMessageProxy) and not m._settled]
        if not proxies:
            return
        try:
            released = self.store.release([p.attempt for p in proxies])
        finally:
            # Returned or not, this worker is done with them: one that could not be returned
            # is no longer renewed, so its lease expires and the reaper gives it back.
            for proxy in proxies:
                proxy._settled = True
                proxy._consumer._done(proxy)
        logger.info("Returned %d unstarted message(s) to queue %r.", len(released), self.queue_name)

    def _done(self, proxy: PgMessageProxy) -> None:
        """An outstanding message of this consumer is finished with: free its slot."""
        self.broker.leases.untrack(proxy.attempt)
        self._release_slot()

    def _release_slot(self) -> None:
        with self._lock:
            self._outstanding -= 1
        self._settled.set()

    def close(self) -> None:
        buffered = list(self._buffer)
        self._buffer.clear()
        try:
            if buffered:
                self.requeue(buffered)
        except BrokerConnectionError:
            logger.warning(
                "Could not return %d claimed message(s); their leases will expire.",
                len(buffered),
            )
        finally:
            if self._listen_conn is not None:
                try:
                    self._listen_conn.close()
                except Exception:  # pragma: no cover - closing a broken connection
                    pass
                self._listen_conn = None


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class OutcomeWriter:
    """Writes acks and nacks in batches from one thread per process.

    Worker threads only enqueue their outcome; the writer takes everything that is
    waiting, writes it as one ``complete_jobs`` and one ``fail_jobs`` statement, and
    repeats. If the database is unreachable it keeps the outcomes and retries with backoff;
    none is dropped.
    """

    def __init__(self, broker: PostgresBroker, max_batch: int = 1000) -> None:
        self.broker = broker
        self.store = broker.store
        self.max_batch = max_batch
        self._queue: queue.Queue[tuple[str, PgMessageProxy, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def complete(self, proxy: PgMessageProxy) -> None:
        self._submit("complete", proxy, None)

    def fail(self, proxy: PgMessageProxy, error: str) -> None:
        self._submit("fail", proxy, error)

    def _submit(self, kind: str, proxy: PgMessageProxy, error: Any) -> None:
        if proxy._settled:
            proxy._consumer._done(proxy)
            return
        self._ensure_thread()
        self._queue.put((kind, proxy, error))
        # The actor is done with the message, so its prefetch slot is free at once: the
        # consumer claims more while the outcome is being written, instead of waiting one
        # more round trip. The lease stays tracked (and renewed) until the write.
        proxy._consumer._release_slot()

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                if self._pid != os.getpid():
                    # A forked child must not write (or wait on) its parent's outcomes.
                    self._queue = queue.Queue()
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run, name="dramatiq-pg-outcomes", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(batch)
            except Exception:
                # Not a connection error (those are retried): these outcomes cannot be
                # written. Stop renewing their attempts, so that the leases expire and the
                # reaper runs the jobs again, and keep this thread alive for the others.
                logger.exception(
                    "Could not write %d outcome(s); their jobs run again once their leases expire.",
                    len(batch),
                )
                for _, proxy, _ in batch:
                    proxy._settled = True
                    self.broker.leases.untrack(proxy.attempt)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _write(self, batch: list[tuple[str, PgMessageProxy, Any]]) -> None:
        completed = [p.attempt for kind, p, _ in batch if kind == "complete"]
        failed = [(p.attempt, e) for kind, p, e in batch if kind == "fail"]
        # Each statement is retried on its own: one that committed is never sent again (a
        # second run would find its rows no longer running and report them as lost).
        owned = self._until_written(lambda: self.store.complete(completed))
        owned |= self._until_written(
            lambda: self.store.fail([a for a, _ in failed], [e for _, e in failed])
        )
        for _, proxy, _ in batch:
            if proxy.attempt.id not in owned:
                logger.warning(
                    "Lost job %s attempt %d before its outcome was written: its lease expired "
                    "and it was requeued or claimed again; this outcome is discarded.",
                    proxy.attempt.id,
                    proxy.attempt.attempt,
                )
            proxy._settled = True
            self.broker.leases.untrack(proxy.attempt)

    @staticmethod
    def _until_written(write) -> set[str]:
        """Run a write until the database takes it, backing off on connection errors."""
        delay = 0.2
        while True:
            try:
                return write()
            except BrokerConnectionError as e:
                logger.warning("Could not write outcomes, retrying in %.1fs: %s", delay, e)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted outcome is written. Returns False on timeout."""
        if self._thread is None or self._pid != os.getpid():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True
