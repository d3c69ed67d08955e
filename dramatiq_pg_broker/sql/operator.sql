-- Named read statements of the operator's CLI (`dramatiq-pg-broker jobs`). Same layout as
-- queries.sql. Changes to jobs never happen here: they go through the JobStore transitions
-- in queries.sql, like the admin API's; `stats` reads the per-queue count the admin API
-- and its metrics read too (queries.sql count_by_queue).

-- list_jobs --
-- The newest jobs first, each filter applied only when given.
SELECT id, queue_name, actor_name, status, priority, attempts, max_attempts, available_at,
       created_at, updated_at, finished_at, last_error
FROM {schema}.all_jobs
WHERE (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(queue)s::text IS NULL OR queue_name = %(queue)s)
  AND (%(actor)s::text IS NULL OR actor_name = %(actor)s)
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s
