-- compatibility: compatible
-- New tables and functions, a nullable column on the job tables and the view all_jobs with that column at its end: earlier releases send, claim and finish jobs as before (their rows leave it empty) and read the view's columns by name; a workflow's jobs are moved on by this release's statements only, so run workflows once every worker has it.
--
-- 0025: workflows as rows.
--
-- A workflow (dramatiq_pg_broker.workflow) is a row of `workflows` and one row of
-- `workflow_nodes` per message it runs: a node is one job to be, with the job's row
-- prepared in advance (queue, actor, encoded message, priority, max_attempts), the nodes
-- it waits for counted in `workflow_waits`, the nodes that wait for it in `dependents`, and how
-- its piped input is made from their results in `input`. A node's job carries the node's
-- id in the new column `workflow_node` of jobs and jobs_history; a plain job leaves it
-- null.
--
-- A job that ends (succeeded, failed or cancelled) moves to jobs_history in the statement
-- of its transition, whichever of them ends it (the worker's ack or nack, the reaper, an
-- operator's cancel or abort, a complete_in() block's commit). The row trigger
-- jobs_history_workflow_step, on that insert and only WHEN workflow_node is not null,
-- advances the workflow in the same transaction (workflow_job_ended): the step is done,
-- and the jobs of the steps it completes are inserted (workflow_start_node); or the
-- workflow fails, or is cancelled, and the steps that have not started never will. A
-- worker that dies between the job's end and the next step's start cannot exist: they
-- commit together, or neither does. A plain job pays the WHEN test of a null column at
-- its move to history, nothing else: no function call, no statement, no row.
--
-- A node counts as done when its own job succeeded and every child its actor spawned
-- (current_job().spawn, `open` counts them with the node itself) is done; then each of
-- its dependents waits for one node fewer, and the one that waits for none starts. A
-- node no other waits for is one of the workflow's last: `workflows.remaining` counts
-- them, and the workflow succeeds when it reaches zero.
--
-- The functions run with the schema this migration ran in as their search_path (SET
-- search_path FROM CURRENT): a worker's connections name the schema in every statement
-- and may have any search_path.
--
-- Locking and duration: ALTER TABLE ... ADD COLUMN of a nullable column without a default
-- is a catalog change, under an ACCESS EXCLUSIVE lock on jobs and jobs_history (and its
-- partitions) for its instant; CREATE TRIGGER on jobs_history takes a SHARE ROW EXCLUSIVE
-- lock on it and its partitions for an instant; nothing is scanned or rewritten. The view
-- is recreated from the columns of jobs as they are when this runs (so that columns
-- added by migrations before it stay), under an ACCESS EXCLUSIVE lock on the view alone.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.

ALTER TABLE jobs ADD COLUMN workflow_node uuid;
ALTER TABLE jobs_history ADD COLUMN workflow_node uuid;

-- all_jobs: every column of jobs, in its order, from both tables; the message through
-- message_view (0018). Built from the catalog so that it carries whatever column an
-- earlier migration appended, and workflow_node last.
DO $$
DECLARE
    columns text;
BEGIN
    SELECT string_agg(
               CASE a.attname
                   WHEN 'message' THEN 'message_view(message, message_bytes) AS message'
                   ELSE quote_ident(a.attname)
               END, ', ' ORDER BY a.attnum)
    INTO columns
    FROM pg_attribute AS a
    WHERE a.attrelid = 'jobs'::regclass AND a.attnum > 0 AND NOT a.attisdropped;
    EXECUTE format(
        'CREATE OR REPLACE VIEW all_jobs AS SELECT %s FROM jobs UNION ALL SELECT %s FROM jobs_history',
        columns, columns);
END
$$;

