-- compatibility: compatible
-- Nullable columns, new tables and a wider event check only: 0.1.0 processes keep working beside new ones, and nothing they write can break a constraint added here.
--
-- 0011: operator control. An operator can abort a job (queued: cancelled at once; running:
-- its worker interrupts the attempt and the job ends cancelled), pause and resume a queue,
-- and see which worker processes run and which actors they declared.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.
--
-- Beside workers of the previous release: their claim ignores a pause, and their outcomes,
-- retries and reaper leave the abort request of a row as it is (no constraint ties it to a
-- status), so a job they requeue after an abort was requested is cancelled by the first
-- new worker that claims it; a worker of the previous release runs it. They never write
-- the new event types, nor the new tables.

-- An abort requested for a running job: who asked and when. Set by the operator's abort,
-- read by the worker that owns the attempt (through NOTIFY, or returned by its lease
-- heartbeat), which ends the attempt `cancelled`. It stays on the row as history. Neither
-- column is indexed, so setting them is a HOT update that no claim or reaper index sees.
ALTER TABLE jobs
    ADD COLUMN abort_requested_at timestamptz,
    ADD COLUMN abort_requested_by text;

-- Both or neither. NOT VALID: every existing row has both columns NULL (they were just
-- added), so validating would only scan the table under this migration's lock; the check
-- still holds for every row written from now on.
ALTER TABLE jobs ADD CONSTRAINT jobs_abort_request_shape
    CHECK ((abort_requested_at IS NULL) = (abort_requested_by IS NULL)) NOT VALID;

-- Two more event types: an operator asked a running job to stop (abort_requested), and a
-- job ended cancelled because of an abort (aborted: at once for a waiting job, when its
-- worker stopped it for a running one). The new list holds every type of the old one, so
-- no existing row can fail it: NOT VALID spares the scan of the whole event log.
ALTER TABLE job_events DROP CONSTRAINT job_events_type_check;
ALTER TABLE job_events ADD CONSTRAINT job_events_type_check CHECK (type IN (
    'created', 'claimed', 'progress', 'lease_renewed', 'succeeded',
    'retry_scheduled', 'failed', 'timeout_requeued', 'released',
    'manual_retry', 'cancelled', 'abort_requested', 'aborted')) NOT VALID;

-- The queues workers declared, and whether each is paused. A row appears when a worker
-- that consumes the queue boots (or when an operator pauses a queue ahead of its
-- workers, with `queues pause --force`), and stays: a pause survives every worker restart. The claim statement reads
-- this table by primary key, so a pause holds on every host at the next claim, with no
-- cache to go stale. The latest pause and resume are recorded with who did them.
CREATE TABLE queues (
    queue_name  text        PRIMARY KEY CHECK (queue_name <> ''),
    paused      boolean     NOT NULL DEFAULT false,
    paused_at   timestamptz,
    paused_by   text,
    resumed_at  timestamptz,
    resumed_by  text,
    declared_at timestamptz NOT NULL DEFAULT now(),

    -- A paused queue says who paused it and when.
    CONSTRAINT queues_pause_shape CHECK (
        NOT paused OR (paused_at IS NOT NULL AND paused_by IS NOT NULL)
    )
);

-- Every actor a worker declared, with its queue: what the admin API may create jobs for.
-- Rows outlive the workers that wrote them, so an operator can enqueue while every worker
-- is being redeployed; a worker's boot refreshes seen_at (and the queue, if it moved).
CREATE TABLE actors (
    actor_name  text        PRIMARY KEY CHECK (actor_name <> ''),
    queue_name  text        NOT NULL CHECK (queue_name <> ''),
    declared_at timestamptz NOT NULL DEFAULT now(),
    seen_at     timestamptz NOT NULL DEFAULT now()
);

-- The worker processes running now: one row per process, written when it boots, refreshed
-- by its lease heartbeat, deleted when it exits cleanly. A process that stops refreshing
-- is gone once expires_at passes (readers ignore it; retention deletes the row).
CREATE TABLE workers (
    -- host:pid:random, unique per process start.
    id              text        PRIMARY KEY CHECK (id <> ''),
    host            text        NOT NULL,
    pid             integer     NOT NULL,
    queues          text[]      NOT NULL DEFAULT '{}',
    actors          text[]      NOT NULL DEFAULT '{}',
    -- The package version the process runs.
    version         text,
    started_at      timestamptz NOT NULL DEFAULT now(),
    heartbeat_at    timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    -- Attempts the process held at its last heartbeat (prefetched, running, or waiting
    -- for their outcome to be written).
    in_flight       integer     NOT NULL DEFAULT 0 CHECK (in_flight >= 0)
);

-- Listing live workers and reclaiming expired rows read this index.
CREATE INDEX workers_expires_at_idx ON workers (expires_at);

-- The events of the dramatiq-abort backend (dramatiq_pg_broker.abort): Redis keeps them as
-- lists that expire; here each notified event is a row, consumed (deleted) by the one
-- reader that takes it, ignored once expired and reclaimed later through the expiry index.
CREATE TABLE abort_events (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key         text        NOT NULL,
    params      jsonb       NOT NULL DEFAULT '{}',
    expires_at  timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Taking the oldest event of some keys.
CREATE INDEX abort_events_key_idx ON abort_events (key, id);
-- Reclaiming expired events, oldest expiry first.
CREATE INDEX abort_events_expires_at_idx ON abort_events (expires_at);
