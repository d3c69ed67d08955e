-- compatibility: breaking
-- Finished jobs leave the jobs table for partitioned history and events become a partitioned table: earlier releases would write finished rows where the new jobs table refuses them, so their processes must stop first.
--
-- 0012: hot work and history apart.
--
-- The jobs table keeps unfinished jobs only (queued, running): the claim, the reaper and
-- the outcome statements touch a table as big as the work in flight, however much history
-- is kept. An outcome that ends a job (succeeded, failed, cancelled) deletes its row from
-- jobs and inserts it into jobs_history in the same statement. jobs_history is
-- partitioned by status (LIST), so each status keeps its own retention, and each status by
-- day of finished_at (RANGE, UTC days); job_events is partitioned by day of created_at.
-- Retention drops whole partitions (no dead rows, no vacuum); the maintenance run of the
-- workers creates partitions some days ahead. Each partitioned level has a DEFAULT
-- partition, so no row is ever refused when maintenance lags: rows there are deleted in
-- batches, the way every finished row was before.
--
-- Ids stay unique across the two tables: a row moves in one statement, sends probe the
-- history for their id (queries.sql insert_job), and a manual retry moves a failed job
-- back in one statement. The view all_jobs shows both to readers (admin API, CLI).
--
-- Locking and duration: the migration runs in one transaction that holds ACCESS
-- EXCLUSIVE locks on jobs and job_events until it commits, so sends, claims and outcomes
-- wait for it. It copies every row once (unfinished jobs into a new jobs table, finished
-- ones into jobs_history, events into the partitioned job_events), then builds the
-- indexes; the upgrading guide gives the time measured for 1,000,000 finished jobs.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

-- What went with the old tables: the trigger that deleted a job's events with the job (a
-- finished job's DELETE from jobs is now its move to history; Dramatiq's flush deletes
-- the events of the jobs it drops itself), and job_owners' foreign key (a job that moved
-- to history must keep its owner; retention deletes the owners of the jobs it drops).
DROP TRIGGER jobs_delete_events ON jobs;
DROP FUNCTION delete_job_events();
ALTER TABLE job_owners DROP CONSTRAINT job_owners_job_id_fkey;

