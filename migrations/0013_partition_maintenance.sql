-- compatibility: compatible
-- Adds functions, an index on the events' DEFAULT partition and a new body for create_history_partitions with the same signature: processes of the previous release keep working.
--
-- 0013: partition maintenance that never stalls the hot path.
--
-- 0012 created a day's partitions with CREATE TABLE ... PARTITION OF, which takes an
-- ACCESS EXCLUSIVE lock on the parent that every outcome (jobs_history_<status>) and every
-- event (job_events) writes: behind a long reader of history, each parent waited its lock
-- timeout while the parents already taken stayed locked, and sends and outcomes queued
-- behind it (or deadlocked with it). From here a partition is made in two steps, each its
-- own transaction run by the maintenance code (dramatiq_pg_broker/retention.py) under a
-- short lock_timeout:
--
-- 1. prepare_history_partition: a standalone table LIKE the parent (its columns,
--    defaults, constraints and indexes) with a CHECK constraint matching the day's
--    bound. It locks nothing anybody else uses (ACCESS SHARE on the parent for LIKE).
-- 2. attach_history_partition: ALTER TABLE parent ATTACH PARTITION, which takes SHARE
--    UPDATE EXCLUSIVE on the parent (inserts, updates, deletes and reads go on) and
--    ACCESS EXCLUSIVE on the new table and on the parent's DEFAULT partition. The CHECK
--    constraint lets PostgreSQL skip scanning the new table; the DEFAULT partition is
--    still scanned (to prove it holds no row of the day), which is why maintenance keeps
--    it empty (the `default` step) and this migration indexes the events' DEFAULT
--    partition by created_at (history's DEFAULT partitions have jobs_history_finished_idx).
--
-- A partition is dropped by detach_history_partition (plain DETACH: PostgreSQL refuses
-- DETACH ... CONCURRENTLY while the parent has a DEFAULT partition, and every parent here
-- has one), then DROP TABLE of the detached table, each in its own transaction.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

-- The name of a parent's partition for a UTC day, and its bound.
CREATE FUNCTION history_partition_name(parent text, day date) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT parent || '_' || to_char(day, 'YYYYMMDD')
$$;

-- The standalone table for a day of one parent (jobs_history_<status> or job_events),
-- made unless a table of that name exists already (attached or not). Returns true when it
-- made it. Safe from many processes at once: the loser of a race gets false.
CREATE FUNCTION prepare_history_partition(parent text, day date) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    name text := history_partition_name(parent, day);
    col text := CASE WHEN parent = 'job_events' THEN 'created_at' ELSE 'finished_at' END;
    status_check text := CASE WHEN parent = 'job_events' THEN ''
                              ELSE format(' AND status = %L', substr(parent, 14)) END;
BEGIN
    IF parent NOT IN ('jobs_history_succeeded', 'jobs_history_failed',
                      'jobs_history_cancelled', 'job_events') THEN
        RAISE EXCEPTION 'not a parent of history: %', parent;
    END IF;
    IF to_regclass(quote_ident(name)) IS NOT NULL THEN
        RETURN false;
    END IF;
    BEGIN
        EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                       'INCLUDING INDEXES INCLUDING STORAGE)', name, parent);
    EXCEPTION
        WHEN duplicate_table OR unique_violation THEN
            RETURN false;  -- another process made it meanwhile
    END;
    EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I CHECK (%I >= %L AND %I < %L%s)',
                   name, name || '_bound',
                   col, day::timestamp AT TIME ZONE 'UTC',
                   col, (day + 1)::timestamp AT TIME ZONE 'UTC', status_check);
    RETURN true;
END
$$;

-- Attach a day's prepared table to its parent; false when it is attached already (or was
-- never prepared). SHARE UPDATE EXCLUSIVE on the parent, ACCESS EXCLUSIVE on the table
-- and on the parent's DEFAULT partition, which is scanned: it fails with check_violation
-- while the DEFAULT partition holds rows of that day (the `default` step moves them).
CREATE FUNCTION attach_history_partition(parent text, day date) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    name text := history_partition_name(parent, day);
    rel regclass := to_regclass(quote_ident(history_partition_name(parent, day)));
