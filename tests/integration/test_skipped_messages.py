"""A message a middleware skips before its actor runs ends ``cancelled``, never
``succeeded``, with a ``cancelled`` event saying who skipped it and why: dramatiq-abort's
cancel of a queued or delayed job, any middleware's ``SkipMessage``. A skip that failed the
message (the age limit, a middleware calling ``message.fail()``) stays a failure, naming
the middleware. A results backend holds what Dramatiq stores on every broker, None, and
the job already reads ``cancelled`` when that None can be read."""

from __future__ import annotations

import threading
import time

import dramatiq
import pytest
from dramatiq.middleware import Middleware, SkipMessage
from dramatiq.results import Results
from dramatiq_abort import Abortable, abort
from dramatiq_abort.middleware import AbortMode

from dramatiq_pg_broker.backends.abort import PostgresEventBackend
from dramatiq_pg_broker.results import PostgresBackend

from .harness import Harness

pytestmark = pytest.mark.timeout(120)

ABORTABLE = "dramatiq_abort.middleware.Abortable"
AGE_LIMIT = "dramatiq.middleware.age_limit.AgeLimit"


class NotToday(Middleware):
    """Skips every message of the actor named ``skipped``, without failing it."""

    def before_process_message(self, broker, message):
        if message.actor_name == "skipped":
            raise SkipMessage("not today")


class FailAndSkip(Middleware):
    """Fails and skips every message of the actor named ``skipped``."""

    def before_process_message(self, broker, message):
        if message.actor_name == "skipped":
            message.fail()
            raise SkipMessage("refused")


def finished(broker, h, message) -> dict:
    broker.join(h.queue, timeout=30_000)
    return broker.store.get(message.message_id)


def of_type(broker, message, kind: str) -> list[dict]:
    return [e for e in broker.store.events_of(message.message_id) if e["type"] == kind]


def abortable_broker(h: Harness):
    broker = h.broker()
    broker.add_middleware(Abortable(backend=PostgresEventBackend(broker=broker)))
    return broker


def test_an_abort_cancel_of_a_queued_job_ends_it_cancelled(h, pg_url, schema):
    broker = abortable_broker(h)
    backend = PostgresBackend(url=pg_url, schema=schema)
    broker.add_middleware(Results(backend=backend))
    busy, release = threading.Event(), threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def blocker():
        busy.set()
        release.wait(30)

    work = h.recorder(broker, max_retries=0, store_results=True)
    h.start(broker, threads=1)
    blocker.send()
    assert busy.wait(30), "the blocker did not start"
    # Queued behind the busy worker (or already prefetched by it): it has not started.
    message = work.send()
    abort(message.message_id, mode=AbortMode.CANCEL)
    release.set()
    try:
        # What Dramatiq stores for a skip, on every broker.
        assert backend.get_result(message, block=True, timeout=30_000) is None
    finally:
        backend.close()
    job = finished(broker, h, message)
    assert h.ran("ran") == 0
    assert job["status"] == "cancelled", job
    [event] = of_type(broker, message, "cancelled")
    assert event["actor"] == ABORTABLE
    assert event["data"]["reason"] == "abort"
    assert event["data"]["skipped_by"] == ABORTABLE
    assert event["data"]["worker"]
    assert not of_type(broker, message, "succeeded")


def test_an_abort_cancel_of_a_delayed_job_ends_it_cancelled(h):
    broker = abortable_broker(h)
    work = h.recorder(broker, max_retries=0)
    message = work.send_with_options(delay=500)
    abort(message.message_id, mode=AbortMode.CANCEL)
    h.start(broker, threads=1)
    job = finished(broker, h, message)
    assert h.ran("ran") == 0
    assert job["status"] == "cancelled", job
    [event] = of_type(broker, message, "cancelled")
    assert event["data"]["reason"] == "abort"


def test_a_middleware_skip_ends_the_job_cancelled_naming_the_middleware(h):
    broker = h.broker()
    broker.add_middleware(NotToday())
    skipped = h.recorder(broker, actor_name="skipped")
    kept = h.recorder(broker, "kept")
    message, other = skipped.send(), kept.send()
    h.start(broker)
    job = finished(broker, h, message)
    assert h.runs == [("kept",)]
    assert job["status"] == "cancelled", job
    assert broker.store.get(other.message_id)["status"] == "succeeded"
    [event] = of_type(broker, message, "cancelled")
    assert event["actor"] == f"{__name__}.NotToday"
    data = dict(event["data"])
    assert data.pop("worker")
    assert data == {
        "reason": "middleware",
        "skipped_by": f"{__name__}.NotToday",
        "message": "not today",
    }


def test_the_age_limit_fails_the_job_and_names_itself(h):
    broker = h.broker()
    old = h.recorder(broker, max_age=1)
    message = old.send_with_options(delay=50)
    h.start(broker)
    job = finished(broker, h, message)
    assert h.ran("ran") == 0
    assert job["status"] == "failed", job
    assert job["last_error"] == f"SkipMessage: Message age limit exceeded (skipped by {AGE_LIMIT})"
    [event] = of_type(broker, message, "failed")
    assert event["data"]["error"] == job["last_error"]


def test_a_failed_skip_stays_a_failure(h):
    broker = h.broker()
    broker.add_middleware(FailAndSkip())
    skipped = h.recorder(broker, actor_name="skipped", max_retries=3)
    message = skipped.send()
    h.start(broker)
    job = finished(broker, h, message)
    assert h.ran("ran") == 0
    assert (job["status"], job["attempts"]) == ("failed", 1), job
    assert job["last_error"] == f"SkipMessage: refused (skipped by {__name__}.FailAndSkip)"
    assert not of_type(broker, message, "cancelled")


def test_a_skip_stores_none_as_dramatiq_and_the_job_reads_cancelled_by_then(h, pg_url, schema):
    """Dramatiq's Results stores None for a skip that did not fail; None is also what an
    actor that returns nothing leaves, so the job tells them apart, and already does when
    the None can be read: no reader sees it ``running`` (or ``succeeded``) then."""
    broker = h.broker()
    backend = PostgresBackend(url=pg_url, schema=schema)
    try:
        broker.add_middleware(Results(backend=backend))
        broker.add_middleware(NotToday())
        # The skip's outcome would otherwise wait for the writer's next batch: hold the
        # writer's statement back a while, as a busy database would.
        write = broker.store.cancel_skipped

        def slow_write(*args, **kwargs):
            time.sleep(0.3)
            return write(*args, **kwargs)

        broker.store.cancel_skipped = slow_write

        @dramatiq.actor(broker=broker, queue_name=h.queue, actor_name="skipped", store_results=True)
        def skipped():
            return 42

        message = skipped.send()
        h.start(broker)
        assert backend.get_result(message, block=True, timeout=30_000) is None
        job = broker.store.get(message.message_id)
        assert job["status"] == "cancelled", job
        [event] = of_type(broker, message, "cancelled")
        assert event["data"]["skipped_by"] == f"{__name__}.NotToday"
        assert finished(broker, h, message)["status"] == "cancelled"
    finally:
        backend.close()
