"""The broker's middleware list: Dramatiq's order (AgeLimit first, so middleware can be
placed around it as with any Dramatiq broker), CurrentMessage among the defaults, an
application's instance of a default kind replacing the default (one CurrentMessage, no
warning; one Retries, one Callbacks), and a failed attempt never recorded as a success,
with or without a Retries middleware."""

from __future__ import annotations

import logging
import threading
import warnings

import dramatiq
import pytest
from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    CurrentMessage,
    Middleware,
    Pipelines,
    ShutdownNotifications,
    TimeLimit,
)
from dramatiq.middleware import Retries as StockRetries

from dramatiq_pg_broker import Retries as PgRetries
from dramatiq_pg_broker.current import JobContext

from ..helpers import wait_for


class Marker(Middleware):
    """A middleware that does nothing: only its place in the list matters."""


def test_a_middleware_added_before_age_limit_comes_first(h):
    broker = h.broker()
    marker = Marker()
    broker.add_middleware(marker, before=AgeLimit)
    assert broker.middleware[0] is marker, [type(m).__name__ for m in broker.middleware]
    assert isinstance(broker.middleware[1], AgeLimit)


def test_a_middleware_added_after_age_limit_comes_second(h):
    broker = h.broker()
    marker = Marker()
    broker.add_middleware(marker, after=AgeLimit)
    assert broker.middleware[1] is marker, [type(m).__name__ for m in broker.middleware]
    # The broker's own job context follows, still before every middleware that sees a
    # message start.
    names = [type(m) for m in broker.middleware]
    assert names.index(JobContext) == 2
    assert names.index(JobContext) < names.index(TimeLimit)


def test_the_default_list_is_dramatiqs_with_the_job_context_after_age_limit(h):
    broker = h.broker()
    kinds = [type(m) for m in broker.middleware]
    assert kinds[:2] == [AgeLimit, JobContext], kinds
    expected = [
        PgRetries if m is dramatiq.middleware.Retries else m
        for m in dramatiq.middleware.default_middleware
    ]
    others = [k for k in kinds if k is not JobContext]
    assert others[: len(expected)] == expected, others
    assert CurrentMessage in kinds


def test_a_list_without_age_limit_gets_the_job_context_first(h):
    broker = h.broker(middleware=[TimeLimit(), Marker()])
    kinds = [type(m) for m in broker.middleware]
    assert kinds[:3] == [JobContext, TimeLimit, Marker], kinds
    assert CurrentMessage not in kinds, "a list given is kept as it is"


def test_current_message_works_in_an_actor_under_the_default_middleware(h, queue):
    broker = h.broker()
    seen: list = []

    @dramatiq.actor(broker=broker, queue_name=queue)
    def which():
        message = CurrentMessage.get_current_message()
        seen.append(None if message is None else message.message_id)

    sent = which.send()
    h.start(broker, threads=1)
    broker.join(queue, timeout=20_000)
    assert seen == [sent.message_id], "CurrentMessage.get_current_message() in the actor"
    assert broker.store.get(sent.message_id)["status"] == "succeeded"


def test_the_current_job_s_broker_is_deprecated_and_still_the_actor_s(h, queue):
    """``current_job().broker`` (0.1.0's attribute) warns and returns the running broker."""
    from dramatiq_pg_broker import current_job

    broker = h.broker()
    seen: list = []

    @dramatiq.actor(broker=broker, queue_name=queue)
    def which():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seen.append(current_job().broker)
        seen.append([w.category for w in caught])

    sent = which.send()
    h.start(broker, threads=1)
    broker.join(queue, timeout=20_000)
    assert broker.store.get(sent.message_id)["status"] == "succeeded"
    assert seen == [broker, [DeprecationWarning]]


def test_an_actor_that_raised_is_failed_without_a_retries_middleware(h, queue):
    # Dramatiq acks a message whose actor raised when no Retries middleware is installed;
    # the job must still end failed, with its error, never succeeded.
    broker = h.broker(middleware=[AgeLimit(), TimeLimit()])
    ran = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=queue)
    def broken():
        ran.set()
        raise ValueError("no retries here")

    sent = broken.send()
    h.start(broker, threads=1)
    wait_for(ran.is_set, 20, "the actor ran")
    broker.join(queue, timeout=20_000)
    assert broker.outcomes.flush(timeout=10)
    row = broker.store.get(sent.message_id)
    assert (row["status"], row["last_error"]) == ("failed", "ValueError: no retries here")
    assert (row["attempts"], row["failures"]) == (1, 1)


# -- an application's middleware of a kind the broker installed by default ------------------

TWICE = "You're adding a middleware of the same type twice"


def twice_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if TWICE in r.getMessage()]


