-- compatibility: compatible
-- Only adds nullable columns to schema_migrations (0.1.0 names the columns it reads and writes there); the job tables are unchanged.
--
-- 0010: the schema handshake.
--
-- From this migration on, every migration file starts with a compatibility header (see
-- the upgrading guide): compatible, when every release the schema still admits keeps
-- working beside the new one; breaking, when the processes of earlier releases must stop.
-- schema_migrations now records, for each migration from here on, its kind, the reason
-- its header gives, and the package version that applied it. The schema's minimum code
-- level is the version of the latest breaking migration applied: a process whose code
-- does not ship that migration refuses the schema when it starts, with one line saying
-- what to upgrade, instead of failing statement by statement. Migrations 0001-0009 were
-- released before the contract and keep NULL here.
--
-- Applied with search_path set to the broker's schema, so the names are unqualified.

ALTER TABLE schema_migrations
    ADD COLUMN compatibility text,
    ADD COLUMN reason text,
    ADD COLUMN code_version text,
    ADD CONSTRAINT schema_migrations_compatibility_kind
        CHECK (compatibility IN ('compatible', 'breaking'));

COMMENT ON COLUMN schema_migrations.compatibility IS
    'compatible or breaking, from the file''s header (NULL: released before the contract, 0001-0009). The latest breaking version is the oldest code level that may use the schema.';
COMMENT ON COLUMN schema_migrations.reason IS
    'Why the migration is compatible or breaking, from the second line of its header.';
COMMENT ON COLUMN schema_migrations.code_version IS
    'The dramatiq-pg-broker version that applied the migration.';
