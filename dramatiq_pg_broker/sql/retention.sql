-- Named statements of retention and of history's partitions (migration 0012). Same layout
-- as queries.sql; {{partition}} is a partition's name, filled in (as an identifier) for
-- the one partition a statement works on. Only history (finished jobs) and events are ever
-- touched, so nothing here competes with a claim, an ack or the reaper for a row.

-- create_partitions --
-- The daily partitions of history and events from %(first_day)s to %(last_day)s that do
-- not exist yet (idempotent and safe from many processes at once: see the function in
-- 0012). Returns how many were created.
SELECT {schema}.create_history_partitions(%(first_day)s::date, %(last_day)s::date)

-- expired_partitions --
-- The daily partitions of one parent (jobs_history_<status>, or job_events) whose whole
-- range ended at or before %(cutoff)s, oldest first, with their size: every row in them
-- is past its retention.
SELECT p.partition, pg_relation_size(c.oid), c.reltuples
FROM {schema}.history_partitions AS p
JOIN pg_class AS c ON c.oid = to_regclass(quote_ident(%(schema)s) || '.' || quote_ident(p.partition))
WHERE p.parent = %(parent)s AND NOT p.is_default AND p.range_end <= %(cutoff)s
ORDER BY p.range_end

-- count_partition --
-- The rows of one partition (exactly; used while it is small enough to count).
SELECT count(*) FROM {schema}.{{partition}}

-- delete_owners_in --
-- The admin API's owner rows of the jobs of a partition about to be dropped.
DELETE FROM {schema}.job_owners AS o
USING {schema}.{{partition}} AS h
WHERE o.job_id = h.id

-- delete_keys_in --
-- The idempotency keys of the jobs of a partition about to be dropped (the partition's
-- partial index on keys finds them; job_keys' primary key each key row).
DELETE FROM {schema}.job_keys AS k
USING {schema}.{{partition}} AS h
WHERE h.idempotency_key IS NOT NULL
  AND k.actor_name = h.actor_name AND k.idempotency_scope = h.idempotency_scope
  AND k.idempotency_key = h.idempotency_key AND k.job_id = h.id

-- drop_partition --
-- A whole day of history or events: constant time, no dead rows. It takes an ACCESS
-- EXCLUSIVE lock on the parent for an instant; the caller sets a lock_timeout so that a
-- long reader of the parent delays the drop to the next run instead of queueing every
-- outcome behind it.
DROP TABLE {schema}.{{partition}}

-- select_prunable --
-- Up to %(limit)s jobs of one status's DEFAULT partition (%(partition)s: days that had no
-- partition when they finished) older than %(age_s)s seconds, oldest first, locked for the
-- rest of this short transaction (jobs_history_finished_idx). SKIP LOCKED: two processes
-- pruning at once take different rows instead of waiting.
SELECT id, finished_at
FROM {schema}.{{partition}}
WHERE finished_at < coalesce(%(now)s::timestamptz, now()) - %(age_s)s * interval '1 second'
ORDER BY finished_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- delete_events_of --
-- The events of the jobs about to be deleted from a DEFAULT partition (job_events_job_id_idx
-- of every event partition), so that a job and its timeline go together, as before 0012.
DELETE FROM {schema}.job_events
WHERE job_id = ANY(%(ids)s::uuid[])

-- delete_owners_of --
-- Their owner rows (the admin API's job_owners).
DELETE FROM {schema}.job_owners
WHERE job_id = ANY(%(ids)s::uuid[])

-- delete_keys_of --
-- Their idempotency keys.
DELETE FROM {schema}.job_keys AS k
USING {schema}.jobs_history AS h
WHERE h.id = ANY(%(ids)s::uuid[]) AND h.idempotency_key IS NOT NULL
  AND k.actor_name = h.actor_name AND k.idempotency_scope = h.idempotency_scope
  AND k.idempotency_key = h.idempotency_key AND k.job_id = h.id

-- delete_jobs --
-- The locked batch itself.
DELETE FROM {schema}.{{partition}}
WHERE id = ANY(%(ids)s::uuid[])

-- delete_old_events --
-- Up to %(limit)s events of the events' DEFAULT partition older than the cutoff.
DELETE FROM {schema}.job_events_default
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {schema}.job_events_default
    WHERE created_at < %(cutoff)s
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
))

