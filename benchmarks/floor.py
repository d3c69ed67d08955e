"""PostgreSQL's own latency floor, measured beside the broker in every run.

A script with no framework does the work a durable broker cannot avoid for one message:

- the sender (the benchmark process): one autocommit ``INSERT`` of a message-sized row
  into a table shaped like ``jobs`` (the same columns, constraints and indexes, the claim
  index among them) and a ``NOTIFY``, in one statement, so one round trip and one durable
  commit;
- the consumer (a process of its own, ``python -m benchmarks.floor consume``): waits on
  ``LISTEN``, and for each notification claims with one autocommit ``UPDATE ... FOR UPDATE
  SKIP LOCKED ... RETURNING`` in claim order (the second durable commit), then hands the
  row to a thread blocked on a queue, which takes the time.

The latency is from just before the send (the time written in the row, as the broker's
``stamp`` actor gets it) to the waiting thread receiving the row: the same span the
broker's latency workload measures, send() to the actor's start.

:func:`life` is the floor of a job's whole life at the server (the ``life`` workload): WAL
bytes and server CPU per job of a send, a claim and an outcome with no framework.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import psycopg
from psycopg import sql

from .actors import QUEUE

TABLE = "floor_jobs"
CHANNEL = "dramatiq_bench_floor"


def _q(text: str, schema: str, table: str = TABLE) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(schema), table=sql.Identifier(table))


CLAIM = """
UPDATE {schema}.{table} AS j
SET status = 'running', attempts = j.attempts + 1, locked_by = 'floor',
    locked_until = now() + interval '30 minutes', started_at = now(), updated_at = now()
