-- Named statements of the worker registry (dramatiq_pg_broker.workers): the worker
-- processes running now and the actors they declared. Same layout as queries.sql.

-- register_worker --
-- A worker process writes (or refreshes) its row: at boot, and with every lease heartbeat.
-- schema_level is the highest migration its code ships (what `migrate` compares).
-- An upsert, so a row deleted while the process could not reach the database (it expired
-- and was reclaimed) comes back at the next beat. It stays live until expires_at.
-- connections is the process's connection budget (Settings.connection_budget), which
-- doctor adds up against max_connections.
INSERT INTO {schema}.workers AS w (
    id, host, pid, queues, actors, version, schema_level, started_at, heartbeat_at,
    expires_at, in_flight, connections
)
VALUES (
    %(id)s, %(host)s, %(pid)s, %(queues)s, %(actors)s, %(version)s, %(schema_level)s,
    %(started_at)s, now(), now() + %(ttl_ms)s * interval '1 millisecond', %(in_flight)s,
    %(connections)s
)
ON CONFLICT (id) DO UPDATE
SET heartbeat_at = now(),
    expires_at = now() + %(ttl_ms)s * interval '1 millisecond',
    in_flight = excluded.in_flight

-- declare_actors --
-- The actors a booting worker knows, each with its queue and the JSON options it was
-- declared with (the arrays are parallel): what the admin API may create jobs for, and
-- with which max_retries and priority. A known actor is refreshed (its queue and options
-- may have changed).
INSERT INTO {schema}.actors AS a (actor_name, queue_name, options)
SELECT name, queue, options
FROM unnest(%(names)s::text[], %(queues)s::text[], %(options)s::jsonb[]) AS d (name, queue, options)
ON CONFLICT (actor_name) DO UPDATE
SET queue_name = excluded.queue_name, options = excluded.options, seen_at = now()

-- remove_worker --
-- A worker process exits cleanly: its row goes at once.
DELETE FROM {schema}.workers WHERE id = %(id)s

-- list_workers --
-- The live worker processes (not expired), oldest first.
SELECT id, host, pid, queues, actors, version, schema_level, started_at, heartbeat_at,
       expires_at, in_flight, connections
FROM {schema}.workers
WHERE expires_at > now()
ORDER BY started_at, id

-- live_workers_by_queue --
-- How many live worker processes consume each queue now (a queue none consumes is not
-- listed): its jobs wait for one.
SELECT queue_name, count(*)
FROM {schema}.workers AS w, unnest(w.queues) AS queue_name
WHERE w.expires_at > now()
GROUP BY queue_name

-- list_actors --
-- Every declared actor with its queue, and how many live workers declare it now.
SELECT a.actor_name, a.queue_name, a.declared_at, a.seen_at,
       (SELECT count(*) FROM {schema}.workers AS w
        WHERE w.expires_at > now() AND a.actor_name = ANY(w.actors)) AS live_workers
FROM {schema}.actors AS a
ORDER BY a.actor_name

-- actor_queue --
-- The queue of a declared actor (no row: no worker ever declared it).
SELECT queue_name FROM {schema}.actors WHERE actor_name = %(name)s

-- actor_declaration --
-- The queue and the declared options of an actor (no row: no worker ever declared it).
SELECT queue_name, options FROM {schema}.actors WHERE actor_name = %(name)s

-- prune_workers --
-- Delete at most %(limit)s rows of worker processes that stopped refreshing (they died, or
-- lost the database for longer than their lease), through the expiry index.
DELETE FROM {schema}.workers
WHERE id IN (
    SELECT id FROM {schema}.workers
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
