"""Database chores of the benchmark: fresh schemas, bulk-loaded rows, the raw insert limit.

Rows are bulk-loaded with ``INSERT ... SELECT generate_series`` in the exact shape
``PostgresBroker.enqueue`` stores (a Dramatiq message as jsonb, a ``created`` event when
events are on), so a worker cannot tell them from sent messages.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from dramatiq_pg_broker.jobs import channel_name
from dramatiq_pg_broker.migrate import migrate

from .actors import QUEUE


def reset_schema(url: str, schema: str) -> None:
    """Drop the schema and migrate it again from nothing."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    migrate(url, schema)


def drop_schema(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _q(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(schema))


#: The tables that hold jobs and their events (those an earlier release lacks are skipped).
JOB_TABLES = ("job_events", "jobs", "jobs_history", "job_keys")


def existing_tables(conn: psycopg.Connection, schema: str, names=JOB_TABLES) -> list[str]:
    """Those of ``names`` that exist in ``schema`` (an earlier release's schema, measured
    with ``--against``, has fewer tables)."""
    return [
        name
        for name in names
        if conn.execute("SELECT to_regclass(%s)", (f"{schema}.{name}",)).fetchone()[0]
    ]


def empty(url: str, schema: str) -> None:
    """Remove every job and event (the empty-table state)."""
    with psycopg.connect(url, autocommit=True) as conn:
        # No ANALYZE here: statistics saying "empty" would make every session that starts
        # now plan the job_events foreign-key check (cached for the session) as a
        # sequential scan of jobs, which a real, long-lived table never sees.
        tables = sql.SQL(", ").join(
            sql.Identifier(schema, name) for name in existing_tables(conn, schema)
        )
        conn.execute(sql.SQL("TRUNCATE {} CASCADE").format(tables))


# Finished jobs live in history (migration 0012), unfinished ones in jobs: {table}.
_INSERT_JOBS = """
INSERT INTO {schema}.{table} AS j (
    id, queue_name, actor_name, message, status, priority, available_at, attempts,
    max_attempts, created_at, updated_at, started_at, finished_at)
SELECT n.id, %(queue)s::text, 'noop',
       jsonb_build_object(
           'queue_name', %(queue)s::text, 'actor_name', 'noop', 'args', jsonb_build_array(n.g),
           'kwargs', '{{}}'::jsonb, 'options', '{{}}'::jsonb, 'message_id', n.id::text,
           'message_timestamp', (extract(epoch FROM now()) * 1000)::bigint),
       %(status)s::text, 0,
       now() + %(delay_s)s::float8 * interval '1 second',
       CASE WHEN %(status)s::text = 'succeeded' THEN 1 ELSE 0 END,
       1,
       now() - interval '1 hour' + n.g * interval '1 microsecond',
       now(),
       CASE WHEN %(status)s::text = 'succeeded'
            THEN now() - %(finished_ago_s)s::float8 * interval '1 second' END,
       CASE WHEN %(status)s::text = 'succeeded'
            THEN now() - %(finished_ago_s)s::float8 * interval '1 second' END
FROM (SELECT gen_random_uuid() AS id, g FROM generate_series(1, %(count)s::int) AS g) AS n
"""

_EVENTS_FROM_NEW = """
INSERT INTO {schema}.job_events (job_id, type, attempt, actor, created_at)
SELECT new.id, t.type, t.attempt, t.actor, new.created_at
FROM new
CROSS JOIN LATERAL (VALUES ('created', 0, NULL), ('claimed', 1, 'bench:0:0:0'),
                           ('succeeded', 1, 'bench:0:0:0')) AS t (type, attempt, actor)
WHERE t.type = 'created' OR new.status = 'succeeded'
"""
# The jobs and their events in one statement.
_INSERT_EVENTS = (
    "WITH new AS (" + _INSERT_JOBS + " RETURNING j.id, j.status, j.created_at)" + _EVENTS_FROM_NEW
)


def load(
    url: str,
    schema: str,
    count: int,
    *,
    status: str = "queued",
    delay_s: float = -1.0,
    events: bool = True,
    queue: str = QUEUE,
    finished_ago_s: float = 0.0,
    vacuum: bool = True,
    notify: bool = False,
) -> float:
    """Insert ``count`` jobs of the benchmark's ``noop`` actor; returns seconds taken.

    ``status`` is ``queued`` (runnable after ``delay_s``; negative means already due) or
    ``succeeded`` (finished history, with its created/claimed/succeeded events, finished
    ``finished_ago_s`` seconds ago). ``vacuum``: VACUUM ANALYZE both tables afterwards.
    ``notify``: wake the queue's listening workers at commit, as a send does.
    """
    started = time.perf_counter()
    params = {
        "queue": queue,
        "status": status,
        "delay_s": delay_s,
        "count": count,
        "finished_ago_s": finished_ago_s,
    }
    table = "jobs" if status in ("queued", "running") else "jobs_history"
    statement = sql.SQL(_INSERT_EVENTS if events else _INSERT_JOBS).format(
        schema=sql.Identifier(schema), table=sql.Identifier(table)
    )
    with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
        conn.execute(statement, params)
        if notify:
            conn.execute("SELECT pg_notify(%s, '')", (channel_name(schema, queue),))
    if not vacuum:
        return time.perf_counter() - started
    with psycopg.connect(url, autocommit=True) as conn:
        # What autovacuum would do soon after such a load: statistics and visibility map.
        for name in existing_tables(conn, schema, ("jobs", "jobs_history", "job_events")):
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, name)))
    return time.perf_counter() - started


