-- 0006: periodic schedules, and the index that lets retention find old finished jobs.

-- One row per schedule the workers run: periodic actors, and the broker's own maintenance
-- (retention). Workers write the definition when they boot, so that the CLI and the admin
-- API can list schedules without importing the application's actors. last_tick is the
-- latest tick enqueued (or run, for maintenance); it is how a worker that boots after every
-- worker was down knows which ticks were missed.
CREATE TABLE schedules (
    name        text        PRIMARY KEY CHECK (name <> ''),
    -- 'actor': each tick enqueues one job of actor_name; 'maintenance': each tick runs
    -- broker housekeeping in exactly one worker process.
    kind        text        NOT NULL DEFAULT 'actor' CHECK (kind IN ('actor', 'maintenance')),
    actor_name  text,
    queue_name  text,
    -- "cron */5 * * * *" or "every 30s": how the schedule was declared.
    trigger     text        NOT NULL,
    timezone    text        NOT NULL DEFAULT 'UTC',
    -- What a worker does at boot with ticks nobody enqueued (every worker was down).
    missed      text        NOT NULL DEFAULT 'run_once' CHECK (missed IN ('run_once', 'skip')),
    last_tick   timestamptz,
    last_job_id uuid,
    next_run    timestamptz,
    updated_at  timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT schedules_actor_shape CHECK (
        kind <> 'actor' OR (actor_name IS NOT NULL AND queue_name IS NOT NULL)
    )
);

-- Retention deletes finished jobs oldest first, per status. finished_at is set exactly on
-- terminal rows (jobs_terminal_shape), so this partial index holds only those: it never
-- grows with waiting or running jobs and is never read by a claim.
-- IF NOT EXISTS: on a big existing table, build it first without blocking writes
-- (CREATE INDEX CONCURRENTLY with this exact definition), then migrate.
CREATE INDEX IF NOT EXISTS jobs_finished_idx
    ON jobs (status, finished_at)
    WHERE finished_at IS NOT NULL;
