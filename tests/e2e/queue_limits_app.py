"""``dramatiq tests.e2e.queue_limits_app``: the queue-limit tests' actors (see
:mod:`tests.e2e.queue_limits_actors`) on a broker configured from ``DRAMATIQ_PG_*``."""

from __future__ import annotations

import dramatiq

from dramatiq_pg_broker import PostgresBroker
from tests.e2e.queue_limits_actors import declare, declare_spans

broker = PostgresBroker()
dramatiq.set_broker(broker)
actors = declare(broker)
span_actors = declare_spans(broker)