-- count_prunable --
-- What a run would delete now from one status's DEFAULT partition (the dry run): jobs and
-- their events.
SELECT count(DISTINCT j.id), count(e.id)
FROM {schema}.{{partition}} AS j
LEFT JOIN {schema}.job_events AS e ON e.job_id = j.id
WHERE j.finished_at < coalesce(%(now)s::timestamptz, now()) - %(age_s)s * interval '1 second'

-- count_old_events --
-- Events of the events' DEFAULT partition older than the cutoff (the dry run).
SELECT count(*) FROM {schema}.job_events_default WHERE created_at < %(cutoff)s

-- history_partition_names --
-- Every attached daily partition of history and events (the create step skips them).
SELECT partition FROM {schema}.history_partitions WHERE NOT is_default

-- pending_partitions --
-- Tables named like a day's partition that are not attached (migration 0013's view):
-- prepared and not attached yet, or detached and not dropped yet.
SELECT parent, day, partition FROM {schema}.history_partitions_pending ORDER BY day, parent

-- prepare_partition --
-- A day's standalone table with its CHECK constraint (0013); true when made now. Locks
-- nothing the hot path uses.
SELECT {schema}.prepare_history_partition(%(parent)s, %(day)s::date)

-- attach_partition --
-- ATTACH PARTITION of a prepared day (0013): SHARE UPDATE EXCLUSIVE on the parent, ACCESS
-- EXCLUSIVE on the table and the parent's DEFAULT partition. Run alone in its transaction,
-- under a short lock_timeout.
SELECT {schema}.attach_history_partition(%(parent)s, %(day)s::date)

-- detach_partition --
-- Plain DETACH PARTITION (0013; CONCURRENTLY is refused while a DEFAULT partition exists):
-- ACCESS EXCLUSIVE on the parent for an instant, alone in its transaction, under a short
-- lock_timeout.
SELECT {schema}.detach_history_partition(%(partition)s)

-- drop_table --
-- A detached (or never attached) day: locks only that table.
DROP TABLE IF EXISTS {schema}.{{partition}}

-- free_keys_in --
-- Up to %(limit)s idempotency keys of the jobs of a partition about to be dropped, each
-- batch its own short transaction (SKIP LOCKED: a key a send holds is left; a key whose job
-- is gone is freed by the next send with it).
DELETE FROM {schema}.job_keys
WHERE ctid = ANY(ARRAY(
    SELECT k.ctid
    FROM {schema}.{{partition}} AS h
    JOIN {schema}.job_keys AS k
      ON k.actor_name = h.actor_name AND k.idempotency_scope = h.idempotency_scope
     AND k.idempotency_key = h.idempotency_key AND k.job_id = h.id
    WHERE h.idempotency_key IS NOT NULL
    LIMIT %(limit)s
    FOR UPDATE OF k SKIP LOCKED
))

-- free_owners_in --
-- Up to %(limit)s owner rows (admin API) of the jobs of a partition about to be dropped.
DELETE FROM {schema}.job_owners
WHERE ctid = ANY(ARRAY(
    SELECT o.ctid
    FROM {schema}.{{partition}} AS h
    JOIN {schema}.job_owners AS o ON o.job_id = h.id
    LIMIT %(limit)s
    FOR UPDATE OF o SKIP LOCKED
))