WHERE j.id = (
    SELECT id FROM {schema}.{table}
    WHERE queue_name = %s AND status = 'queued' AND available_at <= now()
    ORDER BY priority, available_at, created_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
RETURNING j.id, j.message
"""

SEND = """
WITH inserted AS (
    INSERT INTO {schema}.{table} (id, queue_name, actor_name, message, priority,
                                  available_at, max_attempts, created_at, updated_at, status)
    VALUES (%s, %s, 'stamp', %s::jsonb, 0, now(), 1, now(), now(), 'queued')
    RETURNING id
)
SELECT pg_notify(%s, '') FROM inserted
"""

#: A message of the size the broker stores for the ``stamp`` actor.
MESSAGE = (
    '{"queue_name": "%s", "actor_name": "stamp", "args": [%r], "kwargs": {}, '
    '"options": {}, "message_id": "%s", "message_timestamp": %d}'
)


def latency(url: str, schema: str, count: int, gap: float, timeout: float = 60.0) -> dict:
    """p50 and p99 (ms) of ``count`` sends, ``gap`` seconds apart, to an idle consumer."""
    from .harness import BenchError, percentile

    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute(_q("DROP TABLE IF EXISTS {schema}.{table}", schema))
        setup.execute(
            _q("CREATE TABLE {schema}.{table} (LIKE {schema}.jobs INCLUDING ALL)", schema)
        )
    state = tempfile.mkdtemp(prefix="bench-floor-")
    out = os.path.join(state, "latency.txt")
    ready = os.path.join(state, "ready")
    args = [sys.executable, "-m", "benchmarks.floor", "consume", "--url", url,
            "--schema", schema, "--count", str(count), "--out", out, "--ready", ready]  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(args, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + timeout
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"the floor's consumer did not start: {_err(proc)}")
            time.sleep(0.02)
        time.sleep(1.0)  # as the broker's workload: let the consumer settle into its wait
        with psycopg.connect(url, autocommit=True) as conn:
            stmt = _q(SEND, schema).as_string(conn)
            for _ in range(count):
                job_id = str(uuid.uuid4())
                sent_at = time.time()
                message = MESSAGE % (QUEUE, sent_at, job_id, int(sent_at * 1000))
                conn.execute(stmt, (job_id, QUEUE, message, CHANNEL))
                time.sleep(gap)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise BenchError("the floor's consumer did not receive every message") from e
        if proc.returncode != 0:
            raise BenchError(f"the floor's consumer failed: {_err(proc)}")
        with open(out) as f:
            samples = sorted(float(line) for line in f if line.strip())
        if len(samples) < count:
            raise BenchError(f"only {len(samples)} of {count} floor samples arrived")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with psycopg.connect(url, autocommit=True) as setup:
            setup.execute(_q("DROP TABLE IF EXISTS {schema}.{table}", schema))
        for name in (out, ready):
            if os.path.exists(name):
                os.unlink(name)
        os.rmdir(state)
    return {"p50_ms": percentile(samples, 50) * 1000, "p99_ms": percentile(samples, 99) * 1000}


# -- a job's whole life, at the floor -------------------------------------------------------

LIFE_TABLE = "floor_life"
#: The floor's drain claims and deletes this many rows a statement.
LIFE_BATCH = 8

# The least a durable queue keeps of a job: its id (the primary key), its queue, a state,
# the claim order's columns and the message's bytes; and the claim index, which lists the
# queued rows only, so that a claimed row leaves it.
LIFE_TABLE_DDL = """
CREATE TABLE {schema}.{table} (
    id uuid PRIMARY KEY,
    queue_name text NOT NULL,
    status text NOT NULL DEFAULT 'queued',
    priority integer NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL DEFAULT now(),
    message bytea NOT NULL
)
"""
LIFE_INDEX_DDL = """
CREATE INDEX floor_life_claim_idx ON {schema}.{table} (queue_name, priority, available_at, id)
WHERE status = 'queued'
"""
LIFE_SEND = "INSERT INTO {schema}.{table} (id, queue_name, message) VALUES (%s, %s, %s)"
LIFE_CLAIM = """
UPDATE {schema}.{table} AS j SET status = 'running'
WHERE j.id IN (
    SELECT id FROM {schema}.{table}
    WHERE queue_name = %s AND status = 'queued' AND available_at <= now()
    ORDER BY priority, available_at, id
    LIMIT %s
    FOR UPDATE SKIP LOCKED
)
RETURNING j.id
"""
LIFE_DONE = "DELETE FROM {schema}.{table} WHERE id = ANY(%s)"


def life(url: str, schema: str, count: int, *, inspect: bool = True) -> dict:
    """The floor of a job's whole life, measured as the broker's is (:mod:`.cost`): WAL
    bytes and server CPU per job of ``count`` jobs.

    No framework: one connection sends each job with one autocommit ``INSERT`` of the
    message's bytes (Dramatiq's encoding of the ``noop`` actor's message) into a table with
    a primary key and a claim index (the send phase), then drains them 8 at a time, each
    batch an autocommit ``UPDATE`` to running (``FOR UPDATE SKIP LOCKED`` in claim order)
    and an autocommit ``DELETE`` of the 8 rows (the drain phase). Statements are prepared,
    as the broker's are. ``inspect``: read the WAL back (``pg_walinspect`` is there).
    Returns the figures of :func:`.cost.figures`, and under ``notes`` why a figure is
    missing, if one is."""
    import dramatiq

    from . import cost

    messages = [
        (str(uuid.uuid4()), dramatiq.Message(queue_name=QUEUE, actor_name="noop", args=(i,),
                                             kwargs={}, options={}).encode())
        for i in range(count)
    ]  # fmt: skip
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute(_q("DROP TABLE IF EXISTS {schema}.{table}", schema, LIFE_TABLE))
        setup.execute(_q(LIFE_TABLE_DDL, schema, LIFE_TABLE))
        setup.execute(_q(LIFE_INDEX_DDL, schema, LIFE_TABLE))
    phases: list[cost.Phase] = []
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            send = _q(LIFE_SEND, schema, LIFE_TABLE).as_string(conn)
            claim = _q(LIFE_CLAIM, schema, LIFE_TABLE).as_string(conn)
            done = _q(LIFE_DONE, schema, LIFE_TABLE).as_string(conn)
            meter = cost.Meter(url).start()
            for job_id, message in messages:
                conn.execute(send, (job_id, QUEUE, message), prepare=True)
            phases.append(sent := meter.stop())
            if inspect:
                cost.inspect(url, sent)
            meter = cost.Meter(url).start()
            drained = 0
            while True:
                ids = [row[0] for row in conn.execute(claim, (QUEUE, LIFE_BATCH), prepare=True)]
                if not ids:
                    break
                conn.execute(done, (ids,), prepare=True)
                drained += len(ids)
            phases.append(finished := meter.stop())
        if drained != count:
            from .harness import BenchError

            raise BenchError(f"the floor drained {drained} of {count} jobs")
        if inspect:
            cost.inspect(url, finished)
    finally:
        for phase in phases:
            phase.release()
        with psycopg.connect(url, autocommit=True) as setup:
            setup.execute(_q("DROP TABLE IF EXISTS {schema}.{table}", schema, LIFE_TABLE))
    return {**cost.figures(count, sent, finished), "notes": cost.notes(sent, finished)}


def _err(proc: subprocess.Popen) -> str:
    if proc.poll() is None or proc.stderr is None:
        return "no answer"
    tail = proc.stderr.read().decode(errors="replace").strip().splitlines()[-3:]
    return " | ".join(tail) or f"exit code {proc.returncode}"


def consume(url: str, schema: str, count: int, out: str, ready: str) -> None:
    """The consumer: LISTEN, claim one row per notification, hand it to a waiting thread,
    which writes ``received - sent`` (seconds) a line to ``out``; ends after ``count``."""
    handed: queue.Queue = queue.Queue()
    samples: list[float] = []

    def worker() -> None:
        while len(samples) < count:
            message = handed.get()
            samples.append(time.time() - message["args"][0])

    thread = threading.Thread(target=worker)
    thread.start()
    with (
        psycopg.connect(url, autocommit=True) as listen,
        psycopg.connect(url, autocommit=True) as conn,
    ):
        listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CHANNEL)))
        claim = _q(CLAIM, schema).as_string(conn)
        # Prepared, as the broker's statements are after their first uses.
        conn.execute(claim, (QUEUE,), prepare=True)
        open(ready, "w").close()
        claimed = 0
        while claimed < count:
            for _ in listen.notifies(timeout=1.0, stop_after=1):
                break
            while True:
                row = conn.execute(claim, (QUEUE,), prepare=True).fetchone()
                if row is None:
                    break
                handed.put(row[1])
                claimed += 1
                if claimed >= count:
                    break
                # Only more rows than notifications read (several sends between two
                # wakes) make a second claim; otherwise wait for the next notification.
                if not _pending(listen):
                    break
    thread.join()
    with open(out, "w") as f:
        f.write("".join(f"{s:.6f}\n" for s in samples))


def _pending(listen: psycopg.Connection) -> bool:
    """Whether a notification is waiting already (read without blocking)."""
    for _ in listen.notifies(timeout=0, stop_after=1):
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.floor")
    sub = p.add_subparsers(dest="step", required=True)
    c = sub.add_parser("consume")
    c.add_argument("--url", required=True)
    c.add_argument("--schema", required=True)
    c.add_argument("--count", type=int, required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--ready", required=True)
    lat = sub.add_parser("latency", help="measure the floor alone and print it as JSON")
    lat.add_argument("--url", required=True)
    lat.add_argument("--schema", default="bench")
    lat.add_argument("--count", type=int, default=300)
    lat.add_argument("--gap", type=float, default=0.01)
    args = p.parse_args(argv)
    if args.step == "consume":
        consume(args.url, args.schema, args.count, args.out, args.ready)
    else:
        json.dump(latency(args.url, args.schema, args.count, args.gap), sys.stdout)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
