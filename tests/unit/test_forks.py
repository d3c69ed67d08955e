"""forks.pid(): the process id without a system call, right in a forked child too; state that
belongs to one process (forks.PerProcess) and the start/stop base of background threads
(service.Service), each fresh in a forked child."""

from __future__ import annotations

import os
import signal
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


def on_child_main_thread(fn, seconds: float = 5.0) -> str:
    """``fn()`` in a forked child, on its main thread, as "hung" if it has not returned
    within ``seconds`` (a lock's wait is interrupted by the signal; a new thread of the
    child could get the id of a parent's thread, which a lock would take for its owner)."""

    def child():
        def too_long(*_):
            raise TimeoutError

        signal.signal(signal.SIGALRM, too_long)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn()
        except TimeoutError:
            return "hung"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    return in_child(child)


def test_a_child_forked_while_a_parent_thread_builds_a_value_builds_its_own():
    """The dramatiq CLI forks after importing the app: a thread of the parent may be
    opening its pool (PerProcess's lock held) at that moment. The child's first use must
    not wait for a lock no thread of the child will release."""
    building, release = threading.Event(), threading.Event()

    def build():
        if forks.pid() != parent:
            return "child's"
        building.set()
        release.wait(10)
        return "parent's"

    parent = forks.pid()
    value = forks.PerProcess(build)
    builder = threading.Thread(target=value.get)
    builder.start()
    try:
        assert building.wait(5)
        assert on_child_main_thread(value.get) == "child's"
    finally:
        release.set()
        builder.join(10)
    assert value.get() == "parent's"


def test_a_child_forked_while_a_parent_thread_starts_a_service_starts_its_own():
    ticker = Ticker()
    held, release = threading.Event(), threading.Event()

    def hold():
        with ticker._start_lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)

        def child():
            started = ticker.start()
            ticker.stop(timeout=5)
            return started

        assert on_child_main_thread(child) == "True"
    finally:
        release.set()
        holder.join(10)
