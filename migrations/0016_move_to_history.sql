-- compatibility: compatible
-- Recreates the view all_jobs with the same columns, named instead of `SELECT *`: every release reads it as before.
--
-- 0016: the job row, named once.
--
-- 0012 made all_jobs with `SELECT * FROM jobs UNION ALL SELECT * FROM jobs_history`.
-- PostgreSQL expands the star when a view is created and stores the columns it found then,
-- so a column added to both tables later would have been left out of the view, silently:
-- the admin API and the CLI, which read jobs through it, would never see it. The view now
-- names its columns, in the order of the tables, as the statements of the broker do
-- (the block job_columns of sql/queries.sql): a migration that adds a column to the job
-- row recreates this view with it, and a test compares the view, both tables and that
-- block with each other in the migrated schema.
--
-- Locking and duration: CREATE OR REPLACE VIEW keeps the view's columns (same names, types
-- and order), so nothing that depends on it is touched; it holds an ACCESS EXCLUSIVE lock
-- on the view alone (not on the tables) for the instant of the catalog change.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

CREATE OR REPLACE VIEW all_jobs AS
SELECT id, queue_name, actor_name, message, message_bytes, status, priority, available_at,
       attempts, max_attempts, idempotency_key, locked_by, locked_until, last_error, result,
       created_at, updated_at, started_at, finished_at, started, failures, interruptions,
       idempotency_scope, abandoned_claims, abort_requested_at, abort_requested_by
FROM jobs
UNION ALL
SELECT id, queue_name, actor_name, message, message_bytes, status, priority, available_at,
       attempts, max_attempts, idempotency_key, locked_by, locked_until, last_error, result,
       created_at, updated_at, started_at, finished_at, started, failures, interruptions,
       idempotency_scope, abandoned_claims, abort_requested_at, abort_requested_by
FROM jobs_history;