def delete_unfinished(url: str, schema: str, queue: str = QUEUE) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            _q(
                "DELETE FROM {schema}.jobs WHERE queue_name = %s AND status IN "
                "('queued', 'running')",
                schema,
            ),
            (queue,),
        )


def count_unfinished(url: str, schema: str, queue: str = QUEUE) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            _q(
                "SELECT count(*) FROM {schema}.jobs WHERE queue_name = %s "
                "AND status IN ('queued', 'running')",
                schema,
            ),
            (queue,),
        ).fetchone()[0]


def raw_insert_rate(
    url: str, schema: str, count: int, warmup: int = 200, *, autocommit: bool = False
) -> float:
    """The durable limit: one INSERT and COMMIT per row on one connection, into a table
    shaped like the jobs table (same columns, constraints and indexes).

    ``autocommit=False`` is the issue's definition taken literally and psycopg's default:
    ``execute(INSERT)`` then ``commit()``, two round trips per row. ``autocommit=True`` is
    the stricter floor: the INSERT is its own transaction, one round trip per row (the
    same shape as this broker's send, which is one statement in autocommit mode)."""
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute(_q("DROP TABLE IF EXISTS {schema}.raw_jobs", schema))
        setup.execute(
            _q(
                "CREATE TABLE {schema}.raw_jobs (LIKE {schema}.jobs INCLUDING DEFAULTS "
                "INCLUDING CONSTRAINTS INCLUDING INDEXES)",
                schema,
            )
        )
    with psycopg.connect(url, autocommit=autocommit) as conn:
        stmt = _q(
            "INSERT INTO {schema}.raw_jobs (id, queue_name, actor_name, message, priority, "
            "available_at, max_attempts, created_at, updated_at, status) "
            "VALUES (%s, %s, 'noop', %s::jsonb, 0, now(), 1, now(), now(), 'queued')",
            schema,
        ).as_string(conn)
        message = (
            '{"queue_name": "%s", "actor_name": "noop", "args": [%d], "kwargs": {}, '
            '"options": {}, "message_id": "%s", "message_timestamp": %d}'
        )

        def one(i: int) -> None:
            job_id = str(uuid.uuid4())
            now_ms = int(time.time() * 1000)
            conn.execute(stmt, (job_id, QUEUE, message % (QUEUE, i, job_id, now_ms)))
            if not autocommit:
                conn.commit()

        for i in range(warmup):
            one(i)
        started = time.perf_counter()
        for i in range(count):
            one(i)
        seconds = time.perf_counter() - started
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute(_q("DROP TABLE {schema}.raw_jobs", schema))
    return count / seconds


