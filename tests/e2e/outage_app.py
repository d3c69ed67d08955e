"""``dramatiq tests.e2e.outage_app``: the e2e worker app with the connection holders an
application adds in each worker process, kept busy: a connection pool of its own and the
results/rate-limit waiters of the process's LISTEN connection (besides the broker's pool
and the consumers, which hear their queues through the same LISTEN connection). Its
reminders come at the broker's ``outage_reminder_seconds``, which a test sets through
``DRAMATIQ_PG_OUTAGE_REMINDER_SECONDS`` so that a short outage shows them.
"""

from __future__ import annotations

import threading
import time

from dramatiq.errors import BrokerConnectionError
from dramatiq.middleware import Middleware

from dramatiq_pg_broker.db import ProcessPool
from dramatiq_pg_broker.db.listener import channel_for, listener_for
from tests.e2e.worker_app import broker


def _keep_busy(pool: ProcessPool) -> None:
    while True:
        try:
            with pool.connection() as conn:
                conn.execute("SELECT 1")
        except BrokerConnectionError:
            pass
        time.sleep(0.2)


def _keep_listening(url: str, schema: str) -> None:
    channel = channel_for(schema, "outage-test")
    while True:
        try:
            listener_for(url).wait_for(channel, "nothing", lambda: None, 2.0)
        except BrokerConnectionError:
            time.sleep(0.2)


class MoreConnectionHolders(Middleware):
    """Starts the extra holders in each worker process, once it has booted."""

    def after_worker_boot(self, broker, worker) -> None:
        pool = ProcessPool(broker.settings)
        for target, args in (
            (_keep_busy, (pool,)),
            (_keep_listening, (broker.pool.url, broker.settings.schema)),
        ):
            threading.Thread(target=target, args=args, daemon=True).start()


broker.add_middleware(MoreConnectionHolders())
