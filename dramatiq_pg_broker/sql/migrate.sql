-- Named statements of `migrate` (dramatiq_pg_broker.migrate): what it looks at before a
-- breaking migration. They read the tables as every release since 0.1.0 has them (a
-- database about to take a breaking migration is still at the earlier release's schema).
-- A lease's owner is `host:pid` of its locked_by (`host:pid:thread:random`); a registered
-- worker's is `host:pid` of its row.

-- registered_workers --
-- The live workers of the registry (migration 0011), by owner, with their release.
SELECT host || ':' || pid, version
FROM {schema}.workers
WHERE expires_at > now()

-- live_leases --
-- Running jobs whose lease is live, by owner, except the owners in %(safe)s: how many, and
-- seconds since the oldest attempt started and until the last lease expires.
SELECT split_part(locked_by, ':', 1) || ':' || split_part(locked_by, ':', 2) AS owner,
       count(*),
       extract(epoch FROM now() - min(started_at))::float8,
       extract(epoch FROM max(locked_until) - now())::float8
FROM {schema}.jobs
WHERE status = 'running'
  AND locked_until > now()
  AND split_part(locked_by, ':', 1) || ':' || split_part(locked_by, ':', 2) <> ALL(%(safe)s)
GROUP BY 1
ORDER BY 2 DESC, 1

-- recent_sends --
-- Jobs created in the last %(window)s seconds, and seconds since the latest (through the
-- created_at index).
SELECT count(*), extract(epoch FROM now() - max(created_at))::float8
FROM {schema}.jobs
WHERE created_at > now() - %(window)s * interval '1 second'

-- recent_claims --
-- Attempts started in the last %(window)s seconds, except those still owned by an owner in
-- %(safe)s, and seconds since the latest.
SELECT count(*), extract(epoch FROM now() - max(started_at))::float8
FROM {schema}.jobs
WHERE started_at > now() - %(window)s * interval '1 second'
  AND (locked_by IS NULL
       OR split_part(locked_by, ':', 1) || ':' || split_part(locked_by, ':', 2) <> ALL(%(safe)s))
