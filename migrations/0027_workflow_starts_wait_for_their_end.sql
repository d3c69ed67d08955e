-- compatibility: compatible
-- New bodies for two functions of 0025/0026 with the same signatures: a step's start locks its workflow's row (FOR KEY SHARE) and a failing job's end takes it FOR UPDATE; earlier releases call them as before, and no table changes.
--
-- 0027: a workflow that ends (a failing step, an operator's abort) and a step that starts
-- in another transaction at the same moment wait for each other.
--
-- Until now the start of a node's job (workflow_start_nodes) read its workflow's status
-- without a lock. A transaction that ended a step and started the next one, not committed
-- yet, and an operator's abort (or another job's failure) at that moment: the abort saw
-- the workflow running, did not see the new job (uncommitted), cancelled its node as one
-- that had not started, and aborted the jobs it saw; the step's end then committed, and
-- the new job ran in a cancelled workflow, its node `cancelled`, nobody to abort it.
--
-- Now workflow_start_nodes locks the workflow's row FOR KEY SHARE with the nodes it
-- starts (and starts none once it is no longer running). That lock conflicts with FOR
-- UPDATE alone: the operator's abort takes it (a statement of its own, before the one that
-- reads which jobs to end), and so does the end of a job that fails or is cancelled here,
-- before its workflow's nodes are cancelled. Whichever commits first, the other sees it:
-- a start after the end starts nothing; an end after the start finds the new job and
-- leaves its node to run (a failure) or aborts it (an abort). Two steps that start at once
-- and the count-down of a workflow's last nodes (UPDATE: FOR NO KEY UPDATE) do not wait
-- for one another, as before. The failing end and the abort cancel the nodes that have
-- not started with SKIP LOCKED: a node another transaction holds then is a parent that
-- a spawned child's end counts down, and that end may be waiting for the workflow's row
-- they hold (to start the step after the parent); it finds the workflow ended and starts
-- nothing.
--
-- Locking and duration: CREATE OR REPLACE FUNCTION changes the catalog only; no table is
-- locked, scanned or rewritten.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

CREATE OR REPLACE FUNCTION workflow_start_nodes(node_ids uuid[]) RETURNS SETOF uuid
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    started uuid[];
    channels text[];
BEGIN
    WITH ready AS (
        SELECT wn.id, wn.job_id, wn.queue_name, wn.actor_name, wn.message, wn.message_bytes,
               wn.priority, wn.max_attempts, wn.channel
        FROM workflow_nodes AS wn JOIN workflows AS w ON w.id = wn.workflow_id
        WHERE wn.id = ANY (node_ids) AND wn.status = 'pending' AND w.status = 'running'
          AND NOT EXISTS (SELECT 1 FROM jobs AS j WHERE j.id = wn.job_id)
        FOR KEY SHARE OF w
    ), sent AS (
        INSERT INTO jobs (id, queue_name, actor_name, message, message_bytes, priority,
                          available_at, max_attempts, idempotency_key, idempotency_scope,
                          created_at, updated_at, status, workflow_node)
        SELECT job_id, queue_name, actor_name, message, message_bytes, priority, now(),
               max_attempts, NULL, '', now(), now(), 'queued', id
        FROM ready
        RETURNING id
    ), events AS (
        INSERT INTO job_events (job_id, type, attempt, created_at)
        SELECT id, 'created', 0, now() FROM sent
    )
    SELECT array_agg(id), array_agg(DISTINCT channel) INTO started, channels FROM ready;
    PERFORM pg_notify(channel, '') FROM unnest(channels) AS channel;
    RETURN QUERY SELECT unnest(started);
END
$$;

CREATE OR REPLACE FUNCTION workflow_job_ended() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    n workflow_nodes;
BEGIN
    -- The message goes with the node's row here: its job's row has it (a retry reads it
    -- there).
    UPDATE workflow_nodes
    SET open = CASE WHEN NEW.status = 'succeeded' THEN open - 1 ELSE open END,
        status = CASE WHEN NEW.status <> 'succeeded' THEN NEW.status
                      WHEN open = 1 THEN 'succeeded' ELSE status END,
        message = NULL, message_bytes = NULL, updated_at = now()
    WHERE id = NEW.workflow_node AND job_id = NEW.id AND status = 'pending'
    RETURNING * INTO n;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF NEW.status = 'succeeded' THEN
        IF n.open = 0 THEN
            PERFORM workflow_node_done(n);
        END IF;
        RETURN NULL;
    END IF;
    -- After every start of a node of this workflow that another transaction holds (FOR
    -- KEY SHARE, see workflow_start_nodes): the statements below then see its jobs.
    PERFORM 1 FROM workflows WHERE id = n.workflow_id FOR UPDATE;
    UPDATE workflows
    SET status = NEW.status, updated_at = now(), finished_at = now(),
        ended_by_job = NEW.id, error = NEW.last_error
    WHERE id = n.workflow_id AND status = 'running';
    IF FOUND THEN
        -- SKIP LOCKED: a node locked now is a parent that a spawned child's end is
        -- counting down, and that end may wait for the workflow's row locked above (to
        -- start the next step): waiting for it would be a deadlock. It finds the workflow
        -- ended and starts nothing.
        UPDATE workflow_nodes AS wn SET status = 'cancelled', updated_at = now()
        WHERE wn.id IN (
            SELECT p.id FROM workflow_nodes AS p
            WHERE p.workflow_id = n.workflow_id AND p.status = 'pending'
              AND NOT EXISTS (SELECT 1 FROM jobs AS j WHERE j.id = p.job_id)
            FOR UPDATE OF p SKIP LOCKED);
    END IF;
    RETURN NULL;
END
$$;
