"""One start/stop contract for the background threads of a process.

The outcome writer (:mod:`.outcomes`), the heartbeat and reaper (:mod:`.leases`) and the
LISTEN connection of result and rate-limit waiters (:mod:`.listener`) each run one daemon
thread per process. They start it the same way, stop it the same way, and never let a
forked child use its parent's: the ``dramatiq`` CLI forks its workers after importing the
broker, and a parent's thread does not exist in the child. River's ``startstop`` package
(every service has ``Start``, ``Stop`` and ``Started``) is the model.
"""

from __future__ import annotations

import threading

from . import forks


class Service:
    """A background thread of this process.

    - :meth:`start` starts the thread unless it runs in this process already. It is
      idempotent and thread-safe, and starts the thread again after it stopped or died.
      The first start in a forked child calls :meth:`reset` first: the child inherits
      none of its parent's state (queued outcomes, timers, a stop request).
    - :meth:`stop` asks the thread to end (:attr:`stopping` is set and :meth:`wake`
      interrupts its wait) and waits for it; idempotent, and a no-op in a process where
      the thread does not run.
    - :attr:`started` tells whether the thread runs in this process.

    A subclass names its thread (:attr:`thread_name`) and implements :meth:`run`, which
    returns once :attr:`stopping` is set.
    """

    #: The thread's name, as ``ps -T`` and thread dumps show it.
    thread_name = "dramatiq-pg-service"

    def __init__(self) -> None:
        #: Set by :meth:`stop`; :meth:`run` returns once it is.
        self.stopping = threading.Event()
        #: A forked child's is its own (a parent's thread may hold it at the fork).
        self._start_lock = forks.ProcessLock()
        self._thread: threading.Thread | None = None
        self._process = forks.PerProcess(self._enter_process, value=None)

    @property
    def started(self) -> bool:
        """Whether the thread runs in this process."""
        thread = self._thread
        return thread is not None and self._process.here and thread.is_alive()

    def start(self) -> bool:
        """Start the thread unless it runs in this process. Returns True if this call
        started it."""
        if self.started:
            return False
        with self._start_lock:
            self._process.get()  # in a new process: forget the parent's thread and state
            if self.started:
                return False
            self.stopping.clear()
            self._thread = threading.Thread(target=self.run, name=self.thread_name, daemon=True)
            self._thread.start()
            return True

    def stop(self, timeout: float | None = 5.0) -> None:
        """Ask the thread to end and wait up to ``timeout`` seconds for it."""
        self.stopping.set()
        self.wake()
        thread = self._thread
        if self.started and thread is not threading.current_thread():
            thread.join(timeout)  # type: ignore[union-attr]

    def _enter_process(self) -> None:
        self._thread = None
        self.stopping = threading.Event()
        self.reset()

    # -- for subclasses --------------------------------------------------------------------

    def run(self) -> None:
        """The thread's work: a loop that returns once :attr:`stopping` is set."""
        raise NotImplementedError

    def wake(self) -> None:
        """Interrupt the thread's wait, so that it sees :attr:`stopping` at once."""

    def reset(self) -> None:
        """Build afresh the state a forked child must not inherit from its parent."""
