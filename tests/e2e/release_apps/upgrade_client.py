"""``python upgrade_client.py`` (run from this folder): a sender of whichever release the
interpreter has. Reads a JSON list of sends (``{"actor", "args", "delay", "options"}``)
from stdin; writes the messages stored for them (``{"id", "actor", "args"}``) to stdout."""

from __future__ import annotations

import json
import sys

from upgrade_actors import RELEASE, declare

from dramatiq_pg_broker import PostgresBroker


def main() -> None:
    broker = PostgresBroker()
    actors = declare(broker)
    sent = []
    try:
        for send in json.load(sys.stdin):
            message = actors[send["actor"]].send_with_options(
                args=tuple(send.get("args", ())),
                delay=send.get("delay"),
                **send.get("options", {}),
            )
            sent.append(
                {"id": message.message_id, "actor": message.actor_name, "args": message.args}
            )
    finally:
        broker.close()
    json.dump({"release": RELEASE, "sent": sent}, sys.stdout)


if __name__ == "__main__":
    main()