CREATE TABLE workflows (
    id          uuid PRIMARY KEY,
    name        text,
    status      text NOT NULL DEFAULT 'running'
                CONSTRAINT workflows_status_check
                CHECK (status IN ('running', 'succeeded', 'failed', 'cancelled')),
    -- The nodes no other waits for that are not done yet: zero is success.
    remaining   integer NOT NULL CONSTRAINT workflows_remaining_check CHECK (remaining >= 0),
    -- Who ran it (the admin API's user, when one did; a member sees only theirs).
    created_by  text,
    -- Why it failed or was cancelled: the failing job and its error, or who cancelled it.
    ended_by_job uuid,
    error       text,
    cancelled_by text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);

CREATE INDEX workflows_created_at_idx ON workflows (created_at, id);
CREATE INDEX workflows_created_by_idx ON workflows (created_by, created_at, id)
    WHERE created_by IS NOT NULL;

CREATE TABLE workflow_nodes (
    -- What never changes first, what its end changes last: an update's WAL record then
    -- carries the changed end of the row only (PostgreSQL logs the new row less the
    -- prefix it shares with the old one on the same page).
    id            uuid PRIMARY KEY,
    workflow_id   uuid NOT NULL REFERENCES workflows (id) ON DELETE CASCADE,
    -- The top-level step it belongs to (from 0), and its place in the workflow's order.
    step          integer NOT NULL,
    position      integer NOT NULL,
    -- The node whose actor spawned it (current_job().spawn), if one did.
    parent_id     uuid REFERENCES workflow_nodes (id) ON DELETE CASCADE,
    -- How many nodes it waits for (for more than one, workflow_waits counts those not
    -- done yet), and the nodes that wait for it.
    waits_for     integer NOT NULL CONSTRAINT workflow_nodes_waits_for_check CHECK (waits_for >= 0),
    dependents    uuid[] NOT NULL DEFAULT '{}',
    -- The job row it sends when it starts (the job's id is the message's).
    job_id        uuid NOT NULL,
    queue_name    text NOT NULL,
    actor_name    text NOT NULL,
    priority      integer NOT NULL DEFAULT 0,
    max_attempts  integer NOT NULL,
    channel       text NOT NULL,
    -- Its piped input: null (none), {"one": node} or {"list": [input, ...]}.
    input         jsonb,
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- pending until it ends: a pending node whose job was sent runs (the readers say so).
    status        text NOT NULL DEFAULT 'pending'
                  CONSTRAINT workflow_nodes_status_check
                  CHECK (status IN ('pending', 'succeeded', 'failed', 'cancelled')),
    -- Its own job and the children it spawned that are not done yet.
    open          integer NOT NULL DEFAULT 1 CONSTRAINT workflow_nodes_open_check CHECK (open >= 0),
    -- Its actor's result, encoded with the message encoder.
    result        bytea,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    -- The message its job runs, until its job ends (the job's row has it; a retry reads
    -- it there).
    message       jsonb,
    message_bytes bytea
) WITH (fillfactor = 50);

CREATE INDEX workflow_nodes_workflow_idx ON workflow_nodes (workflow_id, position);
CREATE INDEX workflow_nodes_parent_idx ON workflow_nodes (parent_id) WHERE parent_id IS NOT NULL;

-- The nodes a node still waits for, for each node that waits for more than one (a node
-- that waits for one starts when that one is done): a small row of its own, so that the
-- end of each of a group's members updates a few bytes, not its successor's whole row.
CREATE TABLE workflow_waits (
    node_id uuid PRIMARY KEY REFERENCES workflow_nodes (id) ON DELETE CASCADE,
    waiting integer NOT NULL CONSTRAINT workflow_waits_waiting_check CHECK (waiting >= 0)
) WITH (fillfactor = 50);

-- A node's job is sent: the send's row (as insert_job writes it, with the node's id in
-- workflow_node), its `created` event, and the NOTIFY that wakes its queue's consumers.
-- Only a pending node of a running workflow whose job is not in jobs starts (the jobs
-- table's primary key refuses a second start besides); returns whether it did. The node's
-- row is not written: a pending node whose job exists runs (its job's end writes it).
CREATE FUNCTION workflow_start_node(node_id uuid) RETURNS boolean
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    n workflow_nodes;
BEGIN
    SELECT wn.* INTO n
    FROM workflow_nodes AS wn JOIN workflows AS w ON w.id = wn.workflow_id
    WHERE wn.id = node_id AND wn.status = 'pending' AND w.status = 'running'
      AND NOT EXISTS (SELECT 1 FROM jobs AS j WHERE j.id = wn.job_id);
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO jobs (id, queue_name, actor_name, message, message_bytes, priority,
                      available_at, max_attempts, idempotency_key, idempotency_scope,
                      created_at, updated_at, status, workflow_node)
    VALUES (n.job_id, n.queue_name, n.actor_name, n.message, n.message_bytes, n.priority,
            now(), n.max_attempts, NULL, '', now(), now(), 'queued', n.id);
    INSERT INTO job_events (job_id, type, attempt, created_at)
    VALUES (n.job_id, 'created', 0, now());
    PERFORM pg_notify(n.channel, '');
    RETURN true;
END
$$;

-- A node is done (its job succeeded, and every child it spawned is done; the caller
-- marked it succeeded): its parent has one open child fewer, and is done when none is
-- left; each dependent waits for one node fewer and starts when it waits for none; a node
-- nobody waits for takes the workflow one step nearer its end.
CREATE FUNCTION workflow_node_done(n workflow_nodes) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    parent workflow_nodes;
    dependent uuid;
    left_over integer;
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
    -- In id order, so that two transactions join the same nodes in the same order.
    FOREACH dependent IN ARRAY
        coalesce((SELECT array_agg(d ORDER BY d) FROM unnest(n.dependents) AS d), '{}')
    LOOP
        UPDATE workflow_waits SET waiting = waiting - 1
        WHERE node_id = dependent
        RETURNING waiting INTO left_over;
        -- No counter: it waits for this node alone.
        IF NOT FOUND OR left_over = 0 THEN
            PERFORM workflow_start_node(dependent);
        END IF;
    END LOOP;
    IF cardinality(n.dependents) = 0 THEN
        UPDATE workflows
        SET remaining = remaining - 1, updated_at = now(),
            status = CASE WHEN remaining = 1 AND status = 'running' THEN 'succeeded'
                          ELSE status END,
            finished_at = CASE WHEN remaining = 1 AND status = 'running' THEN now()
                               ELSE finished_at END
        WHERE id = n.workflow_id;
    END IF;
END
$$;

-- A workflow's job ended (the row trigger below): succeeded, the node has one open part
-- fewer and is done when none is left; failed, the workflow fails; cancelled, it is
-- cancelled. Either way the nodes whose job is not in jobs (not sent, or ended) and that
-- have not ended are cancelled with it. A job that is not its node's current one (a
-- retried node's earlier job), or whose node has ended, changes nothing.
CREATE FUNCTION workflow_job_ended() RETURNS trigger
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
    UPDATE workflows
    SET status = NEW.status, updated_at = now(), finished_at = now(),
        ended_by_job = NEW.id, error = NEW.last_error
    WHERE id = n.workflow_id AND status = 'running';
    IF FOUND THEN
        UPDATE workflow_nodes AS wn SET status = 'cancelled', updated_at = now()
        WHERE wn.workflow_id = n.workflow_id AND wn.status = 'pending'
          AND NOT EXISTS (SELECT 1 FROM jobs AS j WHERE j.id = wn.job_id);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_history_workflow_step
    AFTER INSERT ON jobs_history
    FOR EACH ROW
    WHEN (NEW.workflow_node IS NOT NULL)
    EXECUTE FUNCTION workflow_job_ended();
