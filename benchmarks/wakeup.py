"""What hearing a queue through the process's one LISTEN connection costs a wake-up.

    python -m benchmarks.wakeup [--server embedded|tcp] [--samples 300] [--blocks 6]

From a NOTIFY's commit to the moment a waiting thread has it, in one process, in blocks
taken in turns: a thread waiting on a LISTEN connection of its own (how each consumer
listened before), and a thread waiting on a subscription of the process's listener (how
every consumer listens now: the listener's thread reads the connection and hands the
payload over). Prints the median, 90th and 99th percentile of each.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import psycopg

from dramatiq_pg_broker.db.listener import Listener

from .run import server_url


def _timed(wait, notify, samples: int) -> list[float]:
    """``samples`` times: a thread calls ``wait()`` (it returns once the payload is in
    hand), then ``notify()`` commits a NOTIFY; the time between the two."""
    out = []
    for _ in range(samples):
        got: dict[str, float] = {}
        waiter = threading.Thread(target=lambda box=got: box.setdefault("at", wait()))
        waiter.start()
        time.sleep(0.005)  # the waiter is blocked by now
        sent = time.perf_counter()
        notify()
        waiter.join(10)
        out.append(got["at"] - sent)
    return out


def own_connection(url: str, notify, samples: int) -> list[float]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute('LISTEN "bench_wake_own"')

        def wait() -> float:
            for _ in conn.notifies(timeout=10, stop_after=1):
                return time.perf_counter()
            raise RuntimeError("no notification within 10 s")

        return _timed(wait, lambda: notify("bench_wake_own"), samples)


def subscription(listener: Listener, notify, samples: int) -> list[float]:
    subscription = listener.subscribe("bench_wake_sub")
    try:
        while not subscription.wait(5):  # the "look" once the LISTEN took effect
            pass

        def wait() -> float:
            while not subscription.wait(10):
                pass
            return time.perf_counter()

        return _timed(wait, lambda: notify("bench_wake_sub"), samples)
    finally:
        subscription.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wakeup", description=__doc__)
    p.add_argument("--server", choices=("embedded", "tcp"), default="embedded")
    p.add_argument("--samples", type=int, default=300, help="samples of each, in all")
    p.add_argument("--blocks", type=int, default=6, help="blocks of each, in turns")
    args = p.parse_args(argv)
    url = server_url(args.server)
    per_block = max(1, args.samples // args.blocks)
    listener = Listener(url)
    results: dict[str, list[float]] = {"own LISTEN connection": [], "process's listener": []}
    with psycopg.connect(url, autocommit=True) as sender:

        def notify(channel: str) -> None:
            sender.execute(f'NOTIFY "{channel}"')

        try:
            for _ in range(args.blocks):
                results["own LISTEN connection"] += own_connection(url, notify, per_block)
                results["process's listener"] += subscription(listener, notify, per_block)
        finally:
            listener.close()
    for name, values in results.items():
        values.sort()
        print(
            f"{name:<22} p50 {statistics.median(values) * 1000:.3f} ms, "
            f"p90 {values[int(len(values) * 0.9)] * 1000:.3f} ms, "
            f"p99 {values[int(len(values) * 0.99)] * 1000:.3f} ms (n={len(values)})"
        )


if __name__ == "__main__":
    main()
