-- compatibility: breaking
-- The jobs table becomes a table partitioned into lanes whose primary key is (id, lane): an earlier release's bulk send (COPY) relies on the single table's key to find an id already stored, and its complete_in() blocks at REPEATABLE READ do not wait for a lane's emptying; stop every process of an earlier release (workers and senders) before migrating.
--
-- 0028: the hot table in lanes, emptied with TRUNCATE rather than vacuumed.
--
-- Why. A job's row is inserted, updated by its claim and deleted by its end within a
-- second or so: at 300 jobs a second the table makes 600 dead row versions a second and
-- as many dead entries in its claim index. VACUUM removes them only once no snapshot in
-- the database could still see them. While one session holds a snapshot (a report in a
-- REPEATABLE READ transaction, a forgotten BEGIN, a standby's feedback), nothing is
-- removed, and each claim walks the dead entries at the head of its queue's index before
-- it finds a live row: measured (docs/benchmarks.md, "A held snapshot"), the claim went
-- from 0.1 to 130 ms in nine minutes and the table from 10 to 153 MiB, with backlogs of
-- thousands of jobs. TRUNCATE does not wait for the snapshot horizon: it gives the table
-- new, empty files at once.
--
-- How. `jobs` is now partitioned by LIST on a new column `lane`:
--
-- - lanes 0, 1 and 2 (jobs_lane_0 .. jobs_lane_2) take the rows sent during one period
--   of 10 seconds of the server's clock each, in turn: the column's default,
--   job_lane(statement_timestamp()), is the period's number modulo 3. Every insert gets it
--   (this release's and earlier ones', COPY included), no statement names it.
-- - lane 3 (jobs_lane_long) takes the rows that outlive their lane: a delayed job, a job
--   retried later, a long-running one, a backlog. It is vacuumed as the table always was.
--
-- During period p, lane (p + 1) % 3 is next: it took its last insert two periods ago
-- and takes the next one in a period. empty_job_lane(), which the workers call (see
-- dramatiq_pg_broker/attempt/lanes.py), empties it once in that period: it locks the lane
-- (ACCESS EXCLUSIVE, waiting at most the lock wait it is given, and not at all while a
-- transaction older than a second holds the lane: a long transaction is not queued
-- behind), copies its remaining rows into lane 3, then TRUNCATEs it, in one transaction.
-- A lane with more rows left than the caller's limit is left to VACUUM for this period
-- (a copy that large would hold the lock too long). Whatever a lane holds when it is not
-- emptied stays there and is claimed, finished and vacuumed as before: emptying is an
-- optimisation, never a condition of correctness.
--
-- Why the moved rows are safe. Every statement on a job names jobs and its id, not the
-- lane: a claim, heartbeat, outcome or operator statement reads every lane. While the
-- emptying holds the lane's lock, a statement that would read it waits; it takes its
-- snapshot after the wait (READ COMMITTED, or the first statement of a REPEATABLE READ
-- transaction), so it finds the row in lane 3 once the emptying commits. A transaction
-- that already read the lane holds a lock on it until it ends: the emptying cannot start
-- before it ends (a job's row locked by a complete_in() block stays where it is).
--
-- What a partitioned table changes (PostgreSQL wants the partition key in every unique
-- index):
-- - The primary key is (id, lane). An id is still stored once: every send looks for it
--   in jobs and jobs_history with its snapshot (insert_job, as since 0012), and a send
--   racing another of the same id in the same period meets the key. Two sends of the same
--   id in flight at once on either side of a period's boundary can both store it; sends
--   with an idempotency key (and unique jobs) are serialized by job_keys' unique index, as
--   before.
-- - jobs keeps no index on the idempotency key: a unique one would need the lane, and
--   job_keys (0012) already keeps each key to one job and finds the key's job (the one
--   lookup by key, after a refused send, goes through it). Each lane has three indexes:
--   the primary key, the claim order, the running rows' lease expiry. A statement on jobs
--   opens every lane and every lane's indexes: fewer indexes are fewer locks to take.
-- - Storage parameters (fillfactor 45 of 0020, the autovacuum settings of 0001) are set
--   on each partition: a partitioned table holds none.
-- - The views all_jobs and history_partitions_pending are recreated as they were (they
--   read jobs; the second names its oid).
--
-- Locking and duration: ACCESS EXCLUSIVE on jobs for the whole migration, which copies
-- every unfinished job once (one INSERT ... SELECT) and builds the indexes: sends, claims
-- and outcomes wait for it. Run it when the backlog is small.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE;

-- The period of the server's clock an instant falls in (10 seconds each), and its lane.
CREATE FUNCTION job_period(t timestamptz) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS 'SELECT floor(extract(epoch FROM t) / 10)::bigint';

CREATE FUNCTION job_lane(t timestamptz) RETURNS smallint
LANGUAGE sql STABLE PARALLEL SAFE
AS 'SELECT (floor(extract(epoch FROM t) / 10)::bigint % 3)::smallint';

CREATE TABLE jobs_laned (
    LIKE jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE,
    lane smallint NOT NULL DEFAULT job_lane(statement_timestamp())
) PARTITION BY LIST (lane);

CREATE TABLE jobs_lane_0 PARTITION OF jobs_laned FOR VALUES IN (0);
CREATE TABLE jobs_lane_1 PARTITION OF jobs_laned FOR VALUES IN (1);
CREATE TABLE jobs_lane_2 PARTITION OF jobs_laned FOR VALUES IN (2);
CREATE TABLE jobs_lane_long PARTITION OF jobs_laned FOR VALUES IN (3);

-- Each partition keeps the table's storage parameters (fillfactor, autovacuum).
DO $$
DECLARE
    options text;
    part text;
BEGIN
    SELECT array_to_string(reloptions, ', ') INTO options
    FROM pg_class WHERE oid = 'jobs'::regclass;
    IF options IS NOT NULL THEN
        FOREACH part IN ARRAY ARRAY['jobs_lane_0', 'jobs_lane_1', 'jobs_lane_2', 'jobs_lane_long']
        LOOP
            EXECUTE format('ALTER TABLE %I SET (%s)', part, options);
        END LOOP;
    END IF;
END
$$;

-- Every unfinished job goes to lane 3: it has outlived its period.
DO $$
DECLARE
    columns text;
    views text[];
    names text[];
BEGIN
    SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) INTO columns
    FROM pg_attribute AS a
    WHERE a.attrelid = 'jobs'::regclass AND a.attnum > 0 AND NOT a.attisdropped;
    EXECUTE format('INSERT INTO jobs_laned (%s, lane) SELECT %s, 3 FROM jobs', columns, columns);

    -- The views that read jobs, as they are, to be made again on the new table.
    SELECT array_agg(pg_get_viewdef(c.oid) ORDER BY c.relname),
           array_agg(c.relname::text ORDER BY c.relname)
    INTO views, names
    FROM pg_class AS c
    WHERE c.oid IN ('all_jobs'::regclass, 'history_partitions_pending'::regclass);

    ALTER TABLE jobs RENAME TO jobs_unlaned;
    ALTER TABLE jobs_laned RENAME TO jobs;
    FOR i IN 1 .. array_length(names, 1) LOOP
        EXECUTE format('CREATE OR REPLACE VIEW %I AS %s', names[i], views[i]);
    END LOOP;
    -- The privileges granted on the table, granted again on the new one and its lanes (the
    -- workers of a role that does not own them read and write the lanes, and TRUNCATE
    -- them), and on job_lanes below.
    CREATE TEMP TABLE jobs_grants ON COMMIT DROP AS
    SELECT a.privilege_type, a.grantee, a.is_grantable
    FROM pg_class AS c CROSS JOIN LATERAL aclexplode(c.relacl) AS a
    WHERE c.oid = 'jobs_unlaned'::regclass AND a.grantee <> c.relowner;
    DROP TABLE jobs_unlaned;
