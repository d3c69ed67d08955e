-- Named statements of `migrate` (dramatiq_pg_broker.migrate): what it looks at before a
-- breaking migration. They read the tables as every release since 0.1.0 has them (a
-- database about to take a breaking migration is still at the earlier release's schema).
-- A lease's owner is `host:pid` of its locked_by (`host:pid:thread:random` before migration
-- 0022, `host:pid:random:L<schema level>` from it on); a registered worker's is `host:pid` of
-- its row. Work counts as live unless its code's schema level is %(level)s or more: the
-- level its owner ends with, or the level of a live registered worker of that `host:pid`.

-- registered_workers --
-- The live workers of the registry (migration 0011), by owner, with the schema level of
-- their code (migration 0022).
SELECT host || ':' || pid, schema_level
FROM {schema}.workers
WHERE expires_at > now()

-- registered_workers_before_0022 --
-- The same for a schema without the level (workers of builds before 0022 record none).
SELECT host || ':' || pid, NULL::integer
FROM {schema}.workers
WHERE expires_at > now()

-- live_leases --
-- Running jobs whose lease is live, by owner, except those of code of schema level
-- %(level)s or more (the owners in %(safe)s, or the level the owner ends with): how many,
-- and seconds since the oldest attempt started and until the last lease expires.
SELECT split_part(locked_by, ':', 1) || ':' || split_part(locked_by, ':', 2) AS owner,
       count(*),
       extract(epoch FROM now() - min(started_at))::float8,
       extract(epoch FROM max(locked_until) - now())::float8
FROM {schema}.jobs
WHERE status = 'running'
  AND locked_until > now()
  AND split_part(locked_by, ':', 1) || ':' || split_part(locked_by, ':', 2) <> ALL(%(safe)s)
  AND coalesce(substring(locked_by FROM ':L([0-9]+)$')::integer, 0) < %(level)s
GROUP BY 1
ORDER BY 2 DESC, 1

-- recent_sends --
-- Jobs created in the last %(window)s seconds, and seconds since the latest (through the
-- created_at index).
SELECT count(*), extract(epoch FROM now() - max(created_at))::float8
FROM {schema}.jobs
WHERE created_at > now() - %(window)s * interval '1 second'

-- recent_claims --
-- Attempts started in the last %(window)s seconds, except those still owned by code of
-- schema level %(level)s or more (as live_leases), and seconds since the latest.
SELECT count(*), extract(epoch FROM now() - max(started_at))::float8
FROM {schema}.jobs
WHERE started_at > now() - %(window)s * interval '1 second'
  AND (locked_by IS NULL
       OR (split_part(locked_by, ':', 1) || ':' || split_part(locked_by, ':', 2)
               <> ALL(%(safe)s)
           AND coalesce(substring(locked_by FROM ':L([0-9]+)$')::integer, 0) < %(level)s))

-- lock_holders --
-- Who may keep a migration waiting for a lock: every other session holding a lock on a
-- relation of the schema %(schema)s that is idle in its transaction, in a transaction begun
-- %(brief_ms)s ms ago or more, not a client (autovacuum), or a prepared transaction (no
-- session); one row each (its first relation by name), with the lock's mode, the
-- session's state, its transaction's age in seconds and the start of its last statement.
-- A session seen idle has just ended the transaction that held the lock: not a holder.
SELECT DISTINCT ON (l.pid) l.pid, c.relname::text, l.mode, a.state, a.backend_type,
       extract(epoch FROM clock_timestamp() - a.xact_start)::float8,
       left(regexp_replace(a.query, '\s+', ' ', 'g'), 80)
FROM pg_locks AS l
JOIN pg_class AS c ON c.oid = l.relation
LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'relation'
  AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND c.relnamespace = to_regnamespace(%(schema)s)
  AND l.pid IS DISTINCT FROM pg_backend_pid()
  AND a.state IS DISTINCT FROM 'idle'
  AND (a.pid IS NULL OR a.state IS DISTINCT FROM 'active'
       OR a.backend_type IS DISTINCT FROM 'client backend'
       OR a.xact_start < clock_timestamp() - %(brief_ms)s * interval '1 millisecond')
ORDER BY l.pid, c.relname

-- blocking_sessions --
-- Whoever the session %(pid)s (a migration run outside a transaction) waits for now, with
-- the same columns as lock_holders (the relation: one it holds a lock on, if any).
SELECT b.pid, c.relname::text, l.mode, a.state, a.backend_type,
       extract(epoch FROM clock_timestamp() - a.xact_start)::float8,
       left(regexp_replace(a.query, '\s+', ' ', 'g'), 80)
FROM unnest(pg_blocking_pids(%(pid)s)) AS b(pid)
LEFT JOIN pg_stat_activity AS a ON a.pid = b.pid
LEFT JOIN LATERAL (
    SELECT l.relation, l.mode FROM pg_locks AS l
    WHERE l.pid = b.pid AND l.locktype = 'relation' AND l.granted
    ORDER BY l.relation LIMIT 1
) AS l ON true
LEFT JOIN pg_class AS c ON c.oid = l.relation

-- invalid_indexes --
-- The invalid indexes of the schema %(schema)s (a CREATE INDEX CONCURRENTLY that failed
-- leaves one), by name.
SELECT c.relname::text
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE c.relnamespace = to_regnamespace(%(schema)s) AND NOT i.indisvalid

-- schema_relations --
-- The tables and views of the schema %(schema)s (a partitioned table once: its partitions
-- are locked with it), by name: what a transaction of several migrations may lock at its
-- start (see migrate.py, _lock_unit).
SELECT c.relname
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p', 'v', 'm') AND NOT c.relispartition
ORDER BY c.relname
