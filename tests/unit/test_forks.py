"""forks.pid(): the process id without a system call, right in a forked child too; state that
belongs to one process (forks.PerProcess) and the start/stop base of background threads
(service.Service), each fresh in a forked child."""

from __future__ import annotations

import os
import threading

from dramatiq_pg_broker import forks, service


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


def in_child(fn) -> str:
    """``fn()`` run in a forked child; what it returned, as text."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.write(write, str(fn()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = pipe.read()
    os.waitpid(child, 0)
    return out


def test_a_per_process_value_is_built_once_per_process_and_afresh_in_a_child():
    built = []

    def build():
        built.append(os.getpid())
        return len(built)

    value = forks.PerProcess(build)
    assert not value.here and value.peek() is None
    assert value.get() == value.get() == 1 and built == [os.getpid()]
    assert in_child(lambda: (value.peek(), value.get(), value.get())) == "(None, 2, 2)"
    assert value.get() == 1, "the child's value leaked into the parent"


def test_a_value_given_belongs_to_the_creating_process_only():
    value = forks.PerProcess(lambda: "child's", "parent's")
    assert value.here and value.get() == "parent's"
    assert in_child(value.get) == "child's"
    assert value.clear() == "parent's" and value.peek() is None
    assert value.get() == "child's", "after clear(), the next get() builds"


class Ticker(service.Service):
    thread_name = "test-ticker"

    def __init__(self):
        super().__init__()
        self.ticks = 0
        self.resets = 0
        self._wake = threading.Event()

    def run(self):
        while not self.stopping.is_set():
            self.ticks += 1
            self._wake.wait(10)
            self._wake.clear()

    def wake(self):
        self._wake.set()

    def reset(self):
        self.resets += 1
        self.ticks = 0


def test_a_service_starts_once_stops_and_starts_again():
    ticker = Ticker()
    assert not ticker.started
    assert ticker.start() is True
    assert ticker.start() is False, "a second start while it runs"
    assert ticker.started
    ticker.stop(timeout=5)
    assert not ticker.started, "stop() returned before the thread ended"
    ticker.stop(timeout=5)  # idempotent
    assert ticker.start() is True, "a stopped service starts again"
    ticker.stop(timeout=5)
    assert ticker.resets == 0, "the creating process keeps its state"


def test_a_forked_child_starts_its_own_thread_from_a_reset_state():
    ticker = Ticker()
    ticker.start()
    try:

        def child():
            before = ticker.started
            started = ticker.start()
            running = ticker.started
            ticker.stop(timeout=5)
            return (before, started, running, ticker.resets, ticker.started)

        assert in_child(child) == "(False, True, True, 1, False)"
        assert ticker.started and ticker.resets == 0, "the child's start touched the parent"
    finally:
        ticker.stop(timeout=5)
