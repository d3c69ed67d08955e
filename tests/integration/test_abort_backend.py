"""dramatiq-abort on PostgreSQL alone: the event backend's contract (each event taken once,
oldest first, expiring), waits woken by NOTIFY on the process's one LISTEN connection, and
dramatiq-abort's own scenarios (abort a running message, cancel a pending one, abort with
a grace period, abort before processing, abort from inside) on a PostgresBroker."""

from __future__ import annotations

import threading
import time

import dramatiq
import pytest
from dramatiq_abort import Abort, Abortable, Event, abort, abort_requested
from dramatiq_abort.middleware import AbortMode

from dramatiq_pg_broker.backends.abort import PostgresEventBackend

from ..helpers import wait_for
from .harness import Harness

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def backend(pg_url, schema):
    backend = PostgresEventBackend(url=pg_url, schema=schema)
    with backend.pool.connection() as conn:
        conn.execute(f'DELETE FROM "{schema}".abort_events')
    yield backend
    backend.close()


# -- the backend's contract ------------------------------------------------------------------


def test_each_event_is_taken_once_oldest_first(backend):
    a, b = Event("test-a", {}), Event("test-b", {"param1": 1})
    c = Event("test-c", {"param1": 1, "param2": "string", "param3": True})
    assert backend.wait_many([a.key], timeout=100) is None
    backend.notify([a], 1000)
    backend.notify([b, c], 1000)
    assert backend.wait_many([a.key, b.key], timeout=1000) == a
    assert backend.wait_many([b.key, a.key], timeout=1000) == b
    assert backend.poll(c.key) == c
    assert backend.poll("test-d") is None
    assert backend.wait_many([a.key, b.key, c.key, "test-d"], timeout=100) is None


def test_an_expired_event_is_gone_for_readers_and_reclaimed(backend, schema):
    backend.notify([Event("brief", {})], 1)
    backend.notify([Event("lasting", {})], 60_000)
    time.sleep(0.05)  # past the first event's one-millisecond life
    assert backend.poll("brief") is None
    backend.prune()  # (a notify may have reclaimed it already: its passes are opportunistic)
    with backend.pool.connection() as conn:
        keys = [r[0] for r in conn.execute(f'SELECT key FROM "{schema}".abort_events')]
    assert keys == ["lasting"]


def test_a_wait_sleeps_on_notify_and_wakes_at_once(backend, monkeypatch):
    got: list = []
    waiting = threading.Event()

    def wait():
        waiting.set()
        got.append(backend.wait_many(["late", "other"], timeout=10_000))
        got.append(time.monotonic())

    # The waiter's looks (its statement for the keys), counted apart from whatever else
    # this process sends meanwhile (a pool's check, another thread's statement).
    looks: list[float] = []
    take = backend._take

    def counted_take(keys):
        try:
            return take(keys)
        finally:
            looks.append(time.monotonic())

    monkeypatch.setattr(backend, "_take", counted_take)
    thread = threading.Thread(target=wait)
    thread.start()
    waiting.wait(5)
    # The waiter subscribes and looks once (on a loaded machine that may take a while),
    # then sleeps: wait for its first look and a quiet spell after it.
    wait_for(
        lambda: looks and time.monotonic() - looks[-1] > 0.3,
        10,
        "the waiter's first look, then quiet",
    )
    before = len(looks)
    time.sleep(0.7)  # the span observed: a polling waiter would look in it
    asleep = len(looks) - before
    assert asleep == 0, f"the waiter looked {asleep} time(s) asleep"
    sent = time.monotonic()
    backend.notify([Event("late", {"n": 1})], 10_000)
    thread.join(10)
    assert got[0] == Event("late", {"n": 1})
    assert got[1] - sent < 0.5, f"woken {got[1] - sent:.3f}s after the notify"


