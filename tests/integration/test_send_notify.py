"""How sends wake idle workers (sending/notifier.py), heard by a LISTENing connection of the
test: the broker's own sends through the process's notifier (a burst notifies a few times,
not once per send; what is owed is sent at close and at exit), a send inside the
application's transaction at its commit only, a job delayed past the poll interval not at
all."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.jobs.rows import channel_name

REPO = Path(__file__).resolve().parents[2]


class Heard:
    """A LISTENing connection of the test on some queues' channels."""

    def __init__(self, url: str, schema: str, *queues: str) -> None:
        self.schema = schema
        self.conn = psycopg.connect(url, autocommit=True)
        for queue in queues:
            self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel(queue))))

    def channel(self, queue: str) -> str:
        return channel_name(self.schema, queue)

    def take(self, timeout: float, stop_after: int | None = None) -> list[str]:
        """The channels of the notifications that arrive within ``timeout`` seconds (or
        until ``stop_after`` of them did)."""
        return [n.channel for n in self.conn.notifies(timeout=timeout, stop_after=stop_after)]

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def heard(pg_url, schema):
    made: list[Heard] = []

    def listen(*queues: str) -> Heard:
        made.append(Heard(pg_url, schema, *queues))
        return made[-1]

    yield listen
    for h in made:
        h.close()


@pytest.fixture
def make_broker(pg_url, schema):
    """``make_broker(**options)``: a broker of the module's schema, closed afterwards."""
    made: list[PostgresBroker] = []

    def make(**options) -> PostgresBroker:
        made.append(PostgresBroker(url=pg_url, schema=schema, **options))
        return made[-1]

    yield make
    for broker in made:
        broker.close()


def actor_on(broker: PostgresBroker, queue: str) -> dramatiq.Actor:
    @dramatiq.actor(broker=broker, queue_name=queue, actor_name=f"noop_{queue}")
    def noop(n=0):
        pass

    return noop


def test_a_send_through_the_pool_is_notified_by_the_notifier_after_its_commit(
    make_broker, queue, heard
):
    broker = make_broker()
    listener = heard(queue)
    actor_on(broker, queue).send(1)
    assert listener.take(timeout=5, stop_after=1) == [listener.channel(queue)]
    assert broker.sender.notifier.flush(5)
    assert broker.sender.notifier.statements == 1, "the notifier's statement woke the queue"


def test_a_burst_of_sends_notifies_far_fewer_times_than_it_sends(make_broker, queue, heard):
    broker = make_broker()
    task = actor_on(broker, queue)
    listener = heard(queue)
    threads, each = 8, 60
    barrier = threading.Barrier(threads)

    def send() -> None:
        barrier.wait()
        for n in range(each):
            task.send(n)

    started = time.monotonic()
    workers = [threading.Thread(target=send) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    seconds = time.monotonic() - started
    assert broker.sender.notifier.flush(5)
    notifications = listener.take(timeout=0.5)
    sent = threads * each
    assert notifications, "the burst woke nobody"
    # At most one statement per interval, plus the leading one and the one at the end.
    bound = seconds / broker.sender.notifier.interval + 2
    assert len(notifications) <= bound, (len(notifications), bound)
    assert len(notifications) * 4 <= sent, f"{len(notifications)} notifications for {sent} sends"
    assert len(notifications) == broker.sender.notifier.statements


def test_notify_sends_statement_notifies_in_every_sends_statement(make_broker, queue, heard):
    broker = make_broker(notify_sends="statement")
    task = actor_on(broker, queue)
    listener = heard(queue)
    for n in range(5):
        task.send(n)
    assert len(listener.take(timeout=0.5)) == 5, "one commit, one notification, per send"
    assert broker.sender.notifier.statements == 0


def test_notify_sends_off_notifies_nothing(make_broker, queue, heard):
    broker = make_broker(notify_sends="off")
    task = actor_on(broker, queue)
    listener = heard(queue)
    task.send(1)
    with broker.batch():
        task.send(2)
    assert listener.take(timeout=0.5) == []


def test_a_batch_through_the_pool_is_notified_once_after_its_commit(make_broker, queue, heard):
    broker = make_broker()
    task = actor_on(broker, queue)
    listener = heard(queue)
    broker.enqueue_many([task.message(n) for n in range(300)])  # the COPY path
    with broker.batch():
        for n in range(3):
            task.send(n)
    assert broker.sender.notifier.flush(5)
    assert listener.take(timeout=0.5) == [listener.channel(queue)] * 2


def test_a_send_in_the_applications_transaction_wakes_at_its_commit_only(
    make_broker, queue, heard, pg_url
):
    broker = make_broker()
    task = actor_on(broker, queue)
    listener = heard(queue)
    with psycopg.connect(pg_url) as app:
        with broker.transaction(app):
            task.send(1)
            assert listener.take(timeout=0.5) == [], "notified before the commit"
        assert listener.take(timeout=5, stop_after=1) == [listener.channel(queue)]
        # Rolled back: nothing to wake anyone for.
        with pytest.raises(RuntimeError), broker.transaction(app):
            task.send(2)
            raise RuntimeError("the application changes its mind")
        with broker.transaction(app):
            with broker.batch():
                task.send(3)
            assert listener.take(timeout=0.3) == []
    assert listener.take(timeout=5, stop_after=1) == [listener.channel(queue)]
    assert listener.take(timeout=0.3) == [], "the rollback notified"
    assert broker.sender.notifier.statements == 0, "the application's commit notified, alone"


def test_a_job_delayed_past_the_poll_interval_is_not_notified(make_broker, queue, heard):
    broker = make_broker(poll_interval=1.0)
    task = actor_on(broker, queue)
    listener = heard(queue)
    task.send_with_options(args=(1,), delay=60_000)
    assert broker.sender.notifier.flush(5)
    assert listener.take(timeout=0.5) == [], "an idle consumer looks before it is due"
    # Due before the next look of an idle consumer: it is told, and learns when.
    task.send_with_options(args=(2,), delay=200)
    assert listener.take(timeout=5, stop_after=1) == [listener.channel(queue)]


def test_what_is_owed_is_sent_when_the_broker_closes(pg_url, schema, queue, heard):
    broker = PostgresBroker(url=pg_url, schema=schema)
    broker.sender.notifier.interval = 60.0  # the next statement would be a minute away
    other = f"{queue}_b"
    listener = heard(queue, other)
    actor_on(broker, queue).send(1)
    assert listener.take(timeout=5, stop_after=1) == [listener.channel(queue)]
    actor_on(broker, other).send(1)
    assert listener.take(timeout=0.5) == [], "owed until the interval passes"
    started = time.monotonic()
    broker.close()
    assert listener.take(timeout=5, stop_after=1) == [listener.channel(other)]
    assert time.monotonic() - started < 10, "sent at close, not after the interval"


def test_what_is_owed_is_sent_when_the_process_exits_without_closing(pg_url, schema, queue, heard):
    listener = heard(queue)
    script = f"""
import dramatiq
from dramatiq_pg_broker import PostgresBroker

broker = PostgresBroker(url={pg_url!r}, schema={schema!r})
broker.sender.notifier.interval = 60.0

@dramatiq.actor(broker=broker, queue_name={queue!r})
def noop():
    pass

noop.send()          # notified at once
noop.send()          # owed for a minute
print(broker.sender.notifier.statements, flush=True)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30, "the exit waited for the interval"
    heard_now = listener.take(timeout=2)
    # The first send's wake-up, then the one owed at exit (the print may have come before
    # or after the first statement was sent).
    assert heard_now == [listener.channel(queue)] * 2, (heard_now, done.stdout)
