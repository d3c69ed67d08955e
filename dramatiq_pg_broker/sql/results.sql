-- Named statements of the results backend (dramatiq_pg_broker.results). {schema} is filled
-- in once (as an identifier); every value is a bind parameter.

-- store_result --
-- Store (or replace) the result under its key, valid for ttl_ms from now, and wake the
-- readers blocked on it: the NOTIFY carries the key and is delivered at commit, so a woken
-- reader always finds the row.
WITH stored AS (
    INSERT INTO {schema}.results AS r (key, message_id, value, failed, expires_at, stored_at)
    VALUES (
        %(key)s, %(message_id)s, %(value)s, %(failed)s,
        now() + %(ttl_ms)s * interval '1 millisecond', now()
    )
    ON CONFLICT (key) DO UPDATE
    SET message_id = EXCLUDED.message_id,
        value = EXCLUDED.value,
        failed = EXCLUDED.failed,
        expires_at = EXCLUDED.expires_at,
        stored_at = EXCLUDED.stored_at
    RETURNING r.key
)
SELECT pg_notify(%(channel)s, %(payload)s) FROM stored

-- get_result --
-- The stored value of a key, unless it has expired (an expired row may still be there
-- until it is reclaimed; it is already gone for readers).
SELECT value
FROM {schema}.results
WHERE key = %(key)s AND expires_at > now()

-- prune_results --
-- Delete at most `limit` expired results, oldest expiry first, through the expiry index.
-- SKIP LOCKED: two processes reclaiming at once split the work instead of queueing.
DELETE FROM {schema}.results
WHERE key IN (
    SELECT key
    FROM {schema}.results
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)

-- job_result --
-- The unexpired result stored for a message id (the newest, should several namespaces
-- hold one).
SELECT value, failed, expires_at, stored_at
FROM {schema}.results
WHERE message_id = %(message_id)s AND expires_at > now()
ORDER BY stored_at DESC
LIMIT 1
