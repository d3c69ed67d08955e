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
