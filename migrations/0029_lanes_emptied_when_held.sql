-- compatibility: compatible
-- Two new columns of job_lanes (a constant default: no row rewritten), 0028's empty_job_lane() renamed empty_job_lane_now() and a new empty_job_lane() with a third argument that has a default in front of it (an earlier release's two-argument call reaches it and gets the same columns back), and a new function claim_wait() that earlier releases do not call.
--
-- 0029: a lane is emptied only while a snapshot holds the horizon (or too many rows are
-- left in it).
--
-- Why. 0028 emptied a lane every period, whatever held the database's xmin horizon. A
-- TRUNCATE is not free for the rest of the table's users: it takes the lane's ACCESS
-- EXCLUSIVE lock (every statement on jobs waits for it) and it invalidates every cached
-- plan on jobs in every session, which replans at its next statement. Measured against
-- the release before 0028 (docs/benchmarks.md, "The hot path"), that cost the drain 10 %
-- and the start latency's p99 27-52 %; with the emptying off, neither was worse. When no
-- snapshot is older than a lane's rows, VACUUM removes them as it removed the single
-- table's, and the emptying buys nothing.
--
-- How. Each call marks the lane of the current period with the first transaction id not
-- yet given out (opened_in, opened_xid), once per period: where that lane's inserts
-- begin, and the previous lane's end. The lane due (its inserts ended one period ago) is
-- emptied only if a holder of this database's horizon is at least as old as that end, the
-- mark of the period after its own: a snapshot taken before its inserts ended may see,
-- and keeps vacuum from removing, the row versions its jobs left. The holders: a
-- session's snapshot or transaction id (this database's, or a walsender's, which holds
-- them all; autovacuum workers left out, as the doctor's snapshot finding does), a
-- prepared transaction, a replication slot's xmin. Otherwise the lane is left to VACUUM
-- ('not held'), and the next lane is looked at in the next period. A lane without that
-- mark (no worker called in the period after its own: the first period of a fleet that
-- starts) is left to VACUUM too: whether a snapshot predates it is not known, and
-- emptying is an optimisation. One exception: the rows that outlive their lane (delayed,
-- retried later, a backlog) would pile up in a lane nothing empties, and leave it too full
-- to be emptied (more than max_moved) on the day a snapshot is held; a lane not held is
-- emptied all the same once a quarter of max_moved rows are left in it, or once it has
-- gone 30 periods (5 minutes) unemptied with any.
-- pg_stat_activity shows every session's backend_xmin and backend_xid to every role (its
-- query and type only to the session's own role, members of pg_read_all_stats and
-- superusers): the test needs no privilege. An autovacuum worker of a role that cannot
-- see backend types counts as a holder: the emptying errs towards a held snapshot, never
-- towards starving the claims.
-- `always` empties the lane whatever holds the horizon (tests, an operator's call).
--
-- claim_wait(): what an idle claim reports (when the queue's earliest waiting job becomes
-- runnable, when the earliest lease of a running job expires), read by a PL/pgSQL
-- function rather than in the claim statement itself. Every reference to jobs in a
-- statement is planned once per lane (four times since 0028), and the claim is planned at
-- each of a session's first executions (psycopg prepares a statement at its sixth, the
-- server plans it afresh for five more before it keeps a generic plan): measured on
-- PostgreSQL 15, planning the claim took 0.25 ms on the single table and 1.15 ms on the
-- lanes, 0.76 ms of it for those two reads, which only an idle claim needs. A function's
-- statements keep their plans for the session, and the claim statement that calls it
-- plans jobs twice instead of five times.
--
-- Locking: none beyond the catalog's for the column additions and the function's
-- replacement, both instant.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

ALTER TABLE job_lanes
    ADD COLUMN opened_in bigint NOT NULL DEFAULT 0,
    -- The first transaction id not given out yet when a call first saw this lane's period.
    ADD COLUMN opened_xid xid8;

-- 0028's function keeps doing the emptying itself (its lock, the checks, the copy and the
-- TRUNCATE), under a name of its own; the new empty_job_lane() decides whether to call it.
ALTER FUNCTION empty_job_lane(integer, interval) RENAME TO empty_job_lane_now;

