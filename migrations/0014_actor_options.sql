-- compatibility: compatible
-- One column with a default on the small actors table: earlier releases keep declaring actors (their rows keep empty options) and never read it.
--
-- 0014: the options each actor was declared with.
--
-- A booting worker records, beside each actor's queue, the options it declared the actor
-- with (`@dramatiq.actor(max_retries=0, priority=5)`), as far as they are JSON values
-- (never `retry_when` or `throws`). The admin API holds no actor code: a job it creates
-- takes the declared actor's `max_retries` (the row's max_attempts) and priority from here
-- instead of the global defaults.
--
-- Locking and duration: adding a column with a constant default is a catalog change only
-- (PostgreSQL 11 and later), under a brief ACCESS EXCLUSIVE lock on actors, which only a
-- booting worker and the admin API's job creation read or write.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

ALTER TABLE actors
    ADD COLUMN options jsonb NOT NULL DEFAULT '{}'::jsonb
        CONSTRAINT actors_options_object CHECK (jsonb_typeof(options) = 'object');