END
$$;

ALTER TABLE jobs ADD CONSTRAINT jobs_pkey PRIMARY KEY (id, lane);
CREATE INDEX jobs_claim_order_idx ON jobs (queue_name, priority, available_at, created_at, id)
    WHERE status = 'queued';
CREATE INDEX jobs_lease_expiry_idx ON jobs (locked_until) WHERE status = 'running';

CREATE TRIGGER jobs_refuse_outdated_claims
    AFTER UPDATE OF locked_by ON jobs
    FOR EACH ROW
    WHEN (NEW.locked_by LIKE '%:________')
    EXECUTE FUNCTION refuse_outdated_claim();

-- When each lane was last emptied (the period it was emptied in) and what that moved.
CREATE TABLE job_lanes (
    lane        smallint PRIMARY KEY CONSTRAINT job_lanes_lane_check CHECK (lane BETWEEN 0 AND 2),
    emptied_in  bigint NOT NULL DEFAULT 0,
    emptied_at  timestamptz,
    -- The transaction that emptied it: a send in an application's REPEATABLE READ
    -- transaction whose snapshot does not see it may not trust a job's absence.
    emptied_xid xid8,
    moved       bigint NOT NULL DEFAULT 0,
    -- The last emptying's wait for the lane's lock and how long it held it (ms): every
    -- statement on jobs waits while it is held.
    lock_wait_ms double precision,
    held_ms     double precision,
    -- Why the last try in a period did not empty it (NULL: it did, or none was due).
    left_because text,
    tried_at    timestamptz
);
INSERT INTO job_lanes (lane) VALUES (0), (1), (2);

DO $$
DECLARE
    g record;
    target text;