def test_an_app_that_adds_current_message_keeps_one_and_no_warning(h, queue, caplog):
    caplog.set_level(logging.WARNING)
    broker = h.broker()
    before = [type(m) for m in broker.middleware]
    mine = CurrentMessage()
    broker.add_middleware(mine)  # what Dramatiq 2's docs tell applications to do
    assert twice_warnings(caplog) == []
    kinds = [type(m) for m in broker.middleware]
    assert kinds == before, "the app's CurrentMessage took the default's place"
    assert [m for m in broker.middleware if isinstance(m, CurrentMessage)] == [mine]

    seen: list = []

    @dramatiq.actor(broker=broker, queue_name=queue)
    def which():
        seen.append(CurrentMessage.get_current_message().message_id)

    sent = which.send()
    h.start(broker, threads=1)
    broker.join(queue, timeout=20_000)
    assert seen == [sent.message_id]


@pytest.mark.parametrize(
    "make",
    [
        lambda: AgeLimit(max_age=60_000),
        lambda: TimeLimit(time_limit=120_000),
        ShutdownNotifications,
        Callbacks,
        Pipelines,
        lambda: StockRetries(max_retries=1),
        lambda: PgRetries(max_retries=1),
    ],
    ids=[
        "AgeLimit",
        "TimeLimit",
        "ShutdownNotifications",
        "Callbacks",
        "Pipelines",
        "Retries",
        "PgRetries",
    ],
)
def test_an_app_instance_of_a_default_kind_replaces_the_default_in_place(h, caplog, make):
    caplog.set_level(logging.WARNING)
    broker = h.broker()
    mine = make()
    kind = next(k for k in dramatiq.middleware.default_middleware if isinstance(mine, k))
    place = next(i for i, m in enumerate(broker.middleware) if isinstance(m, kind))
    broker.add_middleware(mine)
    assert twice_warnings(caplog) == []
    assert [m for m in broker.middleware if isinstance(m, kind)] == [mine]
    assert broker.middleware[place] is mine, [type(m).__name__ for m in broker.middleware]


def test_an_app_retries_retries_each_failure_once_with_its_settings(h, queue, caplog):
    caplog.set_level(logging.WARNING)
    broker = h.broker()
    broker.add_middleware(StockRetries(max_retries=2, min_backoff=10, max_backoff=20))
    assert twice_warnings(caplog) == []

    @dramatiq.actor(broker=broker, queue_name=queue)
    def hopeless():
        h.record("hopeless")
        raise RuntimeError("never")

    sent = hopeless.send()
    h.start(broker, threads=2)
    broker.join(queue, timeout=30_000)
    row = broker.store.get(sent.message_id)
    assert (row["status"], row["attempts"], row["failures"]) == ("failed", 3, 3), row
    assert h.ran("hopeless") == 3


def test_an_app_callbacks_sends_each_callback_once(h, queue):
    broker = h.broker()
    broker.add_middleware(Callbacks())

    @dramatiq.actor(broker=broker, queue_name=queue)
    def done(message_data, result):
        h.record("callback", message_data["message_id"])

    @dramatiq.actor(broker=broker, queue_name=queue)
    def work():
        return 1

    sent = work.send_with_options(on_success=done)
    h.start(broker, threads=2)
    wait_for(lambda: h.ran("callback", sent.message_id), 20, "the on_success callback")
    broker.join(queue, timeout=20_000)
    assert h.ran("callback", sent.message_id) == 1, h.runs


def test_a_position_given_with_the_replacement_is_honoured(h):
    broker = h.broker()
    mine = CurrentMessage()
    broker.add_middleware(mine, before=AgeLimit)
    assert broker.middleware[0] is mine
    assert sum(isinstance(m, CurrentMessage) for m in broker.middleware) == 1


def test_a_second_instance_the_app_itself_added_still_warns(h, caplog):
    """Only the broker's defaults are replaced: two instances the application added (a
    list it passed, then add_middleware, or add_middleware twice) are Dramatiq's business."""
    caplog.set_level(logging.WARNING)
    broker = h.broker(middleware=[AgeLimit(), CurrentMessage()])
    broker.add_middleware(CurrentMessage())
    assert sum(isinstance(m, CurrentMessage) for m in broker.middleware) == 2
    broker.add_middleware(Marker())
    broker.add_middleware(Marker())
    assert len(twice_warnings(caplog)) == 2, twice_warnings(caplog)
    # And a replacement happens once: the app's own second one is a duplicate.
    defaults = h.broker()
    defaults.add_middleware(CurrentMessage())
    defaults.add_middleware(CurrentMessage())
    assert sum(isinstance(m, CurrentMessage) for m in defaults.middleware) == 2