BEGIN
    IF rel IS NULL OR EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = rel) THEN
        RETURN false;
    END IF;
    -- Two attachers of one table take turns on it (nobody else uses it yet); the second
    -- then finds it attached.
    EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', name);
    IF EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = rel) THEN
        RETURN false;
    END IF;
    EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                   parent, name, day::timestamp AT TIME ZONE 'UTC',
                   (day + 1)::timestamp AT TIME ZONE 'UTC');
    RETURN true;
END
$$;

-- Detach a partition (by name) from its parent; false when it is not a partition. Plain
-- DETACH takes ACCESS EXCLUSIVE on the parent for an instant (the caller's lock_timeout
-- bounds the wait); the detached table is then dropped in a transaction of its own.
CREATE FUNCTION detach_history_partition(name text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    parent regclass;
BEGIN
    SELECT i.inhparent::regclass INTO parent
    FROM pg_inherits AS i
    WHERE i.inhrelid = to_regclass(quote_ident(name));
    IF parent IS NULL THEN
        RETURN false;
    END IF;
    EXECUTE format('ALTER TABLE %s DETACH PARTITION %I', parent, name);
    RETURN true;
END
$$;

-- Tables named like a day's partition of history that are not attached (prepared and not
-- attached yet, or detached and not dropped yet), with their parent and day. The regclass
-- constant is stored as the jobs table's oid: the view needs no schema name.
CREATE VIEW history_partitions_pending AS
SELECT m[1] AS parent, to_date(m[2], 'YYYYMMDD') AS day, c.relname::text AS partition
FROM pg_class AS c
CROSS JOIN LATERAL regexp_match(
    c.relname,
    '^(jobs_history_succeeded|jobs_history_failed|jobs_history_cancelled|job_events)_(\d{8})$'
) AS m
WHERE m IS NOT NULL
  AND c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = 'jobs'::regclass)
  AND c.relkind = 'r'
  AND NOT c.relispartition;

-- The same signature as 0012's (processes of the previous release call it), in the new
-- two steps: prepare, then attach, each partition on its own. Within this one function
-- they share a transaction; the maintenance code of this release calls the two steps in
-- transactions of their own instead.
CREATE OR REPLACE FUNCTION create_history_partitions(first_day date, last_day date)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    day date;
    parent text;
    created integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(1685221479, hashtext(current_schema()));
    FOR day IN SELECT generate_series(first_day, last_day, interval '1 day')::date LOOP
        FOREACH parent IN ARRAY ARRAY['jobs_history_succeeded', 'jobs_history_failed',
                                      'jobs_history_cancelled', 'job_events'] LOOP
            BEGIN
                PERFORM prepare_history_partition(parent, day);
                IF attach_history_partition(parent, day) THEN
                    created := created + 1;
                END IF;
            EXCEPTION
                WHEN check_violation OR lock_not_available THEN
                    -- Rows of that day in the DEFAULT partition, or a long reader: the
                    -- maintenance steps deal with the day.
                    NULL;
            END;
        END LOOP;
    END LOOP;
    RETURN created;
END
$$;

ALTER FUNCTION prepare_history_partition(text, date) SET search_path FROM CURRENT;
ALTER FUNCTION attach_history_partition(text, date) SET search_path FROM CURRENT;
ALTER FUNCTION detach_history_partition(text) SET search_path FROM CURRENT;
ALTER FUNCTION create_history_partitions(date, date) SET search_path FROM CURRENT;

-- The `default` step finds the days held by the events' DEFAULT partition, and deletes
-- its expired rows, by this index (history's DEFAULT partitions have
-- jobs_history_finished_idx for the same).
CREATE INDEX job_events_default_created_at_idx ON job_events_default (created_at);
