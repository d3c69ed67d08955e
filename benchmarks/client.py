"""Client-side steps, each run in its own process so that brokers never share one:
``python -m benchmarks.client {enqueue,enqueue-threads,bulk,send,delayed,latency,workflows,flush}
...``.

``enqueue-threads --go PATH`` (the notify workload's processes, :mod:`.notify`): after the
warm-up, each process writes ``PATH.ready-<pid>`` and waits for ``PATH`` to exist before
its threads start together; it reports the wall-clock time of its start and end.

The broker is the one ``benchmarks.actors`` builds from ``BENCH_BROKER``. Each step prints
one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time


def _send_many(actor, count: int, **options) -> float:
    started = time.perf_counter()
    if options:
        for i in range(count):
            actor.send_with_options(args=(i,), **options)
    else:
        for i in range(count):
            actor.send(i)
    return time.perf_counter() - started


def _send_from_threads(
    actor, count: int, threads: int, warmup: int, go: str | None = None, times: dict | None = None
) -> float:
    """``count`` sends split over ``threads`` threads released together (a web app's
    request threads); returns the seconds from the release to the last send returning.
    With ``go``, the release also waits for that file (see the module docstring), and
    ``times`` gets the wall-clock ``start`` and ``end``."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def run(share: int) -> None:
        try:
            for i in range(warmup // threads):
                actor.send(i)
            barrier.wait()
            for i in range(share):
                actor.send(i)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            barrier.abort()

    shares = [count // threads + (1 if t < count % threads else 0) for t in range(threads)]
    workers = [threading.Thread(target=run, args=(share,)) for share in shares]
    for t in workers:
        t.start()
    if go is not None:
        _wait_for_go(go)
    barrier.wait()
    started = time.perf_counter()
    if times is not None:
        times["start"] = time.time()
    for t in workers:
        t.join()
    seconds = time.perf_counter() - started
    if times is not None:
        times["end"] = time.time()
    if errors:
        raise errors[0]
    return seconds


def _wait_for_go(path: str, timeout: float = 120.0) -> None:
    """Say this process is ready (``path.ready-<pid>``), then wait for ``path``."""
    import os

    with open(f"{path}.ready-{os.getpid()}", "w"):
        pass
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no go ({path}) within {timeout:.0f}s")
        time.sleep(0.001)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.client")
    parser.add_argument(
        "step",
        choices=[
            "enqueue",
            "enqueue-threads",
            "bulk",
            "send",
            "delayed",
            "latency",
            "workflows",
            "flush",
        ],  # fmt: skip
    )
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--gap", type=float, default=0.01, help="seconds between two sends")
    parser.add_argument("--width", type=int, default=100, help="a workflow's group's width")
    parser.add_argument("--go", help="enqueue-threads: start when this file exists")
    args = parser.parse_args(argv)

    from . import actors

    broker = actors.broker
    out: dict = {"broker": actors.KIND, "step": args.step, "count": args.count}
    try:
        if args.step == "flush":
            # Dramatiq's own flush purges the queue and its delay queue.
            broker.flush_all()
        elif args.step == "enqueue":
            # Warm up connections, prepared statements and scripts first; not timed.
            _send_many(actors.noop, args.warmup)
            cpu = time.process_time()
            seconds = _send_many(actors.noop, args.count)
            out.update(seconds=seconds, rate=args.count / seconds, cpu_s=time.process_time() - cpu)
        elif args.step == "enqueue-threads":
            times: dict = {}
            seconds = _send_from_threads(
                actors.noop, args.count, args.threads, args.warmup, args.go, times
            )
            out.update(seconds=seconds, rate=args.count / seconds, threads=args.threads, **times)
        elif args.step == "bulk":
            # One broker.enqueue_many() of `count` messages (built first, not timed), after
            # an untimed warm-up batch.
            broker.enqueue_many([actors.noop.message(i) for i in range(args.warmup)])
            batch = [actors.noop.message(i) for i in range(args.count)]
            started = time.perf_counter()
            broker.enqueue_many(batch)
            seconds = time.perf_counter() - started
            out.update(seconds=seconds, rate=args.count / seconds)
        elif args.step == "send":
            seconds = _send_many(actors.noop, args.count)
            out.update(seconds=seconds, rate=args.count / seconds)
        elif args.step == "delayed":
            seconds = _send_many(actors.noop, args.count, delay=3_600_000)
            out.update(seconds=seconds)
        elif args.step == "workflows":
            # `count` workflows of a step, a `width`-wide group and a step, run one after
            # the other (each one transaction), results piped as by default.
            import dramatiq

            from dramatiq_pg_broker import workflow

            sink = actors.sink
            started = time.perf_counter()
            for i in range(args.count):
                workflow(
                    sink.message(i),
                    dramatiq.group([sink.message(j) for j in range(args.width)]),
                    sink.message(),
                ).run(broker=broker)
            seconds = time.perf_counter() - started
            out.update(seconds=seconds, jobs=args.count * (args.width + 2))
        elif args.step == "latency":
            for _ in range(args.count):
                actors.stamp.send(time.time())
                time.sleep(args.gap)
    finally:
        broker.close()
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
