-- Named statements of the periodic schedules. Same layout as queries.sql.

-- upsert_schedule --
-- A booting worker writes a schedule's definition (so that the CLI and the admin API can
-- list it without importing the application) and reads the last tick anyone enqueued,
-- which tells it what was missed while every worker was down.
INSERT INTO {schema}.schedules AS s (
    name, kind, actor_name, queue_name, trigger, timezone, missed, next_run, updated_at
)
VALUES (
    %(name)s, %(kind)s, %(actor_name)s, %(queue_name)s, %(trigger)s, %(timezone)s,
    %(missed)s, %(next_run)s, now()
)
ON CONFLICT (name) DO UPDATE
SET kind = excluded.kind,
    actor_name = excluded.actor_name,
    queue_name = excluded.queue_name,
    trigger = excluded.trigger,
    timezone = excluded.timezone,
    missed = excluded.missed,
    next_run = excluded.next_run,
    updated_at = now()
RETURNING s.last_tick

-- record_tick --
-- A tick's job is enqueued (or was, by another process: the idempotency key made that a
-- no-op). Never moves last_tick backwards, so a late process cannot undo a later tick.
UPDATE {schema}.schedules
SET last_tick = %(tick)s,
    last_job_id = %(job_id)s,
    next_run = %(next_run)s,
    updated_at = now()
WHERE name = %(name)s AND (last_tick IS NULL OR last_tick <= %(tick)s)

-- claim_tick --
-- Compare-and-set on a maintenance schedule's last tick: of all the processes that fire the
-- same tick, exactly one gets the row back and runs it.
UPDATE {schema}.schedules
SET last_tick = %(tick)s,
    next_run = %(next_run)s,
    updated_at = now()
WHERE name = %(name)s AND (last_tick IS NULL OR last_tick < %(tick)s)
RETURNING name

-- list_schedules --
-- Every schedule with its last tick, next run and the status of the last tick's job.
SELECT s.name, s.kind, s.actor_name, s.queue_name, s.trigger, s.timezone, s.missed,
       s.last_tick, s.next_run, s.last_job_id, j.status AS last_job_status, s.updated_at
FROM {schema}.schedules AS s
LEFT JOIN {schema}.all_jobs AS j ON j.id = s.last_job_id
ORDER BY s.kind, s.name
