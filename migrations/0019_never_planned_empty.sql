-- compatibility: compatible
-- Sets one storage parameter of the jobs table (vacuum_truncate off) and forgets the statistics of tables that never held a row: no statement of any release depends on either.
--
-- 0019: the planner never takes the job tables for empty when they are not.
--
-- An ANALYZE of an empty table records it as known to be empty, and PostgreSQL then
-- plans every lookup in it as a sequential scan (cheapest for an empty table). The plans
-- the workers' connections prepare while that holds are kept as the table fills, until
-- its next ANALYZE: every send's id probe, every claim, renewal and outcome reads (and
-- sorts) the whole table, for as long as autovacuum takes to analyze it again (a minute
-- or more), or for good on a server without autovacuum. Measured on a fresh schema: 151
-- sequential scans of jobs for 30 jobs, and each send read all of today's history.
-- Two ways in, both closed here.
--
-- 1. Migration 0012 analyzed jobs, jobs_history, job_events and job_owners, empty on a
--    new install, and the daily partitions it made ahead. A table with no page at all
--    never held a row, so no snapshot can see one in it: TRUNCATE changes nothing in it
--    but its statistics, back to "never analyzed", which the planner takes for a few
--    pages (and the index lookups win) until autovacuum's first ANALYZE. A table another
--    session holds a lock on is left as it is (NOWAIT); its statistics then mend at that
--    ANALYZE, as before.
--
-- 2. A VACUUM that finds the last pages of a table empty gives them back to the file
--    system: once a backlog has drained, the jobs table shrinks to nothing, and the
--    ANALYZE that follows records it as empty, so the next burst is planned as above.
--    With vacuum_truncate off, the table keeps its pages, is planned by what it holds per
--    page, and the lookups stay on their indexes. It also spares the hot path the lock
--    that truncation takes: ACCESS EXCLUSIVE on jobs while VACUUM checks, page by page
--    from the end, that the pages are still empty (every send, claim, renewal and outcome
--    waits, for up to about 20 ms each time), replayed on hot standbys, where it cancels or
--    delays the reads it conflicts with.
--    The cost: the file keeps its largest size. The pages a backlog left are reused by the
--    next jobs (a queue table's size is that of its busiest moment, not of its history);
--    `VACUUM (TRUNCATE) jobs` gives them back on demand, with the lock above.
--
-- Locking and duration: SET of a storage parameter takes SHARE UPDATE EXCLUSIVE on jobs
-- (sends, claims and outcomes do not wait for it) for the instant of the catalog change;
-- each TRUNCATE, ACCESS EXCLUSIVE on one table without a page, taken only if free at once.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

ALTER TABLE jobs SET (vacuum_truncate = false);

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
