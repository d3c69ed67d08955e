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
