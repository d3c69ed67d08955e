-- compatibility: compatible
-- One new function and new bodies for two functions of 0025 with the same signatures and the same effects: earlier releases call them as before (workflow_start_node still starts one node and says whether it did), and no table changes.
--
-- 0026: a step's end starts the steps after it in one statement, not one per step.
--
-- Measured (benchmarks.profile --what workflow, pg_stat_statements with track = all):
-- when the first step of a workflow of a step, a 100-wide group and a step ended, its
-- transaction started the group's hundred jobs one call of workflow_start_node at a time
-- (a lookup, an INSERT into jobs, an INSERT of its event and a NOTIFY each), after one
-- UPDATE of workflow_waits per member that found no counter (a member waits for that
-- step alone); about 100 us of the server's time per job of the workflow.
--
-- workflow_start_nodes(ids) starts every ready node of `ids` with one INSERT into jobs
-- and one into job_events for all of them, and one NOTIFY per queue. workflow_node_done
-- looks up which of a node's several dependents have a counter (those waiting for more
-- than one node) in one statement, counts those down one by one in id order (so that two
-- transactions ending members of the same joins lock their counters in the same order,
-- as before), and starts all that are ready in one call. A node with one dependent (a
-- group's member, a pipeline's step) runs the statements it ran before.
--
-- Locking and duration: CREATE FUNCTION and CREATE OR REPLACE FUNCTION change the
-- catalog only; no table is locked, scanned or rewritten.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

-- The jobs of these nodes are sent (each a pending node of a running workflow whose job
-- is not in jobs; the others are left): the send's rows (as insert_job writes them, with
-- the node's id in workflow_node), their `created` events, and one NOTIFY per channel that
-- wakes their queues' consumers. Returns the nodes started. The nodes' rows are not
-- written: a pending node whose job exists runs (its job's end writes it).
CREATE FUNCTION workflow_start_nodes(node_ids uuid[]) RETURNS SETOF uuid
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

-- One node (0025's signature, for the statements of earlier releases): whether it started.
CREATE OR REPLACE FUNCTION workflow_start_node(node_id uuid) RETURNS boolean
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM workflow_start_nodes(ARRAY[node_id]));
END
$$;

-- A node is done (its job succeeded, and every child it spawned is done; the caller
-- marked it succeeded): its parent has one open child fewer, and is done when none is
-- left; each dependent waits for one node fewer and starts when it waits for none, all
-- that start in one call; a node nobody waits for takes the workflow one step nearer its
-- end.
CREATE OR REPLACE FUNCTION workflow_node_done(n workflow_nodes) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    parent workflow_nodes;
    dependent uuid;
    left_over integer;
    counted uuid[];
    ready uuid[];
BEGIN
    IF n.parent_id IS NOT NULL THEN
        UPDATE workflow_nodes
        SET open = open - 1, updated_at = now(),
            status = CASE WHEN open = 1 THEN 'succeeded' ELSE status END
        WHERE id = n.parent_id
        RETURNING * INTO parent;
        IF parent.open = 0 THEN
            PERFORM workflow_node_done(parent);
        END IF;
        RETURN;
    END IF;
    IF cardinality(n.dependents) = 0 THEN
        UPDATE workflows
        SET remaining = remaining - 1, updated_at = now(),
            status = CASE WHEN remaining = 1 AND status = 'running' THEN 'succeeded'
                          ELSE status END,
            finished_at = CASE WHEN remaining = 1 AND status = 'running' THEN now()
                               ELSE finished_at END
        WHERE id = n.workflow_id;
        RETURN;
    END IF;
    IF cardinality(n.dependents) = 1 THEN
        -- No counter: it waits for this node alone.
        UPDATE workflow_waits SET waiting = waiting - 1
        WHERE node_id = n.dependents[1]
        RETURNING waiting INTO left_over;
        IF NOT FOUND OR left_over = 0 THEN
            PERFORM workflow_start_nodes(n.dependents);
        END IF;
        RETURN;
    END IF;
    -- Several: those with a counter (they wait for others too; the counters are written
    -- when the workflow is run, never after) count down in id order, so that two
    -- transactions join the same nodes in the same order; the others wait for this node
    -- alone. Every one that is ready starts in one call.
    SELECT coalesce(array_agg(w.node_id ORDER BY w.node_id), '{}') INTO counted
    FROM workflow_waits AS w WHERE w.node_id = ANY (n.dependents);
    ready := ARRAY(SELECT d FROM unnest(n.dependents) AS d WHERE d <> ALL (counted));
    FOREACH dependent IN ARRAY counted LOOP
        UPDATE workflow_waits SET waiting = waiting - 1
        WHERE node_id = dependent
        RETURNING waiting INTO left_over;
        IF left_over = 0 THEN
            ready := ready || dependent;
        END IF;
    END LOOP;
    IF cardinality(ready) > 0 THEN
        PERFORM workflow_start_nodes(ready);
    END IF;
END
$$;
