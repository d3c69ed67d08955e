-- Named statements of the results backend (dramatiq_pg_broker.results). {schema} is filled
-- in once (as an identifier); every value is a bind parameter. The read of a live key and
-- the deletion of expired results are the statements all the backends' tables share
-- (expiring_rows.sql).

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

-- job_result --
-- The unexpired result stored for a message id (the newest, should several namespaces
-- hold one).
SELECT value, failed, expires_at, stored_at
FROM {schema}.results
WHERE message_id = %(message_id)s AND expires_at > now()
ORDER BY stored_at DESC
LIMIT 1
