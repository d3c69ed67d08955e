-- 0003: an attempt is what ran. Failures and interruptions are counted apart.
--
-- attempts       attempts whose actor started. A claim adds one (it identifies the claim
--                in every guarded transition); giving back a claim that never started
--                (shutdown, or an expired lease of an unstarted claim) takes it back.
-- started        the current claim's actor has started (written just before it runs).
-- failures       attempts that ended in an exception or a time limit. Retries and the
--                dead letter count these against max_attempts (max_retries + 1).
-- interruptions  started attempts that ended without an outcome: the worker died, lost its
--                lease or was shut down. They have their own, larger bound (a worker
--                setting), so a deploy never fails a job and a message that kills its
--                process every time still ends failed.

ALTER TABLE jobs
    ADD COLUMN started       boolean NOT NULL DEFAULT false,
    ADD COLUMN failures      integer NOT NULL DEFAULT 0,
    ADD COLUMN interruptions integer NOT NULL DEFAULT 0;

-- Rows written before this migration: every earlier attempt is taken for a failure, and a
-- running attempt for one that started (the conservative reading).
UPDATE jobs
SET failures = CASE
        WHEN status = 'running' THEN greatest(attempts - 1, 0)
        WHEN status = 'succeeded' THEN greatest(attempts - 1, 0)
        ELSE attempts
    END,
    started = (status = 'running');

-- Interruptions are not failures, so a job can run more often than max_attempts allows
-- failures: attempts is no longer bounded by max_attempts.
ALTER TABLE jobs
    DROP CONSTRAINT jobs_attempts_in_range,
    ADD CONSTRAINT jobs_counts_in_range CHECK (
        attempts >= 0 AND failures >= 0 AND interruptions >= 0
        AND failures + interruptions <= attempts
    ),
    -- Only a running claim can have started.
    ADD CONSTRAINT jobs_started_shape CHECK (status = 'running' OR NOT started);
