"""``dramatiq tests.e2e.exactly_once_app``: the exactly-once actor on a broker configured
from ``DRAMATIQ_PG_*``."""

from __future__ import annotations

import dramatiq

from dramatiq_pg_broker import PostgresBroker
from tests.e2e.exactly_once_actors import declare

broker = PostgresBroker()
dramatiq.set_broker(broker)
actor = declare(broker)