def raw_copy_rate(url: str, schema: str, count: int) -> float:
    """The bulk limit: the same messages a bulk enqueue stores, encoded with Dramatiq's JSON
    encoder and written with one binary ``COPY`` into a plain table with the job row's
    columns (no index, no constraint, no event), committed. Building the messages is not
    timed (as for the bulk enqueue); encoding them is, since the broker must too."""
    import dramatiq

    messages = [
        dramatiq.Message(queue_name=QUEUE, actor_name="noop", args=(i,), kwargs={}, options={})
        for i in range(count)
    ]
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute(_q("DROP TABLE IF EXISTS {schema}.raw_copy", schema))
        # Defaults included: the job row has NOT NULL columns that this COPY leaves out.
        setup.execute(
            _q("CREATE TABLE {schema}.raw_copy (LIKE {schema}.jobs INCLUDING DEFAULTS)", schema)
        )
    with psycopg.connect(url) as conn:
        stmt = _q(
            "COPY {schema}.raw_copy (id, queue_name, actor_name, message_bytes, status, "
            "priority, available_at, attempts, max_attempts, idempotency_scope, created_at, "
            "updated_at) FROM STDIN (FORMAT BINARY)",
            schema,
        )
        types = ["uuid", "text", "text", "bytea", "text", "int4", "timestamptz", "int4", "int4",
                 "text", "timestamptz", "timestamptz"]  # fmt: skip
        started = time.perf_counter()
        now = conn.execute("SELECT now()").fetchone()[0]
        with conn.cursor().copy(stmt) as copy:
            copy.set_types(types)
            for m in messages:
                copy.write_row((uuid.UUID(m.message_id), m.queue_name, m.actor_name, m.encode(),
                                "queued", 0, now, 0, 1, "", now, now))  # fmt: skip
        conn.commit()
        seconds = time.perf_counter() - started
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute(_q("DROP TABLE {schema}.raw_copy", schema))
    return count / seconds


def server_version(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SHOW server_version").fetchone()[0]


# -- watching the server while workers run --------------------------------------------------

#: Connections one worker process of the benchmark opens (measured: its pool's claims,
#: outcomes and leases, and one LISTEN connection), and connections left to other sessions:
#: a step that would leave fewer is not run, so as not to exhaust a shared server.
CONNECTIONS_PER_PROCESS = 4
CONNECTIONS_LEFT = 20


def free_connections(url: str) -> int:
    """Connections the server can still accept from ordinary roles."""
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            "SELECT current_setting('max_connections')::int "
            "- current_setting('superuser_reserved_connections')::int "
            "- (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
        ).fetchone()[0]


def deadlocks(url: str, *, settle_app: str | None = None, timeout: float = 30.0) -> int:
    """The database's deadlock counter. With ``settle_app``, first wait until no backend
    with that application name is left (a backend reports its counters on exit)."""
    with psycopg.connect(url, autocommit=True) as conn:
        deadline = time.monotonic() + timeout
        while settle_app is not None and time.monotonic() < deadline:
            left = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                (settle_app,),
            ).fetchone()[0]
            if not left:
                break
            time.sleep(0.1)
        return conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()[0]


_SAMPLE = """
SELECT
    (SELECT count(*) FROM {schema}.jobs WHERE queue_name = %(queue)s
        AND status IN ('queued', 'running')),
    (SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE NOT l.granted AND a.application_name = %(app)s),
    (SELECT count(*) FROM pg_stat_activity WHERE application_name = %(app)s)
"""


