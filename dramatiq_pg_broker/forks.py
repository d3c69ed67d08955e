"""This process's id, read without a system call.

Objects that must never carry a parent's threads, connections or attempts into a forked
child (the ``dramatiq`` CLI forks its worker processes after importing the broker) check
the process id on every use, and the busiest of them on every claimed message, start and
outcome. ``os.getpid()`` is a system call each time (glibc stopped caching it), made with
the GIL held; :func:`pid` returns the id this module read at import and reads again in a
child right after ``fork()`` (``os.register_at_fork``: every fork made through Python,
``os.fork`` and ``multiprocessing`` included, runs it in the child).
"""

from __future__ import annotations

import os

_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def pid() -> int:
    """This process's id (as ``os.getpid()``, without the system call)."""
    return _pid
