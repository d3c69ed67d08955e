"""``dramatiq tests.e2e.failover_app``: the failover test's actor on a broker configured
from ``DRAMATIQ_PG_*``."""

from __future__ import annotations

import dramatiq

from dramatiq_pg_broker import PostgresBroker
from tests.e2e.failover_actors import declare

broker = PostgresBroker()
dramatiq.set_broker(broker)
work = declare(broker)
