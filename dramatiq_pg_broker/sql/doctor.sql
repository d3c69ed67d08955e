-- Named statements of `dramatiq-pg-broker doctor` (dramatiq_pg_broker.health.doctor): what
-- the server says about the database around the broker's tables. Same layout as
-- queries.sql. Every statement reads the server's statistics views or a partial index of
-- the jobs table; none takes a lock a worker waits for.

-- snapshot_holders --
-- Who holds this database's xmin horizon back, oldest first (by transaction age): vacuum
-- removes no row version that died after the oldest of them. Sessions of this database
-- (or of none: a walsender with hot_standby_feedback holds every database) with a
-- snapshot or a transaction id; prepared transactions of this database; replication
-- slots with an xmin (a physical slot fed by hot_standby_feedback, or a logical slot's
-- own). Autovacuum workers are left out: vacuum ignores their snapshots. A session's age
-- is its transaction's (or, outside one, its statement's); a slot has none in seconds,
-- nor has a walsender (its "statement" is the replication stream, open for days while
-- the standby's feedback moves its xmin on): both are judged by their age in transactions.
-- Holders of the same horizon come longest held first: an open transaction that wrote
-- holds the horizon at its own id, and every snapshot taken since has that id as its
-- xmin (a worker's claim of a moment ago ties with it).
SELECT kind, pid, application_name, usename, client, state, age_seconds, xmin_age, query
FROM (
    SELECT 'session' AS kind, a.pid, a.application_name, a.usename::text AS usename,
           a.client_addr::text AS client, a.state,
           CASE WHEN a.backend_type IS DISTINCT FROM 'walsender' THEN
               extract(epoch FROM now() - coalesce(a.xact_start, a.query_start, a.backend_start))
                   ::float8
           END AS age_seconds,
           age(coalesce(a.backend_xmin, a.backend_xid))::bigint AS xmin_age,
           left(a.query, %(query_chars)s) AS query
    FROM pg_stat_activity AS a
    WHERE coalesce(a.backend_xmin, a.backend_xid) IS NOT NULL
      AND a.pid <> pg_backend_pid()
      AND (a.datid IS NULL OR a.datname = current_database())
      AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
    UNION ALL
    SELECT 'prepared transaction', NULL, NULL, p.owner::text, NULL, 'prepared',
           extract(epoch FROM now() - p.prepared)::float8, age(p.transaction)::bigint, p.gid
    FROM pg_prepared_xacts AS p
    WHERE p.database = current_database()
    UNION ALL
    SELECT 'replication slot', s.active_pid, s.slot_name, NULL, NULL,
           CASE WHEN s.active THEN 'active' ELSE 'inactive' END, NULL, age(s.xmin)::bigint,
           s.slot_type
    FROM pg_replication_slots AS s
    WHERE s.xmin IS NOT NULL AND (s.database IS NULL OR s.database = current_database())
) AS holders
ORDER BY xmin_age DESC, age_seconds DESC NULLS LAST
LIMIT %(limit)s

-- hot_table --
-- The jobs table as the statistics collector and the catalog see it, summed over its
-- lanes (0028; a table before it is its own one leaf): live and dead row versions, its
-- size (the heap alone, and with its indexes and TOAST), when a vacuum last ran on any of
-- them (autovacuum or by hand), the long lane's autovacuum storage parameters (the one
-- lane only vacuum keeps small; the same as the others'), whether autovacuum
-- runs at all on this server, and how often it visits each database (autovacuum_naptime,
-- in seconds). A lane emptied by TRUNCATE counts no dead row from then on.
SELECT sum(t.n_live_tup)::bigint, sum(t.n_dead_tup)::bigint,
       sum(pg_relation_size(t.relid))::bigint, sum(pg_total_relation_size(t.relid))::bigint,
       max(t.last_autovacuum), max(t.last_vacuum), sum(t.autovacuum_count)::bigint,
       extract(epoch FROM now() - greatest(max(t.last_autovacuum), max(t.last_vacuum)))::float8,
       (SELECT o.reloptions FROM pg_class AS o
        WHERE o.oid = coalesce(to_regclass(format('%%I.jobs_lane_long', %(schema)s::text)),
                               to_regclass(format('%%I.jobs', %(schema)s::text)))),
       current_setting('autovacuum')::boolean,
       extract(epoch FROM current_setting('autovacuum_naptime')::interval)::float8
FROM pg_partition_tree(to_regclass(format('%%I.jobs', %(schema)s::text))) AS p
JOIN pg_stat_user_tables AS t ON t.relid = p.relid
WHERE p.isleaf
HAVING count(*) > 0

-- job_lanes_exist --
-- Whether the schema has the lanes of 0028 (job_lanes).
SELECT to_regclass(format('%%I.job_lanes', %(schema)s::text)) IS NOT NULL

-- job_lanes --
-- Each lane of jobs (0028): seconds since the workers last emptied it (NULL: never), and
-- why their last try did not (NULL: it did, or none was due).
SELECT lane, extract(epoch FROM now() - emptied_at)::float8, left_because
FROM {schema}.job_lanes
ORDER BY lane

-- connections --
-- The server's connection slots: client backends now (the package's own, named
-- dramatiq-pg-broker/<pid> and, the admin API's, dramatiq-pg-admin/<pid>, among them),
-- max_connections, and the slots reserved for superusers (and, from PostgreSQL 16, for
-- roles with pg_use_reserved_connections). A role that is not a member of
-- pg_read_all_stats sees every other role's session with its type hidden (NULL), not its
-- database, role and application_name: a session of a role in a database is counted as a
-- client (the server's background processes have no database or no role; a worker of
-- a parallel query or of autovacuum that may be counted too lasts a moment).
SELECT count(*) FILTER (WHERE client),
       count(*) FILTER (WHERE client
                        AND (application_name LIKE 'dramatiq-pg-broker/%%'
                             OR application_name LIKE 'dramatiq-pg-admin/%%')),
       current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int,
       coalesce(current_setting('reserved_connections', true), '0')::int
FROM (
    SELECT application_name,
           coalesce(backend_type = 'client backend',
                    datid IS NOT NULL AND usesysid IS NOT NULL) AS client
    FROM pg_stat_activity
) AS a

-- worker_budgets --
-- The live worker processes and the connections they may open between them: each one's
-- budget as it recorded it (migration 0023), or %(default_budget)s for a process of an
-- earlier release.
SELECT count(*), coalesce(sum(coalesce(connections, %(default_budget)s)), 0)::bigint
FROM {schema}.workers
WHERE expires_at > now()

-- replication_slots --
-- Every replication slot, with the WAL it keeps from being recycled (from its
-- restart_lsn to the current position; NULL on a standby or for a slot never used) and
-- the age of the xmin it holds.
SELECT slot_name, slot_type, active, active_pid, wal_status, database,
       CASE WHEN pg_is_in_recovery() OR restart_lsn IS NULL THEN NULL
            ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint END,
       age(xmin)::bigint, age(catalog_xmin)::bigint
FROM pg_replication_slots
ORDER BY 7 DESC NULLS LAST, slot_name

-- idle_job_lockers --
-- Sessions idle in a transaction that lock the jobs table in a mode that comes with row
-- locks or writes (FOR UPDATE/SHARE, UPDATE, DELETE: RowShareLock and up; a plain read
-- takes AccessShareLock), oldest first, with how many sessions wait for them now.
SELECT a.pid, a.application_name, a.usename::text, a.client_addr::text, a.state,
       extract(epoch FROM now() - a.state_change)::float8,
       extract(epoch FROM now() - a.xact_start)::float8,
       left(a.query, %(query_chars)s), a.backend_xid::text,
       (SELECT count(*) FROM pg_stat_activity AS b WHERE a.pid = ANY(pg_blocking_pids(b.pid)))
FROM pg_stat_activity AS a
WHERE a.state IN ('idle in transaction', 'idle in transaction (aborted)')
  AND a.pid <> pg_backend_pid()
  AND EXISTS (
      SELECT FROM pg_locks AS l
      WHERE l.pid = a.pid AND l.granted AND l.locktype = 'relation'
        AND l.relation = to_regclass(format('%%I.jobs', %(schema)s::text))
        AND l.mode <> 'AccessShareLock'
  )
ORDER BY a.state_change

-- jobs_locked_by --
-- Jobs whose row a transaction locked or changed (its id in their xmax; rows locked by
-- several transactions at once carry a multixact instead and are not found): at most
-- %(limit)s of them, and how many.
SELECT (array_agg(id::text ORDER BY id))[1:%(limit)s], count(*)
FROM {schema}.jobs
WHERE xmax = %(xid)s::xid

-- stalled_workflow_steps --
-- Steps of running workflows whose job ended without moving the workflow on: the node is
-- pending, its job is in jobs_history and no longer in jobs. A worker of a release before
-- migration 0025 moves a job to history with the columns it knows, without
-- workflow_node, so the trigger that advances workflows never sees it, and the workflow
-- waits for ever. How many steps, of how many workflows, and at most %(limit)s of them as
-- (workflow, job, the job's status), the earliest ended first.
WITH stalled AS (
    SELECT n.workflow_id, n.job_id, h.status, h.finished_at
    FROM {schema}.workflow_nodes AS n
    JOIN {schema}.workflows AS w ON w.id = n.workflow_id
    JOIN {schema}.jobs_history AS h ON h.id = n.job_id
    WHERE w.status = 'running' AND n.status = 'pending' AND h.workflow_node IS NULL
      AND NOT EXISTS (SELECT FROM {schema}.jobs AS j WHERE j.id = n.job_id)
)
SELECT count(*), count(DISTINCT workflow_id),
       coalesce((array_agg(ARRAY[workflow_id::text, job_id::text, status]
                           ORDER BY finished_at))[1:%(limit)s], ARRAY[]::text[])
FROM stalled
