-- compatibility: compatible
-- Adds a function and recreates the view all_jobs with the same columns: earlier releases keep writing the jsonb copy (which the view shows as before) and read the view as before; rows written without the copy show the same message through it.
--
-- 0018: one copy of the message where two are not needed.
--
-- Since 0004 the encoded bytes (message_bytes) are what workers decode and the jsonb
-- column (message) is a view of them for display only: the admin API's job detail and
-- list previews, and the CLI's job view. For most messages that view was the bytes parsed
-- as they are (the stock JSON encoder, no value jsonb cannot hold): a second copy of
-- every message, written at each send, again by each claim (a new row version carries
-- every column) and by the move to history. Measured with the life workload of the
-- benchmarks it was about a sixth of a job's WAL (see docs/benchmarks.md).
--
-- From here a sender writes message only when it differs from the parsed bytes (a
-- display-safe copy: NaN as a string, NUL characters as U+FFFD) and leaves it null when
-- the bytes parse as they are; the view all_jobs, which every reader of the message
-- goes through, parses the bytes when message is null: message_view below. Bytes that are
-- not JSON (another encoder, such as pickle) parse to nothing, so the message is opaque
-- as before. A row written before this migration, or by an earlier release, has its copy
-- and shows it. The parse runs on the rows a read returns (a page, a job), never on a
-- scan: no filter of the admin API reads the message.
--
-- Locking and duration: CREATE OR REPLACE VIEW keeps the view's columns (same names,
-- types and order) and holds an ACCESS EXCLUSIVE lock on the view alone for the instant
-- of the catalog change; the tables are not touched.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

-- The jsonb view of a stored message: the copy when there is one, else the bytes parsed
-- as JSON, else null (no bytes, or bytes that are not JSON jsonb can hold).
CREATE FUNCTION message_view(message jsonb, message_bytes bytea) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    IF message IS NOT NULL OR message_bytes IS NULL THEN
        RETURN message;
    END IF;
    RETURN convert_from(message_bytes, 'UTF8')::jsonb;
EXCEPTION WHEN data_exception OR program_limit_exceeded THEN
    -- Not UTF-8, not JSON, or JSON that jsonb cannot hold (a NUL character, too deep).
    RETURN NULL;
END
$$;

CREATE OR REPLACE VIEW all_jobs AS
SELECT id, queue_name, actor_name, message_view(message, message_bytes) AS message,
       message_bytes, status, priority, available_at,
       attempts, max_attempts, idempotency_key, locked_by, locked_until, last_error, result,
       created_at, updated_at, started_at, finished_at, started, failures, interruptions,
       idempotency_scope, abandoned_claims, abort_requested_at, abort_requested_by
FROM jobs
UNION ALL
SELECT id, queue_name, actor_name, message_view(message, message_bytes) AS message,
       message_bytes, status, priority, available_at,
       attempts, max_attempts, idempotency_key, locked_by, locked_until, last_error, result,
       created_at, updated_at, started_at, finished_at, started, failures, interruptions,
       idempotency_scope, abandoned_claims, abort_requested_at, abort_requested_by
FROM jobs_history;
