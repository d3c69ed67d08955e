"""The claim statement's round trip, and whether its plan lasts: ``python -m
benchmarks.claim_plan``.

Fills a queue of a fresh schema with ``--queued`` runnable jobs (in random physical order,
then ``ANALYZE``: the statistics a real queue has), then claims ``--batch`` jobs at a time,
``--loops`` times, on one connection that prepares statements as the broker's pool does
(psycopg's default threshold), and prints the median and mean round trip after the first
20 (psycopg prepares at the sixth execution, the server keeps a generic plan after five
more) and how many generic and custom plans the server made for the claim
(``pg_prepared_statements``). A claim planned at every execution shows as custom plans
equal to the executions. ``--before-fill N`` first claims N times on the empty queue, on
the same connection (a worker that started before a backlog arrived), and also prints
the custom plans made after the fill.

Run it with an earlier checkout's code to compare (``--code``: the folder whose
``dramatiq_pg_broker`` is imported; this checkout's by default)::

    git worktree add /tmp/before REV
    python -m benchmarks.claim_plan --queued 5000 --batch 1 --code /tmp/before
    python -m benchmarks.claim_plan --queued 5000 --batch 1

The schema (``--schema``) is dropped and migrated again by the code imported; the database
is ``DRAMATIQ_PG_URL`` (or ``--url``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import psycopg
from psycopg import sql

FILL = """
INSERT INTO {}.jobs (id, queue_name, actor_name, message, status, priority, available_at,
                     max_attempts, created_at, updated_at)
SELECT gen_random_uuid(), 'default', 'a', '{{}}', 'queued', 0, now() - interval '1 hour', 5,
       now() - interval '1 hour' + i * interval '1 millisecond', now()
FROM generate_series(1, %s) AS i
ORDER BY random()
"""

PLANS = """
SELECT generic_plans, custom_plans FROM pg_prepared_statements
WHERE statement LIKE 'WITH RECURSIVE pause%%'
"""


def measure(
    url: str, schema: str, queued: int, batch: int, loops: int, before_fill: int = 0
) -> dict:
    """Claim ``batch`` jobs ``loops`` times from ``queued`` (see the module docstring) with
    the ``dramatiq_pg_broker`` first on ``sys.path``; ``before_fill`` claims first, on the
    same connection, while the queue is still empty."""
    import dramatiq_pg_broker
    from dramatiq_pg_broker.db.queries import Queries

    from . import pgdata

    pgdata.reset_schema(url, schema)
    claim = Queries(schema)["claim_jobs"]
    params = {
        "queue_name": "default",
        "limit": batch,
        "owner": "claim-plan",
        "now": None,
        "lease_ms": 30_000,
        "events": True,
    }
    times = []
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.cursor()
        for _ in range(before_fill):
            cursor.execute(claim, params).fetchall()
        early = conn.execute(PLANS).fetchone() or (0, 0)
        with psycopg.connect(url, autocommit=True) as filler:
            filler.execute(sql.SQL(FILL).format(sql.Identifier(schema)), (queued,))
            filler.execute(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(schema)))
        for _ in range(loops):
            began = time.perf_counter()
            cursor.execute(claim, params).fetchall()
            times.append(time.perf_counter() - began)
        generic, custom = conn.execute(PLANS).fetchone() or (0, 0)
    pgdata.drop_schema(url, schema)
    warm = times[20:] or times
    return {
        "code": os.path.dirname(dramatiq_pg_broker.__file__),
        "queued": queued,
        "batch": batch,
        "loops": loops,
        "median_us": statistics.median(warm) * 1e6,
        "mean_us": statistics.mean(warm) * 1e6,
        "generic_plans": generic,
        "custom_plans": custom,
        "custom_plans_after_fill": custom - early[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("DRAMATIQ_PG_URL"))
    parser.add_argument("--schema", default="bench_claim_plan")
    parser.add_argument("--queued", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--loops", type=int, default=2000)
    parser.add_argument("--code", help="the folder of the dramatiq_pg_broker to measure")
    parser.add_argument(
        "--before-fill",
        type=int,
        default=0,
        help="claims on the empty queue first, on the same connection (its first plans)",
    )
    args = parser.parse_args()
    if args.code:
        sys.path.insert(0, os.path.abspath(args.code))
    if not args.url:
        raise SystemExit("give --url or set DRAMATIQ_PG_URL")
    result = measure(args.url, args.schema, args.queued, args.batch, args.loops, args.before_fill)
    print(
        f"{result['code']}: claim of {args.batch} from {args.queued} queued, {args.loops} "
        f"times: median {result['median_us']:.0f} us, mean {result['mean_us']:.0f} us; "
        f"plans generic {result['generic_plans']}, custom {result['custom_plans']}"
        + (
            f" ({result['custom_plans_after_fill']} custom after the fill)"
            if args.before_fill
            else ""
        )
    )


if __name__ == "__main__":
    main()
