"""Consuming: NOTIFY wakes an idle consumer at once; listen=False works by polling alone."""

from __future__ import annotations

import statistics
import threading
import time
import uuid

import dramatiq


def pickup_latencies(h, broker, samples):
    """Send one message at a time to an idle worker; return send-to-start delays."""
    started = threading.Event()
    latencies = []

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def ping(sent_at):
        latencies.append(time.monotonic() - sent_at)
        started.set()

    # The CLI's default worker_timeout: an idle consumer looks again once a second even
    # without a notification, so only NOTIFY can make the pick-up much faster than that.
    h.start(broker, threads=1, timeout=1000)
    for _ in range(samples):
        time.sleep(0.3)  # let the consumer go idle
        started.clear()
        ping.send(time.monotonic())
        assert started.wait(10), "the message was not picked up"
    broker.join(h.queue, timeout=5_000)
    return latencies


def test_notify_wakes_an_idle_consumer(h):
    broker = h.broker(poll_interval=10)
    latencies = pickup_latencies(h, broker, 7)
    median = statistics.median(latencies)
    assert median < 0.2, f"idle pick-up took {median:.3f}s (median of {latencies})"


def test_listen_false_polls(h, conn):
    app = f"pgb_poll_{uuid.uuid4().hex[:8]}"
    broker = h.broker(
        url=f"{h.pg_url}{'&' if '?' in h.pg_url else '?'}application_name={app}",
        listen=False,
        poll_interval=0.1,
    )
    latencies = pickup_latencies(h, broker, 3)
    assert len(latencies) == 3 and max(latencies) < 2
    listeners = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
        "AND query ILIKE 'LISTEN%%'",
        (app,),
    ).fetchone()[0]
    assert listeners == 0, "listen=False must not LISTEN (PgBouncer transaction mode)"


def test_a_consumer_that_cannot_open_its_listen_connection_polls_quietly(h, monkeypatch, caplog):
    """The server has no slot left for the process's LISTEN connection (``too many
    clients``) while the pool's connections work: the consumer claims by polling, the
    listener says so at DEBUG only, and the process tells of saturation in one warning,
    not of an outage."""
    import logging

    import psycopg
    from dramatiq.errors import ConnectionClosed

    from dramatiq_pg_broker.db import listener, outage

    monkeypatch.setattr(outage, "tracker", outage.Outage())
    # A listener of this test's own (another test's may be connected already).
    monkeypatch.setattr(listener, "_listeners", {})
    refusals = []

    def refused(url, **kwargs):
        error = psycopg.OperationalError("connection failed: FATAL:  sorry, too many clients")
        refusals.append(error)
        outage.tracker.connect_failed(error)  # what db.connect reports
        raise ConnectionClosed(error) from error

    monkeypatch.setattr(listener, "connect", refused)
    broker = h.broker(poll_interval=0.2)
    done = []

    @dramatiq.actor(broker=broker, queue_name=h.queue)
    def work(n):
        done.append(n)

    with caplog.at_level(logging.DEBUG):
        h.start(broker, threads=2)
        for n in range(5):
            work.send(n)
        broker.join(h.queue, timeout=10_000)
        time.sleep(0.5)  # idle polls: the LISTEN connection is tried again, in time
    assert sorted(done) == list(range(5))
    assert refusals, "the consumer never had the LISTEN connection tried"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no free connection slot" in warnings[0], warnings
    assert not outage.tracker.unreachable
    assert any(
        "LISTEN connection was lost" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.DEBUG
    )


def test_a_process_listens_on_one_connection_whatever_its_queues(h, conn):
    """Every consumer of a process hears its queue through the process's one LISTEN
    connection: a worker of four queues holds one, and an idle consumer of each still
    wakes at a send within moments (no poll: the poll interval is 10 s)."""
    from dramatiq_pg_broker.db.core import application_name

    broker = h.broker(poll_interval=10)
    queues = [f"{h.queue}_{n}" for n in range(4)]
    ran = {queue: threading.Event() for queue in queues}
    for queue in queues:

        @dramatiq.actor(broker=broker, queue_name=queue, actor_name=f"ping_{queue}")
        def ping(queue_name):
            ran[queue_name].set()

    h.start(broker, threads=2)

    def listening():
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
            "AND query LIKE 'LISTEN %%'",
            (application_name(),),
        ).fetchone()[0]

    time.sleep(0.5)  # every consumer idle, its channel listened
    assert listening() == 1
    for queue in queues:
        started = time.monotonic()
        broker.actors[f"ping_{queue}"].send(queue)
        assert ran[queue].wait(5), f"queue {queue} was not woken"
        took = time.monotonic() - started
        assert took < 2, f"queue {queue} woke after {took:.2f}s: polled, not notified"
    assert listening() == 1
