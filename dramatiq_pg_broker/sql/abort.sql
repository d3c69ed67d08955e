-- Named statements of the dramatiq-abort event backend (dramatiq_pg_broker.abort). Same
-- layout as queries.sql. {schema} is filled in once (as an identifier); every value is a
-- bind parameter. Expired events are deleted by the statement all the backends' tables share
-- (expiring_rows.sql).

-- notify_events --
-- Store events (parallel arrays of keys and JSON parameters), each valid for %(ttl_ms)s,
-- and wake the processes waiting for their keys: one NOTIFY per distinct key, carrying
-- the key (or its digest), delivered at commit, so a woken waiter always finds the row.
WITH stored AS (
    INSERT INTO {schema}.abort_events (key, params, expires_at)
    SELECT key, params, now() + %(ttl_ms)s * interval '1 millisecond'
    FROM unnest(%(keys)s::text[], %(params)s::jsonb[]) AS e (key, params)
    RETURNING key
)
SELECT (SELECT count(*) FROM stored),
       (SELECT count(pg_notify(%(channel)s, payload)) FROM unnest(%(payloads)s::text[]) AS payload)

-- take_event --
-- Consume the oldest unexpired event of any of %(keys)s: the one caller that deletes it
-- gets it (SKIP LOCKED: two takers never wait for each other, nor get the same event).
DELETE FROM {schema}.abort_events
WHERE id = (
    SELECT id FROM {schema}.abort_events
    WHERE key = ANY(%(keys)s::text[]) AND expires_at > now()
    ORDER BY id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
RETURNING key, params