BEGIN
    FOR g IN SELECT * FROM jobs_grants LOOP
        FOREACH target IN ARRAY ARRAY['jobs', 'jobs_lane_0', 'jobs_lane_1', 'jobs_lane_2',
                                      'jobs_lane_long', 'job_lanes']
        LOOP
            EXECUTE format('GRANT %s ON %I TO %s%s', g.privilege_type, target,
                           CASE WHEN g.grantee = 0 THEN 'PUBLIC'
                                ELSE quote_ident(pg_get_userbyid(g.grantee)) END,
                           CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;
    END LOOP;
END
$$;

-- Empty the next lane (see the header): returns its number, what was done ('emptied',
-- 'not due', 'busy' when another process is at it or the lane is held, 'full' when more
-- than max_moved rows are left in it, 'duplicate' when an id of it is in lane 3 too), the
-- rows moved to lane 3, and the seconds until the next lane is due. READ COMMITTED only.
CREATE FUNCTION empty_job_lane(max_moved integer, lock_wait interval)
RETURNS TABLE (lane smallint, outcome text, moved bigint, next_due_seconds double precision)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    period bigint := job_period(now_);
    target smallint := ((job_period(now_) + 1) % 3)::smallint;
    part regclass;
    columns text;
    survivors bigint;
    duplicated boolean;
    asked_at timestamptz;
    locked_at timestamptz;
    n bigint := 0;
    wait double precision := (period + 1) * 10 - extract(epoch FROM now_);
BEGIN
    part := format('jobs_lane_%s', target)::regclass;
    lane := target;
    moved := 0;
    next_due_seconds := wait;
    -- At REPEATABLE READ or SERIALIZABLE this statement's snapshot predates the lock: the
    -- copy would be of rows as they were before the wait, and the TRUNCATE would drop
    -- their later versions. The caller begins its transaction READ COMMITTED.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'empty_job_lane() runs READ COMMITTED only, not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtext('dramatiq_pg_broker.lanes'),
                                     hashtext(current_schema())) THEN
        outcome := 'busy';
        RETURN NEXT;
        RETURN;
    END IF;
    IF (SELECT l.emptied_in FROM job_lanes AS l WHERE l.lane = target) >= period THEN
        outcome := 'not due';
        RETURN NEXT;
        RETURN;
    END IF;
    next_due_seconds := 1;
    -- A transaction that has held the lane for more than a second (a long complete_in()
    -- block, an application's long transaction that sent in it): do not queue behind it,
    -- every statement on jobs would queue behind this one.
    IF EXISTS (
        SELECT 1
        FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
        WHERE l.locktype = 'relation' AND l.relation = part AND l.pid <> pg_backend_pid()
          AND a.xact_start < now_ - interval '1 second'
    ) THEN
        UPDATE job_lanes AS l SET left_because = 'held by a long transaction', tried_at = now_
        WHERE l.lane = target;
        outcome := 'busy';
        RETURN NEXT;
        RETURN;
    END IF;
    EXECUTE format('SELECT count(*) FROM (SELECT 1 FROM %s LIMIT %s) AS s', part, max_moved + 1)
    INTO survivors;
    IF survivors > max_moved THEN
        UPDATE job_lanes AS l
        SET left_because = format('more than %s rows left in it', max_moved), tried_at = now_
        WHERE l.lane = target;
        outcome := 'full';
        RETURN NEXT;
        RETURN;
    END IF;
    asked_at := clock_timestamp();
    BEGIN
        -- (A lock_timeout of 0 would wait for ever: one millisecond at least.)
        PERFORM set_config('lock_timeout',
                           greatest(1, (extract(epoch FROM lock_wait) * 1000)::bigint)::text, true);
        EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
        locked_at := clock_timestamp();
    EXCEPTION WHEN lock_not_available THEN
        UPDATE job_lanes AS l SET left_because = 'busy', tried_at = now_ WHERE l.lane = target;
        outcome := 'busy';
        RETURN NEXT;
        RETURN;
    END;
    -- An id stored in this lane and in the long lane too (two sends of one id on either
    -- side of a period's boundary, see the header): the copy would break the key. Leave
    -- the lane to vacuum until one of the two rows ends.
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM %s AS j JOIN jobs_lane_long AS l ON l.id = j.id)', part)
    INTO duplicated;
    IF duplicated THEN
        UPDATE job_lanes AS l
        SET left_because = 'an id in it is also in the long lane', tried_at = now_
        WHERE l.lane = target;
        outcome := 'duplicate';
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) INTO columns
    FROM pg_attribute AS a
    WHERE a.attrelid = 'jobs'::regclass AND a.attnum > 0 AND NOT a.attisdropped
      AND a.attname <> 'lane';
    EXECUTE format('INSERT INTO jobs (%s, lane) SELECT %s, 3 FROM %s', columns, columns, part);
    GET DIAGNOSTICS n = ROW_COUNT;
    EXECUTE format('TRUNCATE %s', part);
    UPDATE job_lanes AS l
    SET emptied_in = period, emptied_at = clock_timestamp(), emptied_xid = pg_current_xact_id(),
        moved = n, left_because = NULL, tried_at = now_,
        lock_wait_ms = extract(epoch FROM locked_at - asked_at) * 1000,
        held_ms = extract(epoch FROM clock_timestamp() - locked_at) * 1000
    WHERE l.lane = target;
    outcome := 'emptied';
    moved := n;
    next_due_seconds := wait;
    RETURN NEXT;
END
$$;
