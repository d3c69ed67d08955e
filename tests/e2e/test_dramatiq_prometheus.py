"""Dramatiq's own Prometheus middleware keeps working on workers of this broker: its
exposition server answers and counts the messages a real worker processed."""

from __future__ import annotations

import re
import urllib.request

import dramatiq
import pytest

from dramatiq_pg_broker import PostgresBroker

from .browser import Stack
from .servers import free_port

pytestmark = pytest.mark.slow


def samples(text: str, name: str) -> dict[str, float]:
    """actor_name -> value of the samples called ``name``."""
    found = {}
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match:
            actor = re.search(r'actor_name="([^"]+)"', match.group(1)).group(1)
            found[actor] = float(match.group(2))
    return found


def test_dramatiq_prometheus_middleware_counts_the_broker_messages(pg_url, schema, tmp_path):
    logs = tmp_path
    stack = Stack(pg_url, schema, logs)
    port = free_port()
    stack.env.update(
        {
            "dramatiq_prom_host": "127.0.0.1",
            "dramatiq_prom_port": str(port),
            "dramatiq_prom_db": str(logs / "prometheus-db"),
        }
    )
    (logs / "prometheus-db").mkdir()
    broker = PostgresBroker(url=pg_url, schema=schema)
    ok = dramatiq.actor(lambda n: n, broker=broker, actor_name="prom.ok", queue_name="prom")
    boom = dramatiq.actor(lambda: None, broker=broker, actor_name="prom.boom", queue_name="prom")
    try:
        stack.start_worker("tests.e2e.prometheus_actors")
        for i in range(3):
            ok.send(i)
        boom.send()

        def scraped():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
                text = response.read().decode()
            total = samples(text, "dramatiq_messages_total")
            return text if total.get("prom.ok") == 3 and total.get("prom.boom") == 1 else None

        text = stack.wait_for("the worker's exposition server counting 4 messages", scraped)
        assert samples(text, "dramatiq_message_errors_total") == {"prom.boom": 1.0}
        assert samples(text, "dramatiq_message_rejects_total") == {"prom.boom": 1.0}
        assert samples(text, "dramatiq_messages_inprogress") == {"prom.ok": 0.0, "prom.boom": 0.0}
    finally:
        stack.stop()
        broker.close()
