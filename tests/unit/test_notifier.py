"""The send path's notifier (sending/notifier.py) with a recording stand-in for the
database's statement: the leading edge at once, what is owed meanwhile in one statement,
at most one statement per interval, failures owed again, a flush, a stop, a forked child."""

from __future__ import annotations

import threading
import time

from dramatiq_pg_broker.sending.notifier import Notifier

from .test_forks import in_child, on_child_main_thread


class Recorder:
    """``wake(queues)``: records each call with its time; can be held, or made to fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, set[str]]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.failures = 0

    def __call__(self, queues: set[str]) -> None:
        self.entered.set()
        assert self.hold.wait(10), "held for too long"
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the database is away")
        self.calls.append((time.monotonic(), set(queues)))

    def queues(self) -> list[set[str]]:
        return [queues for _, queues in self.calls]


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.002)


def test_the_first_queue_owed_is_woken_at_once():
    wake = Recorder()
    notifier = Notifier(wake, interval=60.0)
    try:
        started = time.monotonic()
        notifier.owe({"a"})
        wait_until(lambda: wake.calls)
        assert wake.queues() == [{"a"}]
        assert wake.calls[0][0] - started < 1.0, "the leading edge waited"
    finally:
        notifier.stop()


def test_what_is_owed_while_a_statement_runs_goes_in_the_next_one():
    wake = Recorder()
    notifier = Notifier(wake, interval=0.0)
    try:
        wake.hold.clear()
        notifier.owe({"a"})
        assert wake.entered.wait(5)
        for name in ("b", "c", "b", "d"):
            notifier.owe({name})
        wake.hold.set()
        wait_until(lambda: len(wake.calls) == 2)
        assert wake.queues() == [{"a"}, {"b", "c", "d"}]
        assert notifier.statements == 2
    finally:
        notifier.stop()


def test_at_most_one_statement_per_interval_and_a_flush_sends_at_once():
    wake = Recorder()
    notifier = Notifier(wake, interval=0.3)
    try:
        notifier.owe({"a"})
        wait_until(lambda: wake.calls)
        notifier.owe({"b"})
        wait_until(lambda: len(wake.calls) == 2)
        gap = wake.calls[1][0] - wake.calls[0][0]
        assert gap >= 0.29, f"a second statement {gap:.3f}s after the first"
        notifier.interval = 60.0
        notifier.owe({"c"})
        time.sleep(0.05)
        assert len(wake.calls) == 2, "sent within the interval"
        started = time.monotonic()
        assert notifier.flush(5)
        assert wake.queues()[-1] == {"c"} and time.monotonic() - started < 1.0
    finally:
        notifier.stop()


def test_a_failed_statement_keeps_its_queues_owed_and_is_tried_again():
    wake = Recorder()
    wake.failures = 2
    notifier = Notifier(wake, interval=0.0)
    try:
        notifier.owe({"a"})
        wait_until(lambda: wake.calls)
        assert wake.queues() == [{"a"}]
        assert wake.failures == 0 and notifier.statements == 1
    finally:
        notifier.stop()


def test_stop_sends_what_is_owed_first():
    wake = Recorder()
    notifier = Notifier(wake, interval=60.0)
    notifier.owe({"a"})
    wait_until(lambda: wake.calls)
    notifier.owe({"b"})
    notifier.stop()
    assert wake.queues() == [{"a"}, {"b"}]
    assert not notifier.started


def test_a_flush_with_nothing_owed_or_no_thread_returns_at_once():
    notifier = Notifier(Recorder())
    assert notifier.flush(0.01), "nothing owed in this process"
    notifier.stop()


def test_a_forked_child_owes_nothing_of_its_parents_and_has_its_own_thread():
    wake = Recorder()
    notifier = Notifier(wake, interval=60.0)
    try:
        notifier.owe({"a"})
        wait_until(lambda: wake.calls)
        notifier.owe({"owed-by-the-parent"})

        def child():
            notifier.owe({"child"})
            wait_until(lambda: len(wake.calls) == 2)
            return wake.queues()[-1]

        assert in_child(child) == str({"child"})
        assert notifier.flush(5)
        assert wake.queues() == [{"a"}, {"owed-by-the-parent"}], "the child's leaked here"
    finally:
        notifier.stop()


def test_a_flush_during_a_statement_is_not_held_up_by_the_interval_that_statement_sets():
    wake = Recorder()
    notifier = Notifier(wake, interval=60.0)
    try:
        wake.hold.clear()
        notifier.owe({"a"})
        assert wake.entered.wait(5)
        notifier.owe({"b"})  # owed while "a" is written; the next statement is 60 s after
        flushed: list[bool] = []
        flusher = threading.Thread(target=lambda: flushed.append(notifier.flush(5)))
        flusher.start()
        time.sleep(0.05)  # the flush waits for the statement in flight
        wake.hold.set()
        flusher.join(10)
        assert flushed == [True], "the flush waited for the interval"
        assert wake.queues() == [{"a"}, {"b"}]
    finally:
        notifier.stop()


def test_a_forked_child_stops_a_notifier_whose_lock_a_parent_thread_held_at_the_fork():
    """A thread of the parent in owe() (a send) holds the notifier's lock at the moment
    of a fork: the child has no thread to wake, and its broker.close() must not wait for
    a lock that no thread of the child will release."""
    notifier = Notifier(Recorder(), interval=60.0)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with notifier._cond:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    try:
        notifier.owe({"a"})
        holder.start()
        assert held.wait(5)

        def child():
            notifier.stop(1.0)  # as broker.close() runs it, on the child's main thread
            return "stopped"

        assert on_child_main_thread(child) == "stopped"
    finally:
        release.set()
        holder.join(10)
        notifier.stop()


def test_stop_returns_within_its_timeout_when_a_statement_never_ends():
    """A statement stuck on the database (a connection that hangs): stop(timeout) waits
    for the flush and for the thread together at most ``timeout``, not twice that (an
    exiting process waits for it, see EXIT_FLUSH_SECONDS)."""
    wake = Recorder()
    notifier = Notifier(wake, interval=0.0)
    try:
        wake.hold.clear()
        notifier.owe({"a"})
        assert wake.entered.wait(5)
        notifier.owe({"b"})
        started = time.monotonic()
        notifier.stop(0.5)
        took = time.monotonic() - started
        assert 0.45 <= took < 0.8, f"stop(0.5) took {took:.2f}s"
    finally:
        wake.hold.set()
        notifier.stop()