-- history_default_days --
-- The UTC days held by a DEFAULT partition of history, oldest first, one index probe per
-- day (jobs_history_finished_idx), however many rows each holds.
WITH RECURSIVE days AS (
    SELECT (SELECT date_trunc('day', min(finished_at) AT TIME ZONE 'UTC')
            FROM {schema}.{{partition}}) AS day
    UNION ALL
    SELECT (SELECT date_trunc('day', min(finished_at) AT TIME ZONE 'UTC')
            FROM {schema}.{{partition}}
            WHERE finished_at >= (days.day + interval '1 day') AT TIME ZONE 'UTC')
    FROM days
    WHERE days.day IS NOT NULL
)
SELECT day::date FROM days WHERE day IS NOT NULL

-- events_default_days --
-- The same for the events' DEFAULT partition (job_events_default_created_at_idx, 0013).
WITH RECURSIVE days AS (
    SELECT (SELECT date_trunc('day', min(created_at) AT TIME ZONE 'UTC')
            FROM {schema}.job_events_default) AS day
    UNION ALL
    SELECT (SELECT date_trunc('day', min(created_at) AT TIME ZONE 'UTC')
            FROM {schema}.job_events_default
            WHERE created_at >= (days.day + interval '1 day') AT TIME ZONE 'UTC')
    FROM days
    WHERE days.day IS NOT NULL
)
SELECT day::date FROM days WHERE day IS NOT NULL

-- move_default_day --
-- Up to %(limit)s rows of one day (by {{column}}: finished_at in history, created_at for
-- events) out of a DEFAULT partition of history or events into that day's prepared table
-- (its CHECK constraint holds them to the day). Rows move in short transactions, locked
-- with SKIP LOCKED; a moved row is out of sight of readers of the parent until the table
-- is attached, at the end of its day's moves.
WITH moved AS (
    DELETE FROM {schema}.{{partition}}
    WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {schema}.{{partition}}
        WHERE {{column}} >= %(day)s::timestamp AT TIME ZONE 'UTC'
          AND {{column}} < (%(day)s::date + 1)::timestamp AT TIME ZONE 'UTC'
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING *
)
INSERT INTO {schema}.{{target}} SELECT * FROM moved

-- default_rows --
-- The rows of one DEFAULT partition, counted up to %(cap)s (``status``).
SELECT count(*) FROM (SELECT 1 FROM {schema}.{{partition}} LIMIT %(cap)s) AS r

-- count_default_day --
-- The rows of one day in a DEFAULT partition, counted up to %(cap)s (by the index on
-- {{column}}).
SELECT count(*) FROM (
    SELECT 1 FROM {schema}.{{partition}}
    WHERE {{column}} >= %(day)s::timestamp AT TIME ZONE 'UTC'
      AND {{column}} < (%(day)s::date + 1)::timestamp AT TIME ZONE 'UTC'
    LIMIT %(cap)s
) AS r

-- lock_holders --
-- Whoever might keep a maintenance statement waiting for long: a session holding (or
-- waiting for) a lock that conflicts with one the statement is about to take, on the
-- relations it names, that is idle in its transaction, in a transaction begun
-- %(brief_ms)s ms ago or more, not a client (autovacuum), or a prepared transaction (no
-- session). A session seen idle has just ended the transaction that held the lock (the
-- two views are read a moment apart): not a holder.
-- %(relations)s and %(modes)s pair each relation with one lock mode that conflicts with
-- what the statement needs (one pair per conflicting mode). Any row: the statement is not
-- run (it would queue behind that holder, and every send, claim or outcome needing the
-- relation would queue behind it); none: only brief statements hold the relation, and
-- the statement queues behind them under the short lock_timeout.
SELECT w.relation, l.mode, l.granted, l.pid, a.state, a.backend_type,
       round(extract(epoch FROM clock_timestamp() - a.xact_start)::numeric, 3)
FROM unnest(%(relations)s::text[], %(modes)s::text[]) AS w(relation, mode)
JOIN pg_locks AS l
  ON l.locktype = 'relation'
 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
 AND l.relation = to_regclass(format('%%I.%%I', %(schema)s::text, w.relation))
 AND l.mode = w.mode
LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.pid IS DISTINCT FROM pg_backend_pid()
  AND a.state IS DISTINCT FROM 'idle'
  AND (NOT l.granted OR a.pid IS NULL OR a.state IS DISTINCT FROM 'active'
       OR a.backend_type IS DISTINCT FROM 'client backend'
       OR a.xact_start < clock_timestamp() - %(brief_ms)s * interval '1 millisecond')
LIMIT 1

-- clear_activity_snapshot --
-- pg_stat_activity is read once per transaction and kept: read it afresh (a transaction
-- of maintenance may ask lock_holders twice).
SELECT pg_stat_clear_snapshot()

-- relation_size --
-- The bytes of one partition: what an attach that has to scan it reads (dead rows
-- included, until vacuum).
SELECT pg_relation_size(to_regclass(format('%%I.%%I', %(schema)s::text, %(partition)s::text)))

-- exclusion_constraints --
-- The constraints maintenance left on a DEFAULT partition (a run that stopped between
-- adding one and dropping it): each says the partition holds no row of some days.
SELECT c.conname
FROM pg_constraint AS c
WHERE c.conrelid = to_regclass(format('%%I.%%I', %(schema)s::text, %(partition)s::text))
  AND c.contype = 'c' AND c.conname LIKE %(partition)s::text || '\_not\_%%'

-- move_back --
-- Up to %(limit)s rows of a day's table that could not be attached back into the DEFAULT
-- partition, where readers see them again.
WITH moved AS (
    DELETE FROM {schema}.{{target}}
    WHERE ctid = ANY(ARRAY(SELECT ctid FROM {schema}.{{target}} LIMIT %(limit)s))
    RETURNING *
)
INSERT INTO {schema}.{{partition}} SELECT * FROM moved

-- exclude_day --
-- A constraint on a DEFAULT partition saying it holds no row of the days from {{lo}} to
-- {{hi}} (NOT VALID: instant, ACCESS EXCLUSIVE on that partition for a moment). {{lo}} and
-- {{hi}} are the bounds, as literals (DDL takes no parameters).
ALTER TABLE {schema}.{{partition}}
    ADD CONSTRAINT {{constraint}} CHECK ({{column}} < {{lo}} OR {{column}} >= {{hi}}) NOT VALID

-- validate_exclusion --
-- The scan that proves it, under SHARE UPDATE EXCLUSIVE: reads and writes go on.
ALTER TABLE {schema}.{{partition}} VALIDATE CONSTRAINT {{constraint}}

-- drop_exclusion --
-- Once the days are attached (or not), the constraint goes (ACCESS EXCLUSIVE on the
-- partition for a moment).
ALTER TABLE {schema}.{{partition}} DROP CONSTRAINT IF EXISTS {{constraint}}

-- take_turn --
-- The run's turn at the partition steps of the schema %(schema)s (history/ddl.py, Turn): a
-- transaction-level advisory lock on (%(namespace)s, hashtext(schema)), taken without
-- waiting, in the transaction the caller keeps open while the steps run. Returns whether
-- it was taken and, when not, the server process that holds it and since when its
-- transaction runs (NULL: it ended meanwhile).
WITH taken AS (
    SELECT pg_try_advisory_xact_lock(%(namespace)s, hashtext(%(schema)s)) AS ours
)
SELECT taken.ours, holder.pid, holder.xact_start
FROM taken
LEFT JOIN LATERAL (
    SELECT l.pid, a.xact_start
    FROM pg_locks AS l
    LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE NOT taken.ours
      AND l.locktype = 'advisory' AND l.granted
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid::bigint = %(namespace)s
      AND l.objid::bigint = (hashtext(%(schema)s)::bigint & 4294967295)
      AND l.objsubid = 2
    LIMIT 1
) AS holder ON true
