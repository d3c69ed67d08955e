"""``dramatiq tests.e2e.periodic_app``: one actor on a 1-second schedule (catch-up policy)."""

from __future__ import annotations

import dramatiq

from dramatiq_pg_broker import PostgresBroker, periodic

QUEUE = "e2e-periodic"

broker = PostgresBroker()
dramatiq.set_broker(broker)


@periodic(every=1)
@dramatiq.actor(queue_name=QUEUE, actor_name="every_second")
def every_second() -> None:
    """Does nothing: the test counts the jobs the schedule enqueued."""
