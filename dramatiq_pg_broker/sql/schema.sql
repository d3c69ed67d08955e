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
