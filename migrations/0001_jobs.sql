-- 0001: the job table and its append-only event log.
--
-- Applied with search_path set to the broker's schema (default "dramatiq"), so the names here
-- are unqualified. Released migrations are never edited: a change is a new numbered file.

CREATE TABLE jobs (
    -- The Dramatiq message_id.
    id              uuid        PRIMARY KEY,
    queue_name      text        NOT NULL CHECK (queue_name <> ''),
    actor_name      text        NOT NULL CHECK (actor_name <> ''),
    -- The encoded message: jsonb with Dramatiq's JSON encoder, raw bytes with any other
    -- encoder (pickle). Exactly one of the two is set.
    message         jsonb,
    message_bytes   bytea,
    status          text        NOT NULL DEFAULT 'queued'
                                CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    -- Dramatiq's meaning: the lower number runs first.
    priority        integer     NOT NULL DEFAULT 0,
    available_at    timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    max_attempts    integer     NOT NULL DEFAULT 21,
    idempotency_key text,
    locked_by       text,
    locked_until    timestamptz,
    last_error      text,
    result          jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    started_at      timestamptz,
    finished_at     timestamptz,

    CONSTRAINT jobs_message_present CHECK ((message IS NULL) <> (message_bytes IS NULL)),
    CONSTRAINT jobs_max_attempts_positive CHECK (max_attempts >= 1),
    CONSTRAINT jobs_attempts_in_range CHECK (attempts >= 0 AND attempts <= max_attempts),
    CONSTRAINT jobs_idempotency_key_not_blank CHECK (idempotency_key IS NULL OR idempotency_key <> ''),
    -- A queued row waits: nobody holds it and it has not finished.
    CONSTRAINT jobs_queued_shape CHECK (
        status <> 'queued'
        OR (locked_by IS NULL AND locked_until IS NULL AND finished_at IS NULL)
    ),
    -- A running row belongs to exactly one attempt: owner and lease are both set.
    CONSTRAINT jobs_running_shape CHECK (
        status <> 'running'
        OR (locked_by IS NOT NULL AND locked_until IS NOT NULL
            AND started_at IS NOT NULL AND finished_at IS NULL)
    ),
    -- A terminal row is released and knows when it finished.
    CONSTRAINT jobs_terminal_shape CHECK (
        status NOT IN ('succeeded', 'failed', 'cancelled')
        OR (locked_by IS NULL AND locked_until IS NULL AND finished_at IS NOT NULL)
    )
);

-- The claim query walks this index in claim order and stops after LIMIT rows; being partial,
-- it holds only waiting rows, so millions of finished rows never slow a claim down.
CREATE INDEX jobs_claim_order_idx
    ON jobs (queue_name, priority, available_at, created_at, id)
    WHERE status = 'queued';

-- The reaper looks for running rows whose lease has expired, oldest expiry first.
CREATE INDEX jobs_lease_expiry_idx
    ON jobs (locked_until)
    WHERE status = 'running';

-- An idempotency key is unique while present; most jobs have none.
CREATE UNIQUE INDEX jobs_idempotency_key_uq
    ON jobs (idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- A queue table churns: every job is inserted, updated two or three times and eventually
-- deleted by retention. With the default scale factors (20 % of the table) autovacuum waits
-- far too long on a big table and dead tuples bloat the claim index, so vacuum after 1 % of
-- the rows changed, and let it work faster. The fill factor leaves room on each page for
-- the updated row versions.
ALTER TABLE jobs SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_limit = 2000
);

CREATE TABLE job_events (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id      uuid        NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    type        text        NOT NULL CHECK (type IN (
                    'created', 'claimed', 'progress', 'lease_renewed', 'succeeded',
                    'retry_scheduled', 'failed', 'timeout_requeued', 'released',
                    'manual_retry', 'cancelled')),
    -- The attempt the event belongs to (jobs.attempts when it was written).
    attempt     integer     NOT NULL DEFAULT 0,
    -- The worker (lease owner) or operator that caused it, when there is one.
    actor       text,
    data        jsonb,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- A job's timeline, in order.
CREATE INDEX job_events_job_id_idx ON job_events (job_id, id);

-- Events are append-only: inserts dominate, so let autovacuum freeze and update the
-- visibility map after inserts, not only after updates and deletes.
ALTER TABLE job_events SET (
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05
);
