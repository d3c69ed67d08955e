"""A consumer's subscription to its queue's channel on the process's LISTEN connection:
payloads in order, consecutive "look" payloads counted once, a wait that returns at the
next payload or after its timeout."""

from __future__ import annotations

import threading
import time

from dramatiq_pg_broker.db.listener import Subscription


class NoListener:
    def unsubscribe(self, subscription: Subscription) -> None:
        self.closed = subscription


def test_payloads_come_in_order_and_consecutive_looks_once():
    subscription = Subscription(NoListener(), "s.q")
    for payload in ["", "", "abort:1", "", "", "pause", ""]:
        subscription.deliver(payload)
    assert subscription.take() == ["", "abort:1", "", "pause", ""]
    assert subscription.take() == []
    subscription.deliver("")
    assert subscription.take() == [""], "a look after a take counts again"


def test_a_wait_returns_at_the_next_payload_or_after_its_timeout():
    subscription = Subscription(NoListener(), "s.q")
    started = time.monotonic()
    assert subscription.wait(0.05) == []
    assert time.monotonic() - started >= 0.04
    threading.Timer(0.05, subscription.deliver, ("",)).start()
    started = time.monotonic()
    assert subscription.wait(5) == [""]
    assert time.monotonic() - started < 2, "the payload woke the wait"
    # A payload that arrived before the wait is returned at once.
    subscription.deliver("pause")
    assert subscription.wait(5) == ["pause"]


def test_closing_unsubscribes():
    listener = NoListener()
    subscription = Subscription(listener, "s.q")
    subscription.close()
    assert listener.closed is subscription
