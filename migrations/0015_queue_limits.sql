-- compatibility: compatible
-- A new table only: processes of earlier releases never read it (their claims ignore a limit), and nothing they write touches it.
--
-- 0015: queue concurrency limits. At most N jobs of a queue run at a time, however many
-- worker processes and hosts consume it (see dramatiq_pg_broker.limits).
--
-- A limit is one row here, read by every worker's claim of that queue: a claim of a
-- limited queue takes a transaction-level advisory lock on the queue, counts the queue's
-- running jobs and claims at most the difference, so a change holds at the next claim on
-- every host, with no restart. A queue without a row is unlimited and its claim is the
-- plain one (claim_jobs), which never reads this table.
--
-- Beside workers of the previous releases: they do not read the table, so during a rolling
-- upgrade their claims are not held to a limit (their running jobs still count against it
-- for the new workers).
--
-- Locking and duration: a new, empty table; nothing existing is locked.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

CREATE TABLE queue_limits (
    queue_name  text        PRIMARY KEY CHECK (queue_name <> ''),
    -- At most this many jobs of the queue are `running` at once (claimed by a worker,
    -- started or about to start). A pause, not a limit of 0, stops a queue.
    max_running integer     NOT NULL CHECK (max_running >= 1),
    -- Who set it: 'code' (a worker applied the queue_limits setting it was started with)
    -- or 'operator' (the CLI or the admin API). A worker's setting replaces only a limit
    -- set by code: an operator's limit stands until an operator changes or clears it.
    source      text        NOT NULL CHECK (source IN ('code', 'operator')),
    set_by      text        NOT NULL,
    set_at      timestamptz NOT NULL DEFAULT now()
);