-- Empty the next lane (see 0028's header, and this one's): returns its number, what was
-- done ('emptied', 'not due', 'not held' when no snapshot is as old as its rows, 'busy'
-- when another process is at it or the lane is held, 'full' when more than max_moved rows
-- are left in it, 'duplicate' when an id of it is in lane 3 too), the rows moved to lane
-- 3, and the seconds until the next lane is due. READ COMMITTED only.
CREATE FUNCTION empty_job_lane(max_moved integer, lock_wait interval, always boolean DEFAULT false)
RETURNS TABLE (lane smallint, outcome text, moved bigint, next_due_seconds double precision)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
    period bigint := job_period(now_);
    target smallint := ((job_period(now_) + 1) % 3)::smallint;
    part regclass;
    survivors bigint;
    mark record;
    held boolean;
    why text;
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
    -- The current period's lane: where its rows begin, in transaction ids.
    UPDATE job_lanes AS l
    SET opened_in = period, opened_xid = pg_snapshot_xmax(pg_current_snapshot())
    WHERE l.lane = (period % 3)::smallint AND l.opened_in < period;
    -- The due lane's last emptying, and where the period after its own began: where
    -- its inserts ended.
    SELECT l.emptied_in, n.opened_in AS ended_in, n.opened_xid AS ended_xid INTO mark
    FROM job_lanes AS l, job_lanes AS n
    WHERE l.lane = target AND n.lane = ((period - 1) % 3)::smallint;
    IF mark.emptied_in >= period THEN
        outcome := 'not due';
        RETURN NEXT;
        RETURN;
    END IF;
    IF NOT always THEN
        held := false;
        why := 'no worker marked its period';
        IF mark.ended_in = period - 1 AND mark.ended_xid IS NOT NULL THEN
            SELECT coalesce(bool_or(h.xmin_age >= age(xid(mark.ended_xid))), false)
            INTO held
            FROM (
                SELECT age(coalesce(a.backend_xmin, a.backend_xid)) AS xmin_age
                FROM pg_stat_activity AS a
                WHERE a.pid <> pg_backend_pid()
                  AND (a.datid IS NULL OR a.datname = current_database())
                  AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
                UNION ALL
                SELECT age(p.transaction)
                FROM pg_prepared_xacts AS p WHERE p.database = current_database()
                UNION ALL
                SELECT age(s.xmin)
                FROM pg_replication_slots AS s
                WHERE s.xmin IS NOT NULL
                  AND (s.database IS NULL OR s.database = current_database())
            ) AS h;
            why := 'no snapshot as old as its rows';
        END IF;
        IF NOT held THEN
            -- Rows that outlive their lane (delayed, retried later, a backlog) stay in it
            -- while nothing holds the horizon; piled up, they would leave it 'full' on the
            -- day a snapshot is held. They move once they are a quarter of max_moved, or
            -- once the lane has gone unemptied for 30 periods (5 minutes).
            EXECUTE format('SELECT count(*) FROM (SELECT 1 FROM %s LIMIT %s) AS s',
                           part, max_moved + 1)
            INTO survivors;
            IF survivors < greatest(1, max_moved / 4)
               AND (survivors = 0 OR mark.emptied_in > period - 30) THEN
                UPDATE job_lanes AS l
                SET left_because = why || ': vacuum keeps it', tried_at = now_
                WHERE l.lane = target;
                outcome := 'not held';
                RETURN NEXT;
                RETURN;
            END IF;
        END IF;
    END IF;
    -- Due, and held (or too many rows left, or always): 0028's emptying, which takes the
    -- same advisory lock again (it is this transaction's already) and finds the lane due.
    RETURN QUERY SELECT * FROM empty_job_lane_now(max_moved, lock_wait);
END
$$;

-- When the queue's earliest waiting job becomes runnable (seconds from `at_time` and the
-- instant; NULL: nothing waits) and the earliest lease of any running job expires
-- (seconds from `at_time`; NULL: no job runs): the idle claim's row (queries.sql claim_jobs).
-- The wait hops from one priority to the next through the claim index (a loose index
-- scan: one probe per priority in use), not over every waiting entry.
CREATE FUNCTION claim_wait(for_queue text, at_time timestamptz,
                           OUT wait_seconds double precision,
                           OUT next_available_at timestamptz,
                           OUT lease_seconds_left double precision)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    WITH RECURSIVE first_per_priority AS (
        (
            SELECT j.priority, j.available_at
            FROM jobs AS j
            WHERE j.queue_name = for_queue AND j.status = 'queued'
            ORDER BY j.priority, j.available_at
            LIMIT 1
        )
        UNION ALL
        SELECT next.priority, next.available_at
        FROM first_per_priority AS previous
        CROSS JOIN LATERAL (
            SELECT j.priority, j.available_at
            FROM jobs AS j
            WHERE j.queue_name = for_queue AND j.status = 'queued'
              AND j.priority > previous.priority
            ORDER BY j.priority, j.available_at
            LIMIT 1
        ) AS next
    )
    SELECT extract(epoch FROM min(f.available_at) - at_time)::float8, min(f.available_at)
    INTO wait_seconds, next_available_at
    FROM first_per_priority AS f;
    SELECT extract(epoch FROM min(j.locked_until) - at_time)::float8
    INTO lease_seconds_left
    FROM jobs AS j WHERE j.status = 'running';
END
$$;
