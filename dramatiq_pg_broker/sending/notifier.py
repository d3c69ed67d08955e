"""Waking idle workers after the broker's own sends, from a thread of the process, never
in the send's commit.

Why not in the send's statement: PostgreSQL serializes the commits of every transaction
that sent a NOTIFY (one database-wide lock, taken at commit and held through the commit's
WAL flush). A send that notifies in its own statement makes every concurrent send's commit
wait for the others' flushes; measured on two cores, 32 connections committing one small
insert each: 0.40x the rate without ``pg_notify``. The broker's own sends (through its
pool, autocommit or a transaction of its own) therefore commit without notifying and tell
the process's :class:`Notifier` which queues they filled. Its thread sends one short
statement (``wake_queues``: one ``pg_notify`` per queue owed) on a pooled connection, in a
transaction that writes nothing else and does not wait for the WAL flush (the wake-up
follows the send's own flush at once): the lock is then taken by the notifiers' commits
alone, for moments, never by a send's:

- **Leading edge at once**: a send to a quiet process is notified as soon as the thread
  runs, one round trip after the send's commit (an idle worker's wake-up).
- **Then at most one statement every** :data:`INTERVAL` **per process**, naming every queue
  owed meanwhile: a burst of N sends becomes a handful of notifications, and a busy
  deployment sends a few hundred notifying commits a second whatever its send rate.
  Consumers that are busy claim again without waiting for a notification; an idle one
  needs one wake-up, not one per job.

A send inside the application's transaction (``broker.transaction(conn)``, SQLAlchemy,
Django's ``atomic()``) still notifies in its own statement: the NOTIFY is then delivered
by that transaction's commit, never before the job is visible, and never for a rollback,
which no thread of the broker could know of. A job delayed by at least the poll interval
is not notified at all: every idle consumer looks at its queue within its poll interval
and learns then when the job becomes due (``notify_sends`` = ``statement`` restores a
NOTIFY in every send's statement, ``off`` sends none).

What can be lost, and what covers it. A statement that fails (the database went away
after the send committed) keeps its queues owed and is tried again with backoff; a
process that exits flushes what it owes (:meth:`Notifier.stop` at ``broker.close()``,
and at interpreter exit for a process that never closes its broker), within
:data:`EXIT_FLUSH_SECONDS`. Whatever is still lost (a process killed right after a send)
costs a job at most one poll interval (``poll_interval``, 1 s by default): every idle
consumer looks at its queue that often, and a consumer whose LISTEN connection comes back
after an outage looks at once. A forked child owes nothing of its parent's (the thread and
its state are per process, see :mod:`~..service`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from ..service import Service

logger = logging.getLogger("dramatiq_pg_broker.sending")

#: Seconds between two notifying statements of one process: the first queue owed after a
#: quiet moment is notified at once, the ones owed while a statement runs or within this
#: interval after it wait for the next statement. Measured with 4 processes x 8 threads
#: sending (docs/benchmarks.md): a few hundred notifying commits a second in all, which do
#: not hold up the sends' commits.
INTERVAL = 0.005

#: Seconds a closing broker, or an exiting process, waits for its owed notifications.
EXIT_FLUSH_SECONDS = 2.0

#: Longest pause between two tries of a notification that failed (the database is away).
RETRY_CAP_SECONDS = 2.0


class Notifier(Service):
    """One process's wake-ups of the queues its sends filled. See the module docstring.

    Parameters:
      wake(callable): ``wake(queue_names)`` notifies those queues' consumers now
        (:meth:`JobStore.wake_queues <dramatiq_pg_broker.jobs.JobStore.wake_queues>`).
      interval(float): seconds between two of its statements (:data:`INTERVAL`).
    """

    thread_name = "dramatiq-pg-notifier"

    def __init__(self, wake: Callable[[set[str]], None], interval: float = INTERVAL) -> None:
        super().__init__()
        self._wake = wake
        self.interval = interval
        self.reset()
        atexit.register(_flush_at_exit, weakref.ref(self))

    def reset(self) -> None:
        # A forked child owes nothing of its parent's, and must not wait on its lock.
        self._cond = threading.Condition()
        self._owed: set[str] = set()
        #: No statement before this time (monotonic): the interval, or a retry's backoff.
        self._not_before = 0.0
        self._sending = False
        #: Whether the thread waits for something to be owed (only then does owe() wake
        #: it: during a statement or an interval it finds what was owed when it is done,
        #: and a wake-up per send would cost each sending process a thread switch).
        self._idle = False
        #: Threads in :meth:`flush`: while any waits, what is owed goes at once (a flag the
        #: thread reads, not a deadline: a statement ending meanwhile sets the deadline).
        self._flushing = 0
        #: Statements sent by this process (tests and benchmarks read it).
        self.statements = 0

    def owe(self, queue_names: Iterable[str]) -> None:
        """Have the consumers of ``queue_names`` woken, soon (see the module docstring).
        Called once the sends to them committed; never blocks on the database."""
        self.start()  # first: in a forked child, this resets what the parent owed
        with self._cond:
            self._owed.update(queue_names)
            if self._idle:
                self._cond.notify_all()

    def flush(self, timeout: float = EXIT_FLUSH_SECONDS) -> bool:
        """Send what is owed now, without waiting for the interval; True once nothing is
        owed, False if that took longer than ``timeout`` seconds (the database is away)."""
        if not self.started:
            return True  # nothing was owed in this process (owe() starts the thread)
        end = time.monotonic() + timeout
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._owed or self._sending:
                    left = end - time.monotonic()
                    if left <= 0 or not self.started:
                        return False
                    self._cond.wait(left)
            finally:
                self._flushing -= 1
        return True

    def stop(self, timeout: float | None = EXIT_FLUSH_SECONDS) -> None:
        """Send what is owed, then stop the thread: both within ``timeout`` seconds (a
        statement the database never answers is left to the daemon thread)."""
        limit = EXIT_FLUSH_SECONDS if timeout is None else timeout
        end = time.monotonic() + limit
        if self.started:
            self.flush(limit)
        super().stop(max(0.0, end - time.monotonic()))

    def wake(self) -> None:
        if not self._process.here:
            # No thread of this process to wake (a forked child that sent nothing): the
            # lock is still the parent's, which a thread of the parent may have held at
            # the fork, and no thread of this process would ever release.
            return
        with self._cond:
            self._cond.notify_all()

    def run(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while True:
                    if self.stopping.is_set() and (not self._owed or failures):
                        return
                    if self._owed:
                        wait = self._not_before - time.monotonic()
                        # A flush or a stop sends at once, unless a failure's backoff runs.
                        hurry = self._flushing or self.stopping.is_set()
                        if wait <= 0 or (hurry and not failures):
                            break
                        self._cond.wait(wait)
                    else:
                        self._idle = True
                        self._cond.wait()
                        self._idle = False
                owed, self._owed = self._owed, set()
                self._sending = True
            pause = self.interval
            try:
                self._wake(owed)
                failures = 0
            except Exception as e:  # the database is away: owed again, tried later
                failures += 1
                pause = min(RETRY_CAP_SECONDS, 0.05 * 2 ** (failures - 1))
                # The outage itself is told once per process (outage.py).
                logger.debug("Waking queues %s failed (%s); trying again in %.2fs.", owed, e, pause)
                with self._cond:
                    self._owed |= owed
            with self._cond:
                self.statements += 1 if not failures else 0
                self._sending = False
                self._not_before = time.monotonic() + pause
                self._cond.notify_all()


def _flush_at_exit(ref: weakref.ref[Notifier]) -> None:
    """At interpreter exit (before daemon threads die): send what this process owes."""
    notifier = ref()
    if notifier is not None and notifier.started:
        notifier.stop(EXIT_FLUSH_SECONDS)