-- Finished jobs. The same columns, in the same order, as jobs (a move is an INSERT of the
-- deleted row), and the same row checks; no primary key (a partitioned table's keys must
-- hold the partition key), the id is indexed per partition instead.
CREATE TABLE jobs_history (LIKE jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY LIST (status);
ALTER TABLE jobs_history
    ALTER COLUMN finished_at SET NOT NULL;

CREATE TABLE jobs_history_succeeded PARTITION OF jobs_history
    FOR VALUES IN ('succeeded') PARTITION BY RANGE (finished_at);
CREATE TABLE jobs_history_failed PARTITION OF jobs_history
    FOR VALUES IN ('failed') PARTITION BY RANGE (finished_at);
CREATE TABLE jobs_history_cancelled PARTITION OF jobs_history
    FOR VALUES IN ('cancelled') PARTITION BY RANGE (finished_at);
CREATE TABLE jobs_history_succeeded_default PARTITION OF jobs_history_succeeded DEFAULT;
CREATE TABLE jobs_history_failed_default PARTITION OF jobs_history_failed DEFAULT;
CREATE TABLE jobs_history_cancelled_default PARTITION OF jobs_history_cancelled DEFAULT;

-- Events, partitioned by day of created_at. The identity stays the event's order; the
-- primary key holds created_at because a partitioned table's keys must.
ALTER TABLE job_events RENAME TO job_events_before_0012;
ALTER INDEX job_events_pkey RENAME TO job_events_before_0012_pkey;
ALTER INDEX job_events_job_id_idx RENAME TO job_events_before_0012_job_id_idx;
ALTER INDEX job_events_rare_type_idx RENAME TO job_events_before_0012_rare_type_idx;

CREATE TABLE job_events (
    id          bigint      GENERATED ALWAYS AS IDENTITY,
    job_id      uuid        NOT NULL,
    type        text        NOT NULL CONSTRAINT job_events_type_check CHECK (type IN (
                    'created', 'claimed', 'progress', 'lease_renewed', 'succeeded',
                    'retry_scheduled', 'failed', 'timeout_requeued', 'released',
                    'manual_retry', 'cancelled', 'abort_requested', 'aborted')),
    attempt     integer     NOT NULL DEFAULT 0,
    actor       text,
    data        jsonb,
    created_at  timestamptz NOT NULL DEFAULT now()
) PARTITION BY RANGE (created_at);
CREATE TABLE job_events_default PARTITION OF job_events DEFAULT;

-- The partitions of history, with their ranges (NULL for a DEFAULT partition). regclass
-- constants are stored as the tables' oids, so the view needs no schema name.
CREATE VIEW history_partitions AS
SELECT parent.relname::text AS parent,
       part.relname::text AS partition,
       (regexp_match(pg_get_expr(part.relpartbound, part.oid), 'FROM \(''([^'']+)''\)'))[1]::timestamptz
           AS range_start,
       (regexp_match(pg_get_expr(part.relpartbound, part.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz
           AS range_end,
       pg_get_expr(part.relpartbound, part.oid) = 'DEFAULT' AS is_default
FROM pg_inherits AS i
JOIN pg_class AS part ON part.oid = i.inhrelid
JOIN pg_class AS parent ON parent.oid = i.inhparent
WHERE i.inhparent IN ('jobs_history_succeeded'::regclass, 'jobs_history_failed'::regclass,
                      'jobs_history_cancelled'::regclass, 'job_events'::regclass);

-- Create the daily partitions of every history table from first_day to last_day (UTC days,
-- both included) that do not exist yet; returns how many it created. Idempotent, and safe
-- to run from many processes at once: creators take turns on a transaction-level advisory
-- lock, and a partition that exists is skipped without taking any lock on its parent.
-- Creating one takes an ACCESS EXCLUSIVE lock on its parent: under the caller's
-- lock_timeout, a partition whose parent is held by a long reader is skipped rather than
-- making every outcome queue behind the wait (retention runs it with 2 s). A
-- day whose rows already landed in a DEFAULT partition (maintenance lagged that far) is
-- skipped: those rows are deleted in batches by retention, like any row of a DEFAULT
-- partition.
CREATE FUNCTION create_history_partitions(first_day date, last_day date) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    day date;
    parent text;
    name text;
    created integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(1685221479, hashtext(current_schema()));
    FOR day IN SELECT generate_series(first_day, last_day, interval '1 day')::date LOOP
        FOREACH parent IN ARRAY ARRAY['jobs_history_succeeded', 'jobs_history_failed',
                                      'jobs_history_cancelled', 'job_events'] LOOP
            name := parent || '_' || to_char(day, 'YYYYMMDD');
            CONTINUE WHEN to_regclass(quote_ident(name)) IS NOT NULL;
            BEGIN
                EXECUTE format('CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L)',
                               name, parent, day::timestamp AT TIME ZONE 'UTC',
                               (day + 1)::timestamp AT TIME ZONE 'UTC');
                created := created + 1;
            EXCEPTION
                WHEN check_violation THEN
                    -- The DEFAULT partition holds rows of that day.
                    NULL;
                WHEN lock_not_available THEN
                    -- A long reader holds the parent (under the caller's lock_timeout):
                    -- the next run creates it, long before its day comes.
                    NULL;
            END;
        END LOOP;
    END LOOP;
    RETURN created;
END
$$;

ALTER FUNCTION create_history_partitions(date, date) SET search_path FROM CURRENT;

-- Partitions for the days the existing rows finished on (at most the last 400 days; older
-- rows go to the DEFAULT partitions) and the week ahead.
SELECT create_history_partitions(
    greatest(
        coalesce((SELECT min(finished_at) FROM jobs WHERE finished_at IS NOT NULL), now()),
        coalesce((SELECT min(created_at) FROM job_events_before_0012), now()),
        now() - interval '400 days'
    )::date,
    (now() + interval '7 days')::date
);

-- The unfinished jobs, into a new jobs table (so that the old one's dead space goes with
-- it); the finished ones, into history; the events, into their partitions.
CREATE TABLE jobs_unfinished (LIKE jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
INSERT INTO jobs_unfinished SELECT * FROM jobs WHERE status IN ('queued', 'running');
INSERT INTO jobs_history SELECT * FROM jobs WHERE status IN ('succeeded', 'failed', 'cancelled');
INSERT INTO job_events (id, job_id, type, attempt, actor, data, created_at)
    OVERRIDING SYSTEM VALUE
    SELECT id, job_id, type, attempt, actor, data, created_at FROM job_events_before_0012;
SELECT setval(pg_get_serial_sequence('job_events', 'id'),
              coalesce((SELECT max(id) FROM job_events_before_0012), 0) + 1, false);
DROP TABLE job_events_before_0012;
DROP TABLE jobs;
ALTER TABLE jobs_unfinished RENAME TO jobs;

-- The jobs table: what 0001-0011 built, without the indexes that served finished rows
-- (jobs_finished_idx, jobs_dead_*: their history counterparts follow).
ALTER TABLE jobs
    ADD CONSTRAINT jobs_pkey PRIMARY KEY (id),
    ADD CONSTRAINT jobs_unfinished CHECK (status IN ('queued', 'running'));
CREATE INDEX jobs_claim_order_idx
    ON jobs (queue_name, priority, available_at, created_at, id)
    WHERE status = 'queued';
CREATE INDEX jobs_lease_expiry_idx ON jobs (locked_until) WHERE status = 'running';
CREATE UNIQUE INDEX jobs_idempotency_key_scoped_uq
    ON jobs (actor_name, idempotency_scope, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX jobs_created_at_idx ON jobs (created_at, id);
CREATE INDEX jobs_queue_created_idx ON jobs (queue_name, created_at, id);
CREATE INDEX jobs_actor_created_idx ON jobs (actor_name, created_at, id);
ALTER TABLE jobs SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_limit = 2000
);

-- History's indexes, one per partition (built after the copy, which is faster). By id: a
-- job's detail, a send's probe, a retry. By creation: the admin API's list and its queue
-- and actor filters, newest first. By finish: `jobs retry --all-failed`, the fail-fast
-- count of join() and the batches of the DEFAULT partitions. By idempotency key: a keyed
-- send finds a finished job with its key.
CREATE INDEX jobs_history_id_idx ON jobs_history (id);
CREATE INDEX jobs_history_created_at_idx ON jobs_history (created_at, id);
CREATE INDEX jobs_history_queue_created_idx ON jobs_history (queue_name, created_at, id);
CREATE INDEX jobs_history_actor_created_idx ON jobs_history (actor_name, created_at, id);
CREATE INDEX jobs_history_finished_idx ON jobs_history (finished_at, id);
CREATE INDEX jobs_history_idempotency_idx
    ON jobs_history (actor_name, idempotency_scope, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Events' indexes: the order of the feed, a job's timeline, the rare types (as 0007).
ALTER TABLE job_events ADD CONSTRAINT job_events_pkey PRIMARY KEY (id, created_at);
CREATE INDEX job_events_job_id_idx ON job_events (job_id, id);
CREATE INDEX job_events_rare_type_idx ON job_events (type, id)
    WHERE type NOT IN ('created', 'claimed', 'succeeded');

-- Every job, unfinished or finished, for readers that do not care where it lives. The
-- planner pushes a reader's conditions, order and limit into both branches.
CREATE VIEW all_jobs AS
SELECT * FROM jobs
UNION ALL
SELECT * FROM jobs_history;

-- A member's job list (admin API) walks their owner rows in the list's order, and fetches
-- each job by id: a probe by id cannot be pruned (history is partitioned by finish), so
-- each owner row carries its job's created_at, copied from the job's row when the owner is
-- recorded. A job finishes at or after it was created (both are the server's now()), so
-- the fetch asks history for finished_at >= created_at, and PostgreSQL leaves out, per
-- owner row, every partition of days before the job was created. Every owner row has its
-- job here (the foreign key held until this migration).
ALTER TABLE job_owners ADD COLUMN created_at timestamptz;
UPDATE job_owners AS o SET created_at = j.created_at FROM all_jobs AS j WHERE j.id = o.job_id;
ALTER TABLE job_owners ALTER COLUMN created_at SET NOT NULL;
DROP INDEX job_owners_user_id_idx;
CREATE INDEX job_owners_user_created_idx ON job_owners (user_id, created_at, job_id);

-- Idempotency keys, held for the whole life of their job, unfinished or in history (until
-- retention deletes the job). A send registers its key here in the statement that inserts
-- the job, and inserts the job only if the key was new: a real unique index, so two sends
-- with one key never both get a job, even when one of them races with the first job's
-- move to history (a probe of history could not see a move committed after the send's
-- statement began). Keyed sends only: sends without a key never touch it.
CREATE TABLE job_keys (
    actor_name          text    NOT NULL,
    idempotency_scope   text    NOT NULL,
    idempotency_key     text    NOT NULL,
    job_id              uuid    NOT NULL,
    PRIMARY KEY (actor_name, idempotency_scope, idempotency_key)
);
INSERT INTO job_keys
SELECT actor_name, idempotency_scope, idempotency_key, id
FROM all_jobs
WHERE idempotency_key IS NOT NULL;

ANALYZE jobs;
ANALYZE jobs_history;
ANALYZE job_events;
ANALYZE job_owners;
