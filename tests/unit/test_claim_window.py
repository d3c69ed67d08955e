"""The consumer's claim window, without a database: how big the window is after each
claim (:class:`ClaimWindow`)."""

from __future__ import annotations

from dramatiq_pg_broker.consumer import ClaimWindow
from dramatiq_pg_broker.inflight import Slots


def test_the_claim_window_grows_only_while_the_workers_run_dry_during_claims():
    slots = Slots(4)
    window = ClaimWindow(prefetch=4, growth=4, slots=slots)

    def after_claim(*, full=True, starved=True, seconds_later=0.005):
        # The last claim took 10 ms; the next one is due `seconds_later` after it returned.
        window.claimed(sent=99.990, returned=100.0, full=full, starved=starved)
        window.adapt(100.0 + seconds_later)

    assert window.size == 4
    after_claim()  # full, and everything handed over before it was done: threads idled
    assert window.size == 8 and slots.allowance == 8
    after_claim(starved=False)  # work was still in hand when it came back: enough
    assert window.size == 8
    after_claim()
    after_claim()
    assert window.size == 16, "the window grew past prefetch_growth times the prefetch"
    window.adapt(100.5)  # nothing new since the last claim: no second change
    assert window.size == 16
    after_claim(seconds_later=0.5)  # the next claim was due 50 claims' time later
    assert window.size == 8 and slots.allowance == 8
    after_claim(full=False)  # the queue ran dry
    assert window.size == 4


def test_the_first_claim_leaves_the_window_at_the_prefetch():
    window = ClaimWindow(prefetch=3, growth=4, slots=Slots(3))
    assert window.adapt(100.0) == 3