class Sampler(threading.Thread):
    """Samples, every 50 ms until stopped: the unfinished jobs of the benchmark queue, the
    workers' backends waiting for a lock (``pg_locks``), their server-side connections
    (``pg_stat_activity``, by application name) and, through a pooler, its client
    connections (every 0.5 s, from PgBouncer's ``SHOW CLIENTS``)."""

    def __init__(self, url: str, schema: str, app: str, *, pooler=None) -> None:
        super().__init__(daemon=True, name="bench-sampler")
        self.url = url
        self.schema = schema
        self.app = app
        self.pooler = pooler
        self.unfinished: int | None = None
        self.samples = 0
        self.waiting_samples = 0
        self.max_waiters = 0
        self.max_connections = 0
        self.max_clients = 0
        self.error: str | None = None
        self._halt = threading.Event()

    @property
    def lock_wait_share(self) -> float:
        """The share of samples in which at least one worker backend waited for a lock."""
        return self.waiting_samples / self.samples if self.samples else 0.0

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                stmt = _q(_SAMPLE, self.schema)
                last_clients = 0.0
                while not self._halt.is_set():
                    unfinished, waiting, connections = conn.execute(
                        stmt, {"queue": QUEUE, "app": self.app}
                    ).fetchone()
                    self.samples += 1
                    self.waiting_samples += 1 if waiting else 0
                    self.max_waiters = max(self.max_waiters, waiting)
                    self.max_connections = max(self.max_connections, connections)
                    if self.pooler is not None and time.monotonic() - last_clients > 0.5:
                        last_clients = time.monotonic()
                        self.max_clients = max(self.max_clients, self.pooler.client_connections())
                    self.unfinished = unfinished
                    self._halt.wait(0.05)
        except Exception as e:  # reported by the harness
            self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(10)


def drain_outcome(url: str, schema: str, queue: str = QUEUE) -> dict:
    """Succeeded jobs of the queue, claims made (``claimed`` events), and the server's
    time from the first claim to the last outcome."""
    succeeded, seconds = _one(
        url,
        "SELECT count(*) FILTER (WHERE status = 'succeeded'), "
        "extract(epoch FROM max(finished_at) - min(started_at))::float8 "
        "FROM {schema}.all_jobs WHERE queue_name = %s",
        schema,
        (queue,),
    )
    (claims,) = _one(
        url, "SELECT count(*) FROM {schema}.job_events WHERE type = 'claimed'", schema, ()
    )
    return {"succeeded": succeeded, "seconds": seconds, "claims": claims}


# -- a database of its own (the idle-cost workload) ------------------------------------------


