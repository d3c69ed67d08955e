"""The ``notify`` workload: concurrent sends from several processes, with and without the
wake-ups of idle workers.

PostgreSQL serializes the commits of every transaction that sent a NOTIFY (one
database-wide lock, held through the commit's WAL flush). This workload sends
``count`` no-op messages from :data:`PROCESSES` client processes x :data:`THREADS` threads
(``python -m benchmarks.client enqueue-threads``), every process warmed up first and all
of them released together by a file, and times the whole: the first process's start to
the last one's end. Meanwhile one connection of this process LISTENs on the queue's
channel (an idle worker's), and counts the notifications that reach it.

It runs on the variants of :data:`VARIANTS`, in turns within each round: this checkout as
it ships (``postgres``: a notifier thread per process, see
``dramatiq_pg_broker/sending/notifier.py``), with every send notifying in its own
statement (``postgres-notify-statement``: the path before the notifier), with no
notification (``postgres-notify-off``: the rate to compare with), and, with ``--against
REF``, the earlier release.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import psycopg

from .actors import QUEUE
from .harness import ROOT, BenchError, Harness, Variant

PROCESSES = 4
THREADS = 8
#: Untimed sends of each process before the release.
WARMUP = 400

#: The schemas (by server) that had their untimed first round (see :func:`sends`).
_warmed: set[tuple[str, str]] = set()


class Counter(threading.Thread):
    """Counts the notifications of one channel that reach a LISTENing connection."""

    def __init__(self, url: str, channel: str) -> None:
        super().__init__(daemon=True)
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(f'LISTEN "{channel}"')
        self.count = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            for _ in self.conn.notifies(timeout=0.2):
                self.count += 1

    def settle(self, quiet: float = 0.5, timeout: float = 10.0) -> int:
        """The count once no notification arrived for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        last, since = self.count, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if self.count != last:
                last, since = self.count, time.monotonic()
            elif time.monotonic() - since >= quiet:
                break
        return self.count

    def close(self) -> None:
        self.stopping.set()
        self.join(2)
        self.conn.close()


def channel(schema: str) -> str:
    """The LISTEN channel of the benchmark queue (``schema.queue``, as the broker names it)."""
    from dramatiq_pg_broker.jobs.rows import channel_name

    return channel_name(schema, QUEUE)


def sends(harness: Harness, variant: Variant, count: int) -> dict:
    """``count`` sends from :data:`PROCESSES` processes x :data:`THREADS` threads; the rate,
    and the notifications a listener received per 1,000 sends.

    The first measurement on a schema of a server is preceded by an untimed one of a
    quarter of the sends: in three runs without it, the first measurement on a freshly
    migrated schema came out at 0.4 to 0.6 x the rate of the variants after it four times
    in six, whatever variant it was (tables that never held a row, their first autovacuum
    and analyze within the measurement)."""
    schema = variant.schema or harness.schema
    if (harness.url, schema) not in _warmed:
        _warmed.add((harness.url, schema))
        _measure(harness, variant, max(PROCESSES * THREADS, count // 4))
    return _measure(harness, variant, count)


def _measure(harness: Harness, variant: Variant, count: int) -> dict:
    harness.flush(variant)
    schema = variant.schema or harness.schema
    state = tempfile.mkdtemp(prefix="bench-notify-")
    go = os.path.join(state, "go")
    per_process = count // PROCESSES
    counter = Counter(harness.url, channel(schema))
    counter.start()
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(PROCESSES):
            args = [variant.python or sys.executable, "-m", "benchmarks.client",
                    "enqueue-threads", "--count", str(per_process), "--threads", str(THREADS),
                    "--warmup", str(WARMUP), "--go", go]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    args,
                    cwd=variant.code or ROOT,
                    env=harness.env(variant),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )  # fmt: skip
            )
        deadline = time.monotonic() + 120
        while len(glob.glob(f"{go}.ready-*")) < PROCESSES:
            if any(p.poll() is not None for p in procs):
                raise BenchError("a sending process exited before its start")
            if time.monotonic() > deadline:
                raise BenchError("the sending processes did not warm up within 120 s")
            time.sleep(0.01)
        before = counter.settle(quiet=0.3)
        with open(go, "w"):
            pass
        outputs = []
        for p in procs:
            out, err = p.communicate(timeout=count / 200 + 120)
            if p.returncode != 0:
                tail = " | ".join(err.strip().splitlines()[-3:])
                raise BenchError(f"a sending process failed: {tail}")
            outputs.append(json.loads(out.strip().splitlines()[-1]))
        heard = counter.settle() - before
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        counter.close()
        shutil.rmtree(state, ignore_errors=True)
        harness.flush(variant)
    seconds = max(o["end"] for o in outputs) - min(o["start"] for o in outputs)
    sent = per_process * PROCESSES
    return {
        "rate": sent / seconds,
        "seconds": seconds,
        # Counted from the release to a quiet half second after the last send: the
        # closing processes' last flush included, the warm-up's left out.
        "notifications_per_1000": heard * 1000 / sent,
    }
