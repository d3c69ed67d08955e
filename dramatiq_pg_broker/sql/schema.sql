-- The schema handshake (handshake.py): what the database says about its own schema.

-- read_migrations --
-- Every applied migration, with its compatibility kind and the package version that
-- applied it: the handshake's one round trip (a few dozen small rows).
SELECT version, name, compatibility, code_version
FROM {schema}.schema_migrations
ORDER BY version

-- read_migrations_before_contract --
-- The same for a schema not yet at migration 0010, which adds the last two columns.
SELECT version, name, NULL::text AS compatibility, NULL::text AS code_version
FROM {schema}.schema_migrations
ORDER BY version

-- running_migration --
-- The session of a `migrate` that holds the schema's migration lock (the two keys of
-- migrate.lock_key; pg_locks shows a negative key as its unsigned 32 bits): its process id
-- and since when it is connected. No row: no migration runs.
SELECT l.pid, a.backend_start
FROM pg_locks AS l
LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = %(namespace)s::bigint::oid
  AND l.objid = %(key)s::bigint::oid
  AND l.objsubid = 2
LIMIT 1

-- wait_for_migration_lock --
-- Wait (up to the transaction's lock_timeout) until the migrator releases the schema's
-- migration lock: a shared lock conflicts with its exclusive one, and this one is released
-- at once, with the transaction.
SELECT pg_advisory_xact_lock_shared(%(namespace)s, %(key)s)
