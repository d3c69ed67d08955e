-- compatibility: compatible
-- Drops two check constraints of the jobs table that jobs_unfinished (0012) implies: every row they refused is still refused, by jobs_unfinished, and no statement of any release depends on their names.
--
-- 0021: the hot table checks each shape once.
--
-- PostgreSQL reads a table's check constraints from their stored form, prepares them and
-- evaluates them at every statement that inserts or updates its rows: every send and
-- every claim of the jobs table. That is server CPU, not I/O: on PostgreSQL 15, the
-- fourteen checks of jobs took 17 % of a sending backend's CPU (perf; about 60 of the
-- 330 µs a send costs the server, measured with every check dropped against all kept).
--
-- Since 0012 the table holds unfinished jobs only (jobs_unfinished: status IN ('queued',
-- 'running')). Two checks of 0001 say less than that on this table:
-- - jobs_status_check (status is one of the five statuses) holds whenever
--   jobs_unfinished does;
-- - jobs_terminal_shape constrains only rows whose status is succeeded, failed or
--   cancelled, which jobs_unfinished refuses: it can never fail.
-- Together they were a quarter of the checks' stored size. Dropped, a send costs the
-- server about 7 % less CPU (docs/benchmarks.md). Finished rows live in jobs_history,
-- whose partitions keep both checks (they were copied from jobs by 0012 and from their
-- parents since 0013): nothing changes there.
--
-- Locking and duration: ALTER TABLE ... DROP CONSTRAINT holds an ACCESS EXCLUSIVE lock on
-- jobs for the instant of the catalog change; it waits for running statements on jobs,
-- as any migration touching the table does, and nothing is scanned or rewritten.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

ALTER TABLE jobs
    DROP CONSTRAINT jobs_status_check,
    DROP CONSTRAINT jobs_terminal_shape;
