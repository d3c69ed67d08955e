"""``dramatiq tests.e2e.exactly_once_app``: the exactly-once actors on a broker configured
from ``DRAMATIQ_PG_*``, with Dramatiq's Results middleware on this package's backend."""

from __future__ import annotations

import dramatiq
from dramatiq.results import Results

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.results import PostgresBackend
from tests.e2e.exactly_once_actors import declare, declare_app_code

broker = PostgresBroker()
broker.add_middleware(Results(backend=PostgresBackend(broker=broker)))
dramatiq.set_broker(broker)
actor = declare(broker)
app_code = declare_app_code(broker)
