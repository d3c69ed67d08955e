-- 0005: the results backend's table and the rate-limiter backend's table.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.
-- Neither table references jobs: both backends also serve Dramatiq's Redis and RabbitMQ
-- brokers, whose messages have no job row.

-- One stored actor result (or stored failure) per Dramatiq result key. A result is valid
-- until expires_at; readers ignore a row past it at once, and its storage is reclaimed in
-- small batches through the expiry index (never a full scan).
CREATE TABLE results (
    -- ResultBackend.build_message_key(message): namespace, queue, actor and message id.
    key         text        PRIMARY KEY,
    -- The message id alone, so an operator can find the result of a job.
    message_id  text        NOT NULL,
    -- The backend encoder's bytes (JSON by default, pickle if the application chose it).
    value       bytea       NOT NULL,
    -- True when the value is a stored exception (the actor failed for good).
    failed      boolean     NOT NULL DEFAULT false,
    expires_at  timestamptz NOT NULL,
    stored_at   timestamptz NOT NULL DEFAULT now()
);

-- Reclaiming expired results reads this index from the oldest expiry and stops at the batch
-- size.
CREATE INDEX results_expires_at_idx ON results (expires_at);

-- The admin API's job detail looks a result up by its job id.
CREATE INDEX results_message_id_idx ON results (message_id);

-- Results are written once per job and deleted once: vacuum early so a busy table stays
-- small.
ALTER TABLE results SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05
);

-- Counters, barriers and wait events of Dramatiq's rate limiters. UNLOGGED: every acquire and
-- release of a limiter is a write, and an unlogged table writes no WAL (no flush per
-- statement, no replication traffic). The price: after a server crash (not a clean restart)
-- or on a promoted replica the table is empty, so limits restart from zero and an open
-- barrier is forgotten. A deployment that cannot accept that runs
-- `ALTER TABLE <schema>.rate_limits SET LOGGED` once; nothing else changes.
CREATE UNLOGGED TABLE rate_limits (
    key         text        PRIMARY KEY,
    value       bigint      NOT NULL,
    -- A key past its expiry counts as absent; reclaiming deletes it later.
    expires_at  timestamptz NOT NULL
);

-- Reclaiming expired keys reads this index from the oldest expiry.
CREATE INDEX rate_limits_expires_at_idx ON rate_limits (expires_at);

-- A few hot rows updated constantly: keep room on each page for their new versions and
-- vacuum often.
ALTER TABLE rate_limits SET (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 200
);
