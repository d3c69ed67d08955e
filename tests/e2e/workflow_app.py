"""``dramatiq tests.e2e.workflow_app``: the workflow test actors on a broker configured
from ``DRAMATIQ_PG_*``."""

from __future__ import annotations

import dramatiq

from dramatiq_pg_broker import PostgresBroker
from tests.e2e.workflow_actors import declare

broker = PostgresBroker()
dramatiq.set_broker(broker)
actors = declare(broker)
