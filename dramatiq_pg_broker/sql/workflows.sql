-- Named statements of workflows (dramatiq_pg_broker.workflows). Same layout as
-- queries.sql. A workflow moves on in the database, in the transaction that ends each of
-- its jobs (the trigger of migration 0025, workflow_job_ended); these statements create
-- it, spawn children, pass results on, and carry out an operator's abort and retry. Every
-- start of a step's job is the function workflow_start_nodes (0026), whoever starts it.

-- insert_workflow --
-- A new workflow, running; remaining: its last nodes (those nothing waits for). One with
-- no node (its steps are empty groups and pipelines) has nothing to wait for: succeeded.
INSERT INTO {schema}.workflows (id, name, remaining, created_by, status, finished_at)
VALUES (%(id)s, %(name)s, %(remaining)s, %(created_by)s,
        CASE WHEN %(remaining)s = 0 THEN 'succeeded' ELSE 'running' END,
        CASE WHEN %(remaining)s = 0 THEN now() END)

-- insert_node --
-- One node of a workflow, pending, with the job row it sends when it starts.
INSERT INTO {schema}.workflow_nodes (
    id, workflow_id, step, position, parent_id, waits_for, dependents, job_id, queue_name,
    actor_name, message, message_bytes, priority, max_attempts, channel, input)
VALUES (
    %(id)s, %(workflow_id)s, %(step)s, %(position)s, %(parent_id)s, %(waits_for)s,
    %(dependents)s::uuid[], %(job_id)s, %(queue_name)s, %(actor_name)s, %(message)s::jsonb,
    %(message_bytes)s, %(priority)s, %(max_attempts)s, %(channel)s, %(input)s::jsonb)
ON CONFLICT (id) DO NOTHING
RETURNING id

-- insert_waits --
-- The counters of a new workflow's nodes that wait for more than one other.
INSERT INTO {schema}.workflow_waits (node_id, waiting)
SELECT id, waits_for FROM {schema}.workflow_nodes
WHERE workflow_id = %(id)s AND waits_for > 1

-- start_nodes --
-- Send the jobs of these nodes (each a pending node of a running workflow; others are
-- left). Returns the nodes that started.
SELECT node FROM {schema}.workflow_start_nodes(%(ids)s::uuid[]) AS node

