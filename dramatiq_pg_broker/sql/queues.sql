-- Named statements of queue control (dramatiq_pg_broker.queues): declaring queues, pausing
-- and resuming them. Same layout as queries.sql. The claim statement (queries.sql,
-- claim_jobs) reads the pause; nothing here touches a job.

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

-- list_queues --
-- Every known queue with its state, its limit (NULL: none; see limits.sql) and its
-- unfinished jobs: waiting (runnable now and delayed) and running, each counted from its
-- partial index.
SELECT q.queue_name, q.paused, q.paused_at, q.paused_by, q.resumed_at, q.resumed_by,
       q.declared_at, l.max_running AS "limit", l.source AS limit_source,
       l.set_by AS limit_set_by, l.set_at AS limit_set_at,
       (SELECT count(*) FROM {schema}.jobs AS j
        WHERE j.queue_name = q.queue_name AND j.status = 'queued' AND j.available_at <= now())
           AS queued,
       (SELECT count(*) FROM {schema}.jobs AS j
        WHERE j.queue_name = q.queue_name AND j.status = 'queued' AND j.available_at > now())
           AS delayed,
       (SELECT count(*) FROM {schema}.jobs AS j
        WHERE j.queue_name = q.queue_name AND j.status = 'running') AS running
FROM {schema}.queues AS q
LEFT JOIN {schema}.queue_limits AS l ON l.queue_name = q.queue_name
ORDER BY q.queue_name

-- queue_states --
-- Every known queue's pause state (the dashboard's overview and the metrics).
SELECT queue_name, paused, paused_at, paused_by, resumed_at, resumed_by, declared_at
FROM {schema}.queues
ORDER BY queue_name
