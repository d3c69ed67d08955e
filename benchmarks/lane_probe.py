"""What a send pays for the hot table's lanes: ``python -m benchmarks.lane_probe``.

A send stores a message once per id: its statement looks for the id in ``jobs`` (and in
history) before it inserts, and since migration 0028 ``jobs`` is four lanes (LIST
partitions on ``lane``), each with its own key, so the look is four index probes where it
was one. This measures, in a schema of its own (``--schema``, which must not exist;
dropped at the end), the server's CPU time per single-row autocommit INSERT, as the
send's statement makes it, into two tables of the jobs table's shape cut down to what
matters (a uuid key, a claim index, a running index, a 300-byte message):

- ``plain``: one table, primary key ``id``: the hot table before the lanes;
- ``lanes``: LIST-partitioned into four lanes, primary key ``(id, lane)``, the lane a
  column default of the statement's time (as 0028's ``job_lane``);

each in three forms: the INSERT alone; with ``ON CONFLICT DO NOTHING``; and with the
send's look for the id first (``WHERE NOT EXISTS (SELECT 1 FROM t WHERE id = ...)``), plus
one more on the lanes: the lane given by the client instead of the default. Each form
runs ``--count`` statements on one connection that prepares them (as the broker's pool
does), in ``--rounds`` rounds, in turns (the order reversed every other round). The CPU
time is the backend's own (``/proc/<pid>/stat``: the server must run on this host), so
the client's share and the network are left out; the wall time per statement is shown
too. The table is emptied between forms.

    python -m benchmarks.lane_probe --count 10000 --rounds 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import psycopg
from psycopg import sql

TICK = os.sysconf("SC_CLK_TCK")

TABLES = """
CREATE FUNCTION {s}.lane_of(t timestamptz) RETURNS smallint
LANGUAGE sql STABLE PARALLEL SAFE
AS 'SELECT (floor(extract(epoch FROM t) / 10)::bigint % 3)::smallint';
CREATE TABLE {s}.plain (
    id uuid PRIMARY KEY, queue_name text NOT NULL, priority int NOT NULL,
    available_at timestamptz NOT NULL, status text NOT NULL, message_bytes bytea
);
CREATE INDEX ON {s}.plain (queue_name, priority, available_at) WHERE status = 'queued';
CREATE INDEX ON {s}.plain (available_at) WHERE status = 'running';
CREATE TABLE {s}.lanes (
    id uuid NOT NULL, queue_name text NOT NULL, priority int NOT NULL,
    available_at timestamptz NOT NULL, status text NOT NULL, message_bytes bytea,
    lane smallint NOT NULL DEFAULT {s}.lane_of(statement_timestamp())
) PARTITION BY LIST (lane);
CREATE TABLE {s}.lanes_0 PARTITION OF {s}.lanes FOR VALUES IN (0);
CREATE TABLE {s}.lanes_1 PARTITION OF {s}.lanes FOR VALUES IN (1);
CREATE TABLE {s}.lanes_2 PARTITION OF {s}.lanes FOR VALUES IN (2);
CREATE TABLE {s}.lanes_3 PARTITION OF {s}.lanes FOR VALUES IN (3);
ALTER TABLE {s}.lanes ADD PRIMARY KEY (id, lane);
CREATE INDEX ON {s}.lanes (queue_name, priority, available_at) WHERE status = 'queued';
CREATE INDEX ON {s}.lanes (available_at) WHERE status = 'running';
"""

#: Each form: (table, the look for the id first, ON CONFLICT DO NOTHING, the lane given).
FORMS = {
    "plain: insert": ("plain", False, False, False),
    "plain: + on conflict": ("plain", False, True, False),
    "plain: + look for the id (the send)": ("plain", True, True, False),
    "lanes: insert": ("lanes", False, False, False),
    "lanes: + on conflict": ("lanes", False, True, False),
    "lanes: + look for the id (the send)": ("lanes", True, True, False),
    "lanes: the send, lane given": ("lanes", True, True, True),
}


def statement(schema: str, table: str, look: bool, conflict: bool, lane: bool) -> sql.Composed:
    target = sql.Identifier(schema, table)
    text = (
        "INSERT INTO {t} (id, queue_name, priority, available_at, status, message_bytes"
        + (", lane" if lane else "")
        + ") SELECT %(id)s, 'default', 0, now(), 'queued', %(body)s"
        + (", %(lane)s::smallint" if lane else "")
    )
    if look:
        text += " WHERE NOT EXISTS (SELECT 1 FROM {t} AS o WHERE o.id = %(id)s)"
    if conflict:
        text += " ON CONFLICT DO NOTHING"
    return sql.SQL(text).format(t=target)


def backend_cpu(conn: psycopg.Connection) -> float:
    """The connection's backend's CPU time so far, in seconds (user and system)."""
    with open(f"/proc/{conn.info.backend_pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def run_form(conn, schema: str, form: tuple, count: int) -> tuple[float, float]:
    """CPU and wall microseconds per statement for ``count`` statements of ``form``."""
    table, look, conflict, lane = form
    query = statement(schema, table, look, conflict, lane)
    body = os.urandom(300)
    cpu0, wall0 = backend_cpu(conn), time.perf_counter()
    for _ in range(count):
        params = {"id": uuid.uuid4(), "body": body, "lane": int(time.time() // 10) % 3}
        conn.execute(query, params, prepare=True)
    wall, cpu = time.perf_counter() - wall0, backend_cpu(conn) - cpu0
    conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(schema, table)))
    return cpu / count * 1e6, wall / count * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000, help="statements per form")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--url",
        default=os.environ.get("DRAMATIQ_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"),
    )
    parser.add_argument("--schema", default="bench_lane_probe")
    args = parser.parse_args(argv)
    s = sql.Identifier(args.schema)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in FORMS}
    with psycopg.connect(args.url, autocommit=True) as conn:
        exists = "SELECT 1 FROM pg_namespace WHERE nspname = %s"
        if conn.execute(exists, (args.schema,)).fetchone():
            parser.error(f"schema {args.schema!r} exists: name one of its own (--schema)")
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
        try:
            conn.execute(sql.SQL(TABLES).format(s=s))
            names = list(FORMS)
            for n in range(args.rounds):
                for name in names if n % 2 == 0 else names[::-1]:
                    results[name].append(run_form(conn, args.schema, FORMS[name], args.count))
                print(f"round {n + 1} of {args.rounds} done", flush=True)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(s))
    print(f"\nserver CPU per statement, µs ({args.count:,} a round; rounds, then median) | wall")
    for name, runs in results.items():
        cpu = [round(c) for c, _ in runs]
        wall = statistics.median(w for _, w in runs)
        print(f"{name:38} {cpu} -> {statistics.median(cpu):.0f} | {wall:.0f}")


if __name__ == "__main__":
    main()