-- lock_spawning_node --
-- The node whose actor spawns children, locked until the spawn commits (two spawns of
-- one node, or its job's end, wait for each other), with what its children inherit.
-- No row: no such node, or its part of the workflow is over.
SELECT n.workflow_id, n.step, w.status,
       (SELECT max(position) FROM {schema}.workflow_nodes WHERE workflow_id = n.workflow_id)
FROM {schema}.workflow_nodes AS n
JOIN {schema}.workflows AS w ON w.id = n.workflow_id
WHERE n.id = %(id)s AND n.status = 'pending'
FOR UPDATE OF n

-- add_children --
-- The node waits for `count` more children.
UPDATE {schema}.workflow_nodes SET open = open + %(count)s, updated_at = now()
WHERE id = %(id)s

-- node_input --
-- How a node's piped input is made, and the results of the nodes it is made of (every
-- "one" of the input, at any depth), in one round trip. The sources are looked up by
-- their ids (= ANY of an array: the primary key's index), never by a join on an
-- expression, which the planner serves with a scan of every workflow's nodes.
SELECT n.input, r.ids, r.results
FROM {schema}.workflow_nodes AS n
LEFT JOIN LATERAL (
    SELECT array_agg(s.id::text) AS ids, array_agg(s.result) AS results
    FROM {schema}.workflow_nodes AS s
    WHERE s.id = ANY (ARRAY(
        SELECT btrim(jsonb_path_query(n.input, 'strict $.**.one')::text, '"')::uuid))
) AS r ON true
WHERE n.id = %(id)s

-- node_inputs --
-- node_input of several nodes at once (the steps' jobs of one claim), with each node's id.
SELECT n.id::text, n.input, r.ids, r.results
FROM {schema}.workflow_nodes AS n
LEFT JOIN LATERAL (
    SELECT array_agg(s.id::text) AS ids, array_agg(s.result) AS results
    FROM {schema}.workflow_nodes AS s
    WHERE s.id = ANY (ARRAY(
        SELECT btrim(jsonb_path_query(n.input, 'strict $.**.one')::text, '"')::uuid))
) AS r ON true
WHERE n.id = ANY (%(ids)s::uuid[])

-- store_node_result --
-- The result of a node's actor, encoded, kept for the nodes that take it as input (its
-- current job's only: a retried node's earlier job writes nothing).
UPDATE {schema}.workflow_nodes SET result = %(result)s, updated_at = now()
WHERE id = %(id)s AND job_id = %(job_id)s

-- node_result_wanted --
-- Whether a node's result is some other node's input (a dependent that takes an input is
-- made of the results of the nodes it waits for).
SELECT EXISTS (
    SELECT 1 FROM {schema}.workflow_nodes AS n
    JOIN {schema}.workflow_nodes AS d ON d.id = ANY (n.dependents)
    WHERE n.id = %(id)s AND d.input IS NOT NULL)

-- workflow_status --
-- A workflow's status (running, succeeded, failed, cancelled).
SELECT status FROM {schema}.workflows WHERE id = %(id)s

-- find_workflow --
-- A workflow by its id or the start of it (8 hex characters at least).
SELECT id::text FROM {schema}.workflows
WHERE id::text LIKE %(prefix)s || '%%'
ORDER BY id
LIMIT 2

-- list_workflows --
-- The newest workflows first, with how many of their nodes are in each status (a pending
-- node whose job is unfinished runs; one whose own job ended waits for its children, and
-- counts as pending here); filtered
-- by status and by who created them when given; keyset pages by (created_at, id).
SELECT w.id::text, w.name, w.status, w.created_by, w.created_at, w.updated_at,
       w.finished_at, w.error,
       count(n.id) AS nodes,
       count(n.id) FILTER (WHERE n.status = 'succeeded') AS succeeded,
       count(n.id) FILTER (WHERE n.status = 'pending' AND j.id IS NOT NULL) AS running,
       count(n.id) FILTER (WHERE n.status = 'pending' AND j.id IS NULL) AS pending,
       count(n.id) FILTER (WHERE n.status = 'failed') AS failed,
       count(n.id) FILTER (WHERE n.status = 'cancelled') AS cancelled
FROM {schema}.workflows AS w
LEFT JOIN {schema}.workflow_nodes AS n ON n.workflow_id = w.id
LEFT JOIN {schema}.jobs AS j ON j.id = n.job_id
WHERE (%(status)s::text IS NULL OR w.status = %(status)s)
  AND (%(created_by)s::text IS NULL OR w.created_by = %(created_by)s)
  AND (%(before_at)s::timestamptz IS NULL OR (w.created_at, w.id) < (%(before_at)s, %(before_id)s::uuid))
GROUP BY w.id
ORDER BY w.created_at DESC, w.id DESC
LIMIT %(limit)s

-- get_workflow --
-- A workflow's row.
SELECT id::text, name, status, created_by, created_at, updated_at, finished_at,
       ended_by_job::text, error, cancelled_by, remaining
FROM {schema}.workflows WHERE id = %(id)s

-- workflow_nodes --
-- Every node of a workflow in its order, with its current job's status (unfinished in
-- jobs, finished in history, or none yet). A pending node whose job was sent runs (its
-- own job, or the children it spawned).
SELECT n.id::text, n.step, n.position, n.parent_id::text,
       CASE WHEN n.status = 'pending' AND (j.id IS NOT NULL OR h.status IS NOT NULL)
            THEN 'running' ELSE n.status END,
       CASE WHEN w.waiting IS NOT NULL THEN w.waiting
            WHEN n.status <> 'pending' OR j.id IS NOT NULL OR h.status IS NOT NULL THEN 0
            ELSE n.waits_for END,
       n.open,
       n.dependents::text[], n.job_id::text, n.queue_name, n.actor_name,
       coalesce(j.status, h.status) AS job_status, coalesce(j.attempts, h.attempts),
       coalesce(j.last_error, h.last_error), n.input, n.updated_at
FROM {schema}.workflow_nodes AS n
LEFT JOIN {schema}.workflow_waits AS w ON w.node_id = n.id
LEFT JOIN {schema}.jobs AS j ON j.id = n.job_id
LEFT JOIN LATERAL (
    SELECT status, attempts, last_error FROM {schema}.jobs_history AS h
    WHERE h.id = n.job_id AND j.id IS NULL
    ORDER BY finished_at DESC LIMIT 1
) AS h ON true
WHERE n.workflow_id = %(id)s
ORDER BY n.position, n.id

