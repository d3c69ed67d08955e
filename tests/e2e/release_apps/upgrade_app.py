"""``dramatiq upgrade_app`` (run from this folder): the upgrade tests' actors on a broker
from ``DRAMATIQ_PG_*``, with whichever release the interpreter has."""

from __future__ import annotations

import dramatiq
from upgrade_actors import declare

from dramatiq_pg_broker import PostgresBroker

broker = PostgresBroker()
dramatiq.set_broker(broker)
actors = declare(broker)
