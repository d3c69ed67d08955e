-- compatibility: compatible
-- Truncates the job tables and daily partitions that never held a row (no page at all), which changes nothing in them but their statistics: no statement of any release depends on those.
--
-- 0019: tables that never held a row are not planned as known to be empty.
--
-- An ANALYZE of an empty table records it as known to be empty, and PostgreSQL then
-- plans every lookup in it as a sequential scan (cheapest for an empty table). The plans
-- the workers' connections prepare while that holds are kept as the table fills, until
-- its next ANALYZE: every send's id probe, every claim, renewal and outcome reads the
-- whole table, for as long as autovacuum takes to analyze it again (a minute or more
-- after the first rows), or for good on a server without autovacuum. Measured on a fresh
-- schema: 151 sequential scans of jobs for 30 jobs, and each send read all of today's
-- history.
--
-- Migration 0012 analyzed jobs, jobs_history, job_events and job_owners, empty on a new
-- install, and the daily partitions it made ahead. A table with no page at all holds no
-- row that any snapshot could see: TRUNCATE changes nothing in it but its statistics, back to "never analyzed", which the planner takes for a few pages (and the
-- index lookups win) until autovacuum's first ANALYZE. A table another session holds a
-- lock on is left as it is (NOWAIT); its statistics then mend at that ANALYZE, as before.
--
-- Locking and duration: each TRUNCATE takes ACCESS EXCLUSIVE on one table without a page,
-- only if it is free at once, until the migration commits (an instant).
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

DO $$
DECLARE
    t regclass;
BEGIN
    FOR t IN
        SELECT c.oid::regclass
        FROM pg_class AS c
        WHERE c.oid IN (
            SELECT 'jobs'::regclass
            UNION ALL SELECT 'job_owners'::regclass
            UNION ALL SELECT relid FROM pg_partition_tree('jobs_history') WHERE isleaf
            UNION ALL SELECT relid FROM pg_partition_tree('job_events') WHERE isleaf
        )
          AND c.reltuples = 0 AND pg_relation_size(c.oid) = 0
    LOOP
        BEGIN
            EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE NOWAIT', t);
            -- Still without a page, now that no other session can write to it.
            IF pg_relation_size(t) = 0 THEN
                EXECUTE format('TRUNCATE %s', t);
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
    END LOOP;
END
$$;
