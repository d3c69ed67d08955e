-- 0004: the send path. The encoded message is authoritative; idempotency keys are scoped.
--
-- Applied with search_path set to the broker's schema, like every migration.

-- The bytes the configured Dramatiq encoder produced are what a worker decodes, whatever
-- the encoder (JSON, a JSONEncoder subclass, pickle). `message` (jsonb) becomes a view for
-- the admin API's display and filters only: it is null when the bytes are not JSON, and a
-- display-safe copy when they are JSON that jsonb cannot hold (NaN, Infinity, "\u0000").
-- Rows written before this migration keep their jsonb-only form, which workers still read.
ALTER TABLE jobs DROP CONSTRAINT jobs_message_present;
ALTER TABLE jobs ADD CONSTRAINT jobs_message_stored
    CHECK (message_bytes IS NOT NULL OR message IS NOT NULL);

-- An idempotency key is unique per actor and per scope, not across the whole database: the
-- same key sent to two actors is two jobs. The scope is '' for the application's sends;
-- another writer (the admin API, per member) uses its own scope so its keys can never
-- collide with the application's.
ALTER TABLE jobs ADD COLUMN idempotency_scope text NOT NULL DEFAULT '';

CREATE UNIQUE INDEX jobs_idempotency_key_scoped_uq
    ON jobs (actor_name, idempotency_scope, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

DROP INDEX jobs_idempotency_key_uq;
