-- Named statements of queue limits (dramatiq_pg_broker.limits): setting, clearing and
-- reading them, and the lock a claim of a limited queue takes before it reads the room
-- left under the limit (queries.sql limited_queue_room, beside the reaper's statement,
-- whose idea of an expired lease it shares) and claims (JobStore.claim_limited). Same
-- layout as queries.sql.

-- set_queue_limit --
-- An operator's limit (the CLI, the admin API): it replaces any limit of the queue,
-- whoever set it. Returns the row.
INSERT INTO {schema}.queue_limits (queue_name, max_running, source, set_by, set_at)
VALUES (%(name)s, %(limit)s, 'operator', %(by)s, now())
ON CONFLICT (queue_name) DO UPDATE
SET max_running = EXCLUDED.max_running, source = 'operator', set_by = EXCLUDED.set_by,
    set_at = EXCLUDED.set_at
RETURNING queue_name, max_running, source, set_by, set_at

-- clear_queue_limit --
-- Lift a queue's limit, whoever set it. Returns the row removed (nothing: it had none).
DELETE FROM {schema}.queue_limits WHERE queue_name = %(name)s
RETURNING queue_name

-- apply_code_limits --
-- The limits a booting worker was configured with (the queue_limits setting). A queue
-- with no limit gets the configured one; a limit set by code takes the new value; a limit
-- an operator set is left as it is. Returns the queues whose limit changed.
INSERT INTO {schema}.queue_limits AS l (queue_name, max_running, source, set_by, set_at)
SELECT name, max_running, 'code', %(by)s, now()
FROM unnest(%(names)s::text[], %(limits)s::int[]) AS w (name, max_running)
ON CONFLICT (queue_name) DO UPDATE
SET max_running = EXCLUDED.max_running, set_by = EXCLUDED.set_by, set_at = EXCLUDED.set_at
WHERE l.source = 'code' AND l.max_running <> EXCLUDED.max_running
RETURNING queue_name

-- get_queue_limit --
-- One queue's limit, if it has one.
SELECT queue_name, max_running, source, set_by, set_at
FROM {schema}.queue_limits
WHERE queue_name = %(name)s

-- queue_limits --
-- Every limit (a worker's cache of which queues are limited: one small read, at most once
-- a second per process while it claims, and when a change is announced).
SELECT queue_name, max_running, source, set_by, set_at
FROM {schema}.queue_limits
ORDER BY queue_name

-- notify_limit --
-- Tell a queue's consumers on every host that its limit changed (payload 'limit'): they
-- read the limits again before their next claim. Delivered at commit.
SELECT pg_notify(%(channel)s, 'limit')

-- lock_limited_queue --
-- The first statement of a limited queue's claim, in the claim's transaction: claims of
-- the queue take turns, on every host, until their transaction ends. An advisory lock of
-- the transaction, not of the session: nothing is held across statements outside the
-- transaction, so transaction-mode poolers (PgBouncer) keep working. Its own statement:
-- the statements after it take their snapshot once the lock is granted, and so see every
-- claim committed before (the transaction is READ COMMITTED whatever the server's
-- default_transaction_isolation: at the stricter levels this statement's snapshot, taken
-- before its wait, would be the transaction's).
SELECT pg_advisory_xact_lock(hashtext('dramatiq_pg_broker.queue_limit'), hashtext(%(key)s))
