"""This process's id, read without a system call, and state that belongs to one process.

Objects that must never carry a parent's threads, connections or attempts into a forked
child (the ``dramatiq`` CLI forks its worker processes after importing the broker) check
the process id on every use, and the busiest of them on every claimed message, start and
outcome. ``os.getpid()`` is a system call each time (glibc stopped caching it), made with
the GIL held; :func:`pid` returns the id this module read at import and reads again in a
child right after ``fork()`` (``os.register_at_fork``: every fork made through Python,
``os.fork`` and ``multiprocessing`` included, runs it in the child).

:class:`PerProcess` is that check, written once: the connection pool, the in-flight
ledger, the send path's group commit and every background thread (:mod:`.service`) keep
their per-process state in one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_pid = os.getpid()

#: Guards the replacement of a :class:`ProcessLock`'s lock in a new process; itself made
#: anew in every child, so never held there.
_guard = threading.Lock()


def _after_fork_in_child() -> None:
    global _pid, _guard
    _pid = os.getpid()
    _guard = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def pid() -> int:
    """This process's id (as ``os.getpid()``, without the system call)."""
    return _pid


_UNSET: Any = object()


class ProcessLock:
    """A lock that a forked child gets anew, released. A plain ``threading.Lock`` is copied
    into the child as it was: held, if a thread of the parent held it at the moment of the
    fork (opening the pool, starting a thread), and no thread of the child would ever
    release it. Used as a context manager, as a lock."""

    __slots__ = ("_lock", "_pid")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = _pid

    def _here(self) -> threading.Lock:
        if self._pid != _pid:
            with _guard:
                if self._pid != _pid:
                    self._lock = threading.Lock()
                    self._pid = _pid
        return self._lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._here().acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._here().acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class PerProcess(Generic[T]):
    """A value that belongs to one process: ``build()`` makes it on first use in each
    process, so a forked child builds its own instead of using its parent's.

    Parameters:
      build(callable): makes the value for the calling process (called with a lock held,
        once per process, and again after :meth:`clear`).
      value: a value already built for the creating process (None is a value); left out,
        the creating process builds its own on first use too.
    """

    __slots__ = ("_build", "_lock", "_pid", "_value")

    def __init__(self, build: Callable[[], T], value: T = _UNSET) -> None:
        self._build = build
        self._lock = ProcessLock()
        self._value: T | None = None if value is _UNSET else value
        self._pid: int | None = None if value is _UNSET else _pid

    def get(self) -> T:
        """This process's value, built now if it has none."""
        if self._pid == _pid:
            return self._value  # type: ignore[return-value]
        with self._lock:
            if self._pid != _pid:
                # The value before the process id: a thread that sees this process's id
                # also sees its value.
                self._value = self._build()
                self._pid = _pid
            return self._value  # type: ignore[return-value]

    @property
    def here(self) -> bool:
        """Whether this process has its value (built, and not cleared since)."""
        return self._pid == _pid

    def peek(self) -> T | None:
        """This process's value, or None if it has none: never builds."""
        return self._value if self._pid == _pid else None

    def clear(self) -> T | None:
        """Forget this process's value (the next :meth:`get` builds a new one). Returns
        it, for the caller to close; None if this process had none."""
        with self._lock:
            value = self.peek()
            self._pid = None
            self._value = None
            return value
