-- Named statements of the rate-limiter backend (dramatiq_pg_broker.rate_limits). {schema} is
-- filled in once (as an identifier); every value is a bind parameter.
--
-- A key past its expires_at counts as absent (value 0) everywhere, whether or not it has
-- been reclaimed yet. Each operation is one statement: the upsert's row lock makes it atomic
-- against every other operation on the key, with no retry loop. The read of a live key and
-- the deletion of expired keys are the statements all the backends' tables share
-- (expiring_rows.sql).

-- add_key --
-- Create the key with a value unless a live one exists (an expired row is replaced).
-- Returns a row only when the key was added.
INSERT INTO {schema}.rate_limits AS r (key, value, expires_at)
VALUES (%(key)s, %(value)s, now() + %(ttl_ms)s * interval '1 millisecond')
ON CONFLICT (key) DO UPDATE
SET value = EXCLUDED.value, expires_at = EXCLUDED.expires_at
WHERE r.expires_at <= now()
RETURNING r.value

-- adjust_key --
-- Add delta (negative to decrement) to the key's live value (0 when absent or expired) if
-- the new value stays within [lower, upper]; the key then lives ttl_ms from now. Returns a
-- row only when the key changed.
-- The WHERE of the SELECT keeps an absent key from being created out of bounds; when a
-- live row exists the ON CONFLICT branch decides with its current value under the row lock.
INSERT INTO {schema}.rate_limits AS r (key, value, expires_at)
SELECT %(key)s, %(delta)s::bigint, now() + %(ttl_ms)s * interval '1 millisecond'
WHERE %(delta)s::bigint BETWEEN %(lower)s::bigint AND %(upper)s::bigint
   OR EXISTS (
        SELECT 1 FROM {schema}.rate_limits
        WHERE key = %(key)s AND expires_at > now()
   )
ON CONFLICT (key) DO UPDATE
SET value = (CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END) + EXCLUDED.value,
    expires_at = EXCLUDED.expires_at
WHERE (CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END) + EXCLUDED.value
      BETWEEN %(lower)s::bigint AND %(upper)s::bigint
RETURNING r.value

-- lock_keys --
-- First half of incr_and_sum: make every key of the sum exist (at 0, expiring in ttl_ms)
-- and lock them all, in key order so that two callers never wait on each other in a cycle.
-- An ON CONFLICT DO UPDATE whose WHERE is false still locks the existing row; a row this
-- statement inserts is ours until commit.
INSERT INTO {schema}.rate_limits AS r (key, value, expires_at)
SELECT k, 0, now() + %(ttl_ms)s * interval '1 millisecond'
FROM unnest(%(keys)s::text[]) AS k
ORDER BY k
ON CONFLICT (key) DO UPDATE
SET value = r.value
WHERE false

-- incr_within_sum --
-- Second half of incr_and_sum, in the same transaction, with every key locked: add amount
-- to the key unless its own value or amount plus the live values of `keys` would pass
-- maximum. Returns a row only when the key changed.
WITH total AS (
    SELECT coalesce(sum(value) FILTER (WHERE expires_at > now()), 0) AS value
    FROM {schema}.rate_limits
    WHERE key = ANY(%(keys)s::text[])
)
UPDATE {schema}.rate_limits AS r
SET value = (CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END) + %(amount)s::bigint,
    expires_at = now() + %(ttl_ms)s * interval '1 millisecond'
FROM total
WHERE r.key = %(key)s
  AND (CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END) + %(amount)s::bigint
      <= %(maximum)s::bigint
  AND total.value + %(amount)s::bigint <= %(maximum)s::bigint
RETURNING r.value

-- notify_key --
-- wait_notify: record that the event happened (a waiter arriving later, while it lives,
-- returns at once) and wake the waiters now. The NOTIFY is delivered at commit.
WITH noted AS (
    INSERT INTO {schema}.rate_limits AS r (key, value, expires_at)
    VALUES (%(key)s, 1, now() + %(ttl_ms)s * interval '1 millisecond')
    ON CONFLICT (key) DO UPDATE
    SET value = (CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END) + 1,
        expires_at = EXCLUDED.expires_at
    RETURNING r.key
)
SELECT pg_notify(%(channel)s, %(payload)s) FROM noted
