"""Actor results with PostgreSQL as the only server: the broker and the result backend are
both this package's, on one database.

Run the workers, then send some additions and print their sums as they come back::

    export DRAMATIQ_PG_URL=postgresql://app@localhost/app
    dramatiq-pg-broker migrate
    dramatiq examples.results.example
    python -m examples.results.example 10

Results are pickled (any Python value comes back as it was returned); each blocked
``get_result`` wakes on LISTEN/NOTIFY when its result is committed.
"""

from __future__ import annotations

import argparse
import random
import time

import dramatiq
from dramatiq.encoder import PickleEncoder
from dramatiq.results import Results

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.results import PostgresBackend

broker = PostgresBroker()
result_backend = PostgresBackend(broker=broker, encoder=PickleEncoder())
broker.add_middleware(Results(backend=result_backend))
dramatiq.set_broker(broker)


@dramatiq.actor(store_results=True)
def sleep_then_add(seconds: float, x: int, y: int) -> int:
    time.sleep(seconds)
    return x + y


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Send additions and print their results.")
    parser.add_argument("count", type=int, help="how many messages to send")
    parser.add_argument("--max-sleep", type=int, default=5, help="longest sleep of an actor (s)")
    options = parser.parse_args(argv)
    sent = [
        sleep_then_add.send(
            random.randint(1, options.max_sleep), random.randint(0, 1000), random.randint(0, 1000)
        )
        for _ in range(options.count)
    ]
    for message in sent:
        print(message.get_result(block=True, timeout=60_000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
