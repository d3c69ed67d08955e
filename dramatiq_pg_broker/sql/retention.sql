-- Named statements of retention: deleting finished jobs and their events in bounded
-- batches. Same layout as queries.sql. Only terminal rows (finished_at set) are ever
-- touched, so nothing here competes with a claim, an ack or the reaper for a row.

-- select_prunable --
-- Up to %(limit)s finished jobs of one status older than %(age_s)s seconds, oldest first,
-- locked for the rest of this short transaction. jobs_finished_idx serves the scan in
-- order, so a batch reads about %(limit)s index entries however large the table is. SKIP
-- LOCKED: two processes pruning at once take different rows instead of waiting.
SELECT id
FROM {schema}.jobs
WHERE status = %(status)s
  AND finished_at IS NOT NULL
  AND finished_at < coalesce(%(now)s::timestamptz, now()) - %(age_s)s * interval '1 second'
ORDER BY finished_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- delete_events_of --
-- The events of the jobs about to be deleted (job_events_job_id_idx). Deleted explicitly
-- rather than by the ON DELETE CASCADE, so that the run can say how many went.
DELETE FROM {schema}.job_events
WHERE job_id = ANY(%(ids)s::uuid[])

-- delete_jobs --
-- The locked batch itself; the status guard is redundant under the lock, and kept as a
-- statement of intent: retention never deletes a waiting or running job.
DELETE FROM {schema}.jobs
WHERE id = ANY(%(ids)s::uuid[]) AND finished_at IS NOT NULL

-- count_prunable --
-- What a run would delete now for one status (the dry run): jobs and their events.
SELECT count(DISTINCT j.id), count(e.id)
FROM {schema}.jobs AS j
LEFT JOIN {schema}.job_events AS e ON e.job_id = j.id
WHERE j.status = %(status)s
  AND j.finished_at IS NOT NULL
  AND j.finished_at < coalesce(%(now)s::timestamptz, now()) - %(age_s)s * interval '1 second'
