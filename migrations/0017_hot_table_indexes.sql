-- compatibility: compatible
-- Drops three indexes of the jobs table that only the admin API's lists used: no statement of any release depends on an index to be correct, and earlier releases' lists answer the same rows (from a sort of the unfinished jobs instead of an index walk).
--
-- 0017: the hot table indexes what the workers need.
--
-- Since 0012 the jobs table holds unfinished jobs only, and every send inserts a row in
-- it, every claim writes a new version of that row (the claim changes status, which the
-- claim and lease indexes depend on, so it is never a HOT update) and every outcome
-- deletes it. Each index of the table therefore costs an entry at the send and another
-- at the claim, in the WAL and in index bloat. The workers use four: the primary key,
-- the claim order (jobs_claim_order_idx, queued rows), the lease expiry
-- (jobs_lease_expiry_idx, running rows) and the idempotency key. Three more served only
-- the admin API's job list, newest first, and its queue and actor filters:
-- jobs_created_at_idx (0002), jobs_queue_created_idx and jobs_actor_created_idx (0007).
-- Measured with the life workload of the benchmarks (one send, one claim and one outcome
-- per job), they wrote 632 of the 4,309 WAL bytes of a job's life.
--
-- Their orders stay where the rows are many: every partition of jobs_history has the same
-- three indexes (0012). The unfinished part of a list is the backlog, which the admin API
-- reads in the list's order by sorting the jobs table's matching rows (a top-N sort: it
-- keeps the page, not the backlog, in memory). That reads every unfinished row a filter
-- leaves, once per request: cheap for the backlog a healthy deployment has (thousands),
-- and still a single pass for a large one. See docs/benchmarks.md for the measured reads.
--
-- Locking and duration: DROP INDEX holds an ACCESS EXCLUSIVE lock on jobs for the
-- instant of the catalog change (DROP INDEX CONCURRENTLY cannot run in the migration's
-- transaction); it waits for running statements on jobs, as any migration touching the
-- table does, and nothing is rewritten.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

DROP INDEX jobs_created_at_idx;
DROP INDEX jobs_queue_created_idx;
DROP INDEX jobs_actor_created_idx;
