-- Named statements of queue control (dramatiq_pg_broker.queues): declaring queues, pausing
-- and resuming them, and a queue's recent throughput. Same layout as queries.sql. The claim
-- statement (queries.sql, claim_jobs) reads the pause; nothing here changes a job.

-- declare_queues --
-- The queues a booting worker consumes become known (a new row is not paused); a queue
-- already known keeps its state, so a pause survives every restart.
INSERT INTO {schema}.queues (queue_name)
SELECT DISTINCT name FROM unnest(%(names)s::text[]) AS name
ON CONFLICT (queue_name) DO NOTHING

-- pause_queue --
-- Pause a known queue: from the commit on, no claim of any worker returns its jobs. A
-- queue already paused keeps who paused it and when (nothing is returned then).
UPDATE {schema}.queues
SET paused = true, paused_at = now(), paused_by = %(by)s
WHERE queue_name = %(name)s AND NOT paused
RETURNING queue_name

-- pause_new_queue --
-- Pause a queue no worker declared yet (an operator pausing ahead of a deployment):
-- the row is created paused.
INSERT INTO {schema}.queues (queue_name, paused, paused_at, paused_by)
VALUES (%(name)s, true, now(), %(by)s)
ON CONFLICT (queue_name) DO NOTHING
RETURNING queue_name

-- resume_queue --
-- Resume a paused queue; the caller wakes its consumers. A queue that is not paused is
-- left as it is (nothing is returned).
UPDATE {schema}.queues
SET paused = false, resumed_at = now(), resumed_by = %(by)s
WHERE queue_name = %(name)s AND paused
RETURNING queue_name

-- wake_queue --
-- Tell a queue's consumers on every host about a pause (payload 'pause': they give back
-- what they prefetched) or a resume (no payload: they claim at once). Delivered at commit.
SELECT pg_notify(%(channel)s, %(payload)s)

-- get_queue --
-- One known queue and its state.
SELECT queue_name, paused, paused_at, paused_by, resumed_at, resumed_by, declared_at
FROM {schema}.queues
WHERE queue_name = %(name)s

-- queue_states --
-- Every known queue's pause state (the dashboard's overview and the metrics).
SELECT queue_name, paused, paused_at, paused_by, resumed_at, resumed_by, declared_at
FROM {schema}.queues
ORDER BY queue_name

-- finished_per_minute --
-- A queue's jobs that finished (succeeded or failed) in each minute since %(since)s: its
-- throughput and its recent failures (a queue's page). The partitions of history by day of
-- finish before %(since)s are pruned; at most the %(limit)s most recent rows are counted
-- (the caller says so when the window held more).
SELECT date_trunc('minute', finished_at) AS minute, status, count(*)
FROM (
    SELECT finished_at, status
    FROM {schema}.jobs_history
    WHERE status IN ('succeeded', 'failed') AND queue_name = %(queue_name)s
      AND finished_at >= %(since)s
    ORDER BY finished_at DESC
    LIMIT %(limit)s
) AS recent
GROUP BY 1, 2
ORDER BY 1, 2