-- workflow_of_job --
-- The workflow a job belongs to, if any (a node's current or earlier job).
SELECT n.workflow_id::text, n.id::text
FROM {schema}.all_jobs AS j
JOIN {schema}.workflow_nodes AS n ON n.id = j.workflow_node
WHERE j.id = %(job_id)s
LIMIT 1

-- cancel_workflow --
-- running -> cancelled by an operator: the nodes that have not started never will.
-- Returns the status it had, whether it was cancelled, and the unfinished jobs of its
-- nodes, which the operator's abort then ends.
WITH w AS (
    SELECT id, status FROM {schema}.workflows WHERE id = %(id)s FOR UPDATE
), cancelled AS (
    UPDATE {schema}.workflows AS u
    SET status = 'cancelled', cancelled_by = %(by)s, updated_at = now(), finished_at = now()
    FROM w WHERE u.id = w.id AND w.status = 'running'
    RETURNING u.id
), pending AS (
    -- SKIP LOCKED: a node locked now is a parent that a spawned child's end is counting
    -- down; that end may wait for this workflow's row (to start the next step, migration
    -- 0027), so waiting for it would be a deadlock. It finds the workflow cancelled and
    -- starts nothing.
    UPDATE {schema}.workflow_nodes AS n SET status = 'cancelled', updated_at = now()
    WHERE n.id IN (
        SELECT p.id FROM {schema}.workflow_nodes AS p JOIN cancelled ON p.workflow_id = cancelled.id
        WHERE p.status = 'pending'
          AND NOT EXISTS (SELECT 1 FROM {schema}.jobs AS j WHERE j.id = p.job_id)
        FOR UPDATE OF p SKIP LOCKED)
)
SELECT w.status, EXISTS (SELECT 1 FROM cancelled),
       ARRAY(SELECT n.job_id::text FROM {schema}.workflow_nodes AS n
             JOIN {schema}.jobs AS j ON j.id = n.job_id
             WHERE n.workflow_id = w.id ORDER BY n.position)
FROM w

-- lock_workflow --
-- A workflow's status, its row locked until the operator's change commits.
SELECT status FROM {schema}.workflows WHERE id = %(id)s FOR UPDATE

-- stopping_jobs --
-- How many jobs of a workflow's nodes an abort asked to stop and have not ended yet.
SELECT count(*) FROM {schema}.workflow_nodes AS n
JOIN {schema}.jobs AS j ON j.id = n.job_id
WHERE n.workflow_id = %(id)s AND j.abort_requested_at IS NOT NULL

-- nodes_to_retry --
-- The failed and cancelled nodes of a workflow, with their messages to send again (the
-- node's, or its job's once it was sent) and whether their job was ever sent (a row in
-- jobs or history).
SELECT n.id::text, n.job_id::text, coalesce(n.message_bytes, j.message_bytes),
       CASE WHEN n.message_bytes IS NULL THEN j.message ELSE n.message END,
       j.id IS NOT NULL
FROM {schema}.workflow_nodes AS n
LEFT JOIN LATERAL (
    SELECT id, message_bytes, message FROM {schema}.all_jobs WHERE id = n.job_id LIMIT 1
) AS j ON true
WHERE n.workflow_id = %(id)s AND n.status IN ('failed', 'cancelled')
ORDER BY n.position

-- renew_node --
-- A failed or cancelled node is pending again, with a new job (another message id) when
-- its job was sent.
UPDATE {schema}.workflow_nodes
SET status = 'pending', job_id = %(job_id)s, message_bytes = %(message_bytes)s,
    message = %(message)s::jsonb, result = NULL, updated_at = now()
WHERE id = %(id)s

-- reopen_workflow --
-- failed or cancelled -> running by an operator; returns the nodes ready to start (pending,
-- waiting for none: no counter left, or the one node it waits for succeeded; their job
-- never sent).
WITH reopened AS (
    UPDATE {schema}.workflows
    SET status = 'running', finished_at = NULL, ended_by_job = NULL, error = NULL,
        cancelled_by = NULL, updated_at = now()
    WHERE id = %(id)s
    RETURNING id
)
SELECT n.id::text FROM {schema}.workflow_nodes AS n JOIN reopened ON n.workflow_id = reopened.id
WHERE n.status = 'pending'
  AND NOT EXISTS (
      SELECT 1 FROM {schema}.workflow_waits AS w WHERE w.node_id = n.id AND w.waiting > 0)
  AND (n.waits_for <> 1 OR EXISTS (
      SELECT 1 FROM {schema}.workflow_nodes AS p
      WHERE p.workflow_id = n.workflow_id AND n.id = ANY(p.dependents)
        AND p.status = 'succeeded'))
  AND NOT EXISTS (SELECT 1 FROM {schema}.all_jobs AS j WHERE j.id = n.job_id)
ORDER BY n.position
