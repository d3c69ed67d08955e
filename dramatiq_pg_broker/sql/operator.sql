-- Named read statements of the operator's CLI (`dramatiq-pg-broker jobs`). Same layout as
-- queries.sql. Changes to jobs never happen here: they go through the JobStore transitions
-- in queries.sql, like the admin API's; `stats` and `queues list` read the per-queue count
-- the admin API and its metrics read too (queries.sql count_by_queue).

-- list_jobs --
-- The newest jobs first, each filter applied only when given. The state filter is the
-- facts of one state of jobs/states.py (filter_params): a stored status, and whether the
-- job's available_at has passed, whether its queue is paused, whether its lease is
-- current, each compared only when given, so that no state is named here. Each row
-- carries its queue's pause and the server's clock, from which states.state_of names it.
SELECT j.id, j.queue_name, j.actor_name, j.status, j.priority, j.attempts, j.max_attempts,
       j.available_at, j.locked_until, j.created_at, j.updated_at, j.finished_at,
       j.last_error, coalesce(q.paused, false) AS queue_paused,
       coalesce(%(now)s::timestamptz, now()) AS server_now
FROM {schema}.all_jobs AS j
LEFT JOIN {schema}.queues AS q ON q.queue_name = j.queue_name
WHERE (%(status)s::text IS NULL OR j.status = %(status)s)
  AND (%(due)s::boolean IS NULL
       OR (j.available_at <= coalesce(%(now)s::timestamptz, now())) = %(due)s)
  AND (%(lease_current)s::boolean IS NULL
       OR (j.locked_until >= coalesce(%(now)s::timestamptz, now())) = %(lease_current)s)
  AND (%(paused)s::boolean IS NULL OR coalesce(q.paused, false) = %(paused)s)
  AND (%(queue)s::text IS NULL OR j.queue_name = %(queue)s)
  AND (%(actor)s::text IS NULL OR j.actor_name = %(actor)s)
ORDER BY j.created_at DESC, j.id DESC
LIMIT %(limit)s

-- job_state_facts --
-- What names one job's state besides its row (jobs/states.py state_of): whether its queue
-- is paused, and the server's clock.
SELECT coalesce((SELECT paused FROM {schema}.queues WHERE queue_name = %(queue_name)s), false)
           AS queue_paused,
       now() AS server_now
