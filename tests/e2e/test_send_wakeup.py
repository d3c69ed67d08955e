"""An idle ``dramatiq`` worker process is woken by a send's notification, not by its poll:
its poll interval is a minute, so only the notification can explain a start within
seconds; a send that notifies nothing (``notify_sends=off``) waits for the poll."""

from __future__ import annotations

import time

from dramatiq_pg_broker import PostgresBroker

from ..rows import status_of
from .worker_actors import declare
from .workers import wait_for, wait_until_run

#: The worker's poll interval: far longer than any wait of the test.
POLL_SECONDS = "60"


def test_an_idle_worker_is_woken_by_the_notifier_and_not_by_a_silent_send(
    recorded_actors, start_worker, pg_url, schema
):
    broker, actors = recorded_actors
    silent = PostgresBroker(url=pg_url, schema=schema, notify_sends="off")
    try:
        quiet = declare(silent)["quick"]
        worker = start_worker(DRAMATIQ_PG_POLL_INTERVAL=POLL_SECONDS)
        worker.wait_ready()
        # A first job shows the worker consumes the queue; then it goes idle, waiting on
        # its LISTEN connection for up to its poll interval.
        first = actors["quick"].send().message_id
        wait_until_run(broker, worker, first)
        time.sleep(0.5)  # its claim after the first job found nothing: it waits now

        unheard = quiet.send().message_id
        time.sleep(2.0)  # a minute-long poll: a silent send is not claimed meanwhile
        assert status_of(broker.store, unheard) == "queued", worker.log_tail()

        sent = time.monotonic()
        heard = actors["quick"].send().message_id
        wait_for(
            lambda: {status_of(broker.store, j) for j in (heard, unheard)} == {"succeeded"},
            10,
            "the notified worker to run both waiting jobs",
            on_timeout=worker.log_tail,
        )
        took = time.monotonic() - sent
        assert took < 10, f"{took:.1f}s: that was the poll, not the notification"
    finally:
        silent.close()
