-- 0007: the admin API's login throttle, and indexes that serve its job and event filters
-- at millions of rows.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.
-- The indexes are built in the migration's transaction (CREATE INDEX CONCURRENTLY cannot
-- run in one): on a big existing table, migrate at a quiet moment, since sends and claims
-- wait while they are built.

-- Failed logins, counted per key: 'account:<email>', 'client:<address>' and
-- 'pair:<email> <address>'. Stored here rather than in a process, so that the throttle
-- holds across gunicorn workers and hosts. A row is a window of failures; once the window
-- has passed and no block is running, the next failure starts a new window.
CREATE TABLE login_throttle (
    key             text        PRIMARY KEY,
    failures        integer     NOT NULL CHECK (failures > 0),
    window_start    timestamptz NOT NULL DEFAULT now(),
    -- Logins with this key are refused (429) until then.
    blocked_until   timestamptz
);

-- Pruning windows that are over.
CREATE INDEX login_throttle_window_start_idx ON login_throttle (window_start);

-- The job list filtered by queue or by actor, newest first, a page at a time: without
-- these, a filter that matches few of a million finished rows walks the whole
-- jobs_created_at_idx to fill a page. Each costs one btree entry per row version that is
-- not a HOT update (an enqueue and each status change), like jobs_created_at_idx.
CREATE INDEX jobs_queue_created_idx ON jobs (queue_name, created_at, id);
CREATE INDEX jobs_actor_created_idx ON jobs (actor_name, created_at, id);

-- The same filters on the dead letters (?status=failed&queue=... or &actor=...). Partial,
-- like jobs_dead_idx: a row enters them only when it fails or is cancelled, so they cost
-- nothing on the hot path, and a queue or an actor with no failures answers at once
-- instead of walking every failed job.
CREATE INDEX jobs_dead_queue_idx ON jobs (queue_name, created_at, id)
    WHERE status IN ('failed', 'cancelled');
CREATE INDEX jobs_dead_actor_idx ON jobs (actor_name, created_at, id)
    WHERE status IN ('failed', 'cancelled');

-- The event feed filtered by type, newest first. Three event types make up almost every
-- row (each job has one created, one claimed per attempt and usually one succeeded): a
-- filter on them finds a page at once walking the primary key. The others are rare, and
-- a filter on one of them would read every event; this partial index holds only them, so
-- it costs nothing on the hot path. The query repeats the predicate for the planner.
CREATE INDEX job_events_rare_type_idx ON job_events (type, id)
    WHERE type NOT IN ('created', 'claimed', 'succeeded');
