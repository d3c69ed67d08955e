-- The statements of the rule every backend's table keeps (results, rate_limits,
-- abort_events): a row lives until its expires_at; past it, it counts as absent at once and
-- is deleted later, in batches, through the expiry index. {schema}, {table} and {key} (the
-- column that identifies a row) are filled in as identifiers; every value is a bind
-- parameter.

-- live_value --
-- The value stored under a key, unless its row has expired (an expired row may still be
-- there until it is reclaimed; it is already gone for readers). The tables with a value
-- column: results and rate_limits.
SELECT value
FROM {schema}.{table}
WHERE {key} = %(key)s AND expires_at > now()

-- prune_expired --
-- Delete at most `limit` expired rows, oldest expiry first, through the expiry index.
-- SKIP LOCKED: two processes reclaiming at once split the work instead of queueing.
DELETE FROM {schema}.{table}
WHERE {key} IN (
    SELECT {key}
    FROM {schema}.{table}
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
