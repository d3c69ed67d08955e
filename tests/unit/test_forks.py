"""forks.pid(): the process id without a system call, right in a forked child too."""

from __future__ import annotations

import os

from dramatiq_pg_broker import forks


def test_pid_is_this_processs_id_before_and_after_a_fork():
    assert forks.pid() == os.getpid()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.write(write, f"{forks.pid()} {os.getpid()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        seen, actual = pipe.read().split()
    os.waitpid(child, 0)
    assert seen == actual != str(os.getpid()), "the child still saw its parent's id"
    assert forks.pid() == os.getpid()
