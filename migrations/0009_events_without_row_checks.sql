-- 0009: job events keep following their job, without a check per event row.
--
-- Every event is written by the statement that makes its job's transition (a guarded,
-- data-modifying CTE on the job row), so an event for a missing job cannot be written by
-- the broker. The foreign key from job_events to jobs checked that again for every event
-- row (a key-share lookup of the job per event): about half the cost of writing the events
-- of a bulk enqueue, and a share of every claim and outcome. What the key also did, delete
-- a job's events with the job, is kept by a statement-level trigger, which runs once per
-- deleting statement with the deleted ids (retention deletes events explicitly first and
-- then finds none; Dramatiq's flush and an operator's DELETE rely on it).
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified;
-- the trigger function is in the same schema and qualifies nothing, so it runs with the
-- search_path of the schema it was created in (set on the function).

ALTER TABLE job_events DROP CONSTRAINT job_events_job_id_fkey;

CREATE FUNCTION delete_job_events() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM job_events AS e USING deleted_jobs AS d WHERE e.job_id = d.id;
    RETURN NULL;
END
$$;

ALTER FUNCTION delete_job_events() SET search_path FROM CURRENT;

CREATE TRIGGER jobs_delete_events
    AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS deleted_jobs
    FOR EACH STATEMENT
    EXECUTE FUNCTION delete_job_events();
