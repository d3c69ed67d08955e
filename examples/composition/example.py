"""Dramatiq's own composition, pipelines and groups, with PostgreSQL as the only server:
the broker, the result backend (which pipelines and groups read) and the rate-limiter
backend (on which a group's completion callback waits) are all this package's, on one
database.

Run the workers, then the four compositions::

    export DRAMATIQ_PG_URL=postgresql://app@localhost/app
    dramatiq-pg-broker migrate
    dramatiq examples.composition.example
    python -m examples.composition.example

It prints one line per composition:

- a pipeline whose results are piped: ``add(1, 2)``, then ``add(3)`` of that, then
  ``multiply(10)`` of that: ``pipeline 3 6 60``;
- a pipeline whose second step ignores the first one's result (``pipe_ignore``):
  ``pipe_ignore 3 20``;
- a group of additions, waited for, then its results in member order:
  ``group 0 2 4 ...``;
- a group with a completion callback, which reads every member's result (each was
  stored before the callback was sent) and returns their sum: ``callback 55``.
"""

from __future__ import annotations

import argparse

import dramatiq
from dramatiq.middleware import GroupCallbacks
from dramatiq.results import Results

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.rate_limits import PostgresRateLimiterBackend
from dramatiq_pg_broker.results import PostgresBackend

broker = PostgresBroker()
result_backend = PostgresBackend(broker=broker)
# GroupCallbacks before Results: Dramatiq runs the after-hooks of later middleware first,
# so each member's result is stored before its group's barrier counts it, and the
# callback can read them all.
broker.add_middleware(GroupCallbacks(PostgresRateLimiterBackend(broker=broker)))
broker.add_middleware(Results(backend=result_backend))
dramatiq.set_broker(broker)


@dramatiq.actor(store_results=True)
def add(x: int, y: int) -> int:
    return x + y


@dramatiq.actor(store_results=True)
def multiply(x: int, y: int) -> int:
    return x * y


@dramatiq.actor(store_results=True)
def total(member_ids: list[str]) -> int:
    """The sum of the results of a group's ``add`` members, read without waiting: the
    completion callback runs once every one of them was stored."""
    return sum(
        result_backend.get_result(
            dramatiq.Message(
                queue_name=add.queue_name,
                actor_name=add.actor_name,
                args=(),
                kwargs={},
                options={},
                message_id=member_id,
            )
        )
        for member_id in member_ids
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a pipeline and a group, print results.")
    parser.add_argument("--size", type=int, default=10, help="members of each group")
    parser.add_argument("--timeout", type=int, default=60_000, help="longest wait (ms)")
    options = parser.parse_args(argv)
    wait = {"block": True, "timeout": options.timeout}

    piped = dramatiq.pipeline([add.message(1, 2), add.message(3), multiply.message(10)]).run()
    print("pipeline", *piped.get_results(**wait))

    ignoring = dramatiq.pipeline(
        [add.message(1, 2), multiply.message_with_options(args=(4, 5), pipe_ignore=True)]
    ).run()
    print("pipe_ignore", *ignoring.get_results(**wait))

    group = dramatiq.group([add.message(i, i) for i in range(options.size)]).run()
    group.wait(timeout=options.timeout)
    print("group", *group.get_results(**wait))

    members = dramatiq.group([add.message(i, 1) for i in range(options.size)])
    callback = total.message([m.message_id for m in members.children])
    members.add_completion_callback(callback)
    members.run()
    print("callback", callback.get_result(**wait))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