def test_without_listen_a_wait_looks_every_poll_interval(pg_url, schema):
    backend = PostgresEventBackend(url=pg_url, schema=schema, listen=False)
    try:
        threading.Timer(0.2, backend.notify, ([Event("polled", {})], 5000)).start()
        started = time.monotonic()
        assert backend.wait_many(["polled"], timeout=5000) == Event("polled", {})
        assert time.monotonic() - started < 2
    finally:
        backend.close()


# -- dramatiq-abort's scenarios on a PostgresBroker -------------------------------------------


def abortable_broker(h: Harness, pg_url: str, schema: str):
    broker = h.broker()
    backend = PostgresEventBackend(broker=broker)
    middleware = Abortable(backend=backend)
    broker.add_middleware(middleware)
    return broker, middleware


def test_a_running_message_is_aborted_and_not_retried(h, pg_url, schema):
    broker, _ = abortable_broker(h, pg_url, schema)
    started = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=3, min_backoff=100)
    def work():
        started.set()
        try:
            for _ in range(100):
                time.sleep(0.1)
        except Abort:
            h.record("aborted", "work")
            raise
        h.record("finished", "work")

    worker = h.start(broker)
    message = work.send()
    assert started.wait(10)
    abort(message.message_id)
    wait_for(lambda: h.ran("aborted", "work"), 5, "Abort raised in the actor")
    worker.join()
    assert broker.outcomes.flush(10)
    job = broker.store.get(message.message_id)
    assert job["status"] == "failed" and job["attempts"] == 1, "an aborted message was retried"
    assert not h.ran("finished", "work")


def test_cancel_mode_leaves_a_running_message_alone(h, pg_url, schema):
    broker, _ = abortable_broker(h, pg_url, schema)
    started = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def work():
        started.set()
        for _ in range(11):  # longer than the watcher's one-second wait
            time.sleep(0.1)
        h.record("finished", "work")

    worker = h.start(broker)
    message = work.send()
    assert started.wait(10)
    abort(message.message_id, mode=AbortMode.CANCEL)
    worker.join()
    assert h.ran("finished", "work") == 1


def test_an_abort_with_a_timeout_lets_the_actor_finish_cleanly(h, pg_url, schema):
    broker, _ = abortable_broker(h, pg_url, schema)
    started = threading.Event()
    remaining: list[float] = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def work():
        started.set()
        for _ in range(50):
            left = abort_requested()
            if left:
                remaining.append(left)
                break
            time.sleep(0.1)
        h.record("finished", "work")

    worker = h.start(broker)
    message = work.send()
    assert started.wait(10)
    abort(message.message_id, abort_timeout=2000)
    worker.join()
    assert remaining and 0 < remaining[0] <= 2000
    assert h.ran("finished", "work") == 1


@pytest.mark.parametrize("mode", [AbortMode.ABORT, AbortMode.CANCEL])
def test_a_message_aborted_before_processing_never_runs(h, pg_url, schema, mode):
    broker, _ = abortable_broker(h, pg_url, schema)

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def work():
        h.record("ran", "work")

    message = work.send()
    abort(message.message_id, mode=mode)
    worker = h.start(broker, threads=1)
    broker.join(h.queue, timeout=10_000)
    worker.join()
    assert h.ran("ran", "work") == 0


def test_an_actor_aborting_itself_is_interrupted(h, pg_url, schema):
    broker, middleware = abortable_broker(h, pg_url, schema)
    sentinel: list[bool] = []

    @dramatiq.actor(broker=broker, queue_name=h.queue, max_retries=0)
    def work():
        try:
            sentinel.append(True)
            middleware.abort(message.message_id)
            for _ in range(30):
                time.sleep(0.1)
            sentinel.append(True)
        except Abort:
            sentinel.append(False)
            raise

    worker = h.start(broker)
    message = work.send()
    wait_for(lambda: len(sentinel) >= 2, 10, "the actor interrupted")
    worker.join()
    assert sentinel == [True, False]