def create_database(url: str, name: str) -> str:
    """Create the database ``name`` afresh on the server of ``url``; returns its URL."""
    drop_database(url, name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
    return make_conninfo(url, dbname=name)


def drop_database(url: str, name: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def server_settings(url: str, names) -> dict[str, str]:
    """The server's values of ``names`` (``SHOW``), recorded with the results."""
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        return {
            name: conn.execute(
                "SELECT setting || coalesce(unit, '') FROM pg_settings WHERE name = %s", (name,)
            ).fetchone()[0]
            for name in names
        }


def server_now(url: str) -> dt.datetime:
    """The server's clock."""
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT now()").fetchone()[0]


def finished_between(
    url: str, schema: str, start: dt.datetime, end: dt.datetime, *, delay_s: float = -1.0
) -> tuple[int, float]:
    """The jobs that finished in [start, end), and the 99th percentile of their wait from
    their insert to their claim, in milliseconds (0 without jobs). The jobs were loaded by
    :func:`load` with ``delay_s`` (runnable that long after their insert; its
    ``created_at`` is made up), so the wait is ``started_at - available_at + delay_s``."""
    count, p99 = _one(
        url,
        "SELECT count(*), percentile_cont(0.99) WITHIN GROUP (ORDER BY "
        "(extract(epoch FROM started_at - available_at) + %s) * 1000) "
        "FROM {schema}.jobs_history WHERE finished_at >= %s AND finished_at < %s",
        schema,
        (delay_s, start, end),
    )
    return int(count), float(p99 or 0.0)


def _one(url: str, text: str, schema: str, params: tuple) -> tuple:
    """The one row of a statement on the schema's tables, on a connection of its own."""
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(_q(text, schema), params).fetchone()


def table_sizes(url: str, schema: str) -> dict[str, int]:
    """Bytes on disk of each job table, its indexes and TOAST included; a partitioned
    table (history, events: migration 0012) with all its partitions."""
    with psycopg.connect(url, autocommit=True) as conn:
        return {
            table: conn.execute(
                "SELECT CASE WHEN c.relkind = 'p' THEN (SELECT coalesce(sum("
                "pg_total_relation_size(t.relid)), 0) FROM pg_partition_tree(c.oid) AS t) "
                "ELSE pg_total_relation_size(c.oid) END::bigint "
                "FROM pg_class AS c WHERE c.oid = %s::regclass",
                (f"{schema}.{table}",),
            ).fetchone()[0]
            for table in ("jobs", "jobs_history", "job_events")
        }


def history_partitions(conn, schema: str, *, days_back: int, days_ahead: int = 7) -> int:
    """Create the daily partitions of history and events from ``days_back`` days ago to
    ``days_ahead`` days ahead (those missing), as the workers' retention runs do."""
    from dramatiq_pg_broker.retention import create_partitions

    (now,) = conn.execute("SELECT now()").fetchone()
    return create_partitions(
        conn, schema, now - dt.timedelta(days=days_back), days_back + days_ahead
    )


#: A table, or the leaf partitions of a partitioned one (a partitioned hot table).
_LEAVES = (
    "SELECT relid FROM pg_partition_tree(%(t)s::regclass) WHERE isleaf UNION SELECT %(t)s::regclass"
)


def dead_rows(url: str, schema: str, table: str) -> int:
    """The table's dead rows, by the statistics collector (``n_dead_tup``): a partitioned
    table's (a partitioned hot table) summed over its partitions."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE relid IN ("
            "SELECT relid FROM pg_partition_tree(%(t)s::regclass) WHERE isleaf"
            " UNION SELECT %(t)s::regclass)",
            {"t": f'"{schema}"."{table}"'},
        ).fetchone()
    return row[0] if row else 0


def autovacuum_on(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SHOW autovacuum").fetchone()[0] == "on"


def vacuum(url: str, schema: str) -> None:
    """A plain VACUUM of the job tables (no lock that blocks reads or writes)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(_q("VACUUM {schema}.jobs", schema))
        conn.execute(_q("VACUUM {schema}.job_events", schema))


def vacuum_count(url: str, schema: str, table: str) -> int:
    """How many times the table was vacuumed, by autovacuum or by hand."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(autovacuum_count + vacuum_count), 0) FROM pg_stat_user_tables "
            "WHERE relid IN (SELECT relid FROM pg_partition_tree(%(t)s::regclass) WHERE isleaf"
            " UNION SELECT %(t)s::regclass)",
            {"t": f'"{schema}"."{table}"'},
        ).fetchone()
    return row[0] if row else 0


def set_table_options(url: str, schema: str, table: str, options: str) -> None:
    """``ALTER TABLE ... SET (options)``, on each leaf of a partitioned table; ``options``
    is ``name=value`` pairs separated by
    commas (names and values checked: letters, digits, underscores, dots)."""
    pairs = []
    for item in options.split(","):
        name, _, value = item.strip().partition("=")
        if not name.replace("_", "").isalnum() or not value.replace(".", "").isalnum():
            raise ValueError(f"not a storage parameter: {item!r}")
        pairs.append(sql.SQL("{} = {}").format(sql.SQL(name), sql.Literal(value)))
    with psycopg.connect(url, autocommit=True) as conn:
        # A partitioned table (jobs since 0028) holds no storage parameter: its leaves do.
        leaves = [
            r[0]
            for r in conn.execute(
                "SELECT c.relname FROM pg_partition_tree(to_regclass(%s)) AS p"
                " JOIN pg_class AS c ON c.oid = p.relid WHERE p.isleaf",
                (f'"{schema}"."{table}"',),
            )
        ]
        for leaf in leaves or [table]:
            conn.execute(
                sql.SQL("ALTER TABLE {}.{} SET ({})").format(
                    sql.Identifier(schema), sql.Identifier(leaf), sql.SQL(", ").join(pairs)
                )
            )
