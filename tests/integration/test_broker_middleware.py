"""The broker's middleware list: Dramatiq's order (AgeLimit first, so middleware can be
placed around it as with any Dramatiq broker), CurrentMessage among the defaults, and a
failed attempt never recorded as a success, with or without a Retries middleware."""

from __future__ import annotations

import threading
import warnings

import dramatiq
from dramatiq.middleware import AgeLimit, CurrentMessage, Middleware, TimeLimit

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
