-- Named statements of the job state machine. Each block is "-- name --", comment lines that
-- describe it, then the statement. {schema} is filled in once (as an identifier); every value
-- is a bind parameter. %(now)s is an optional injected clock: NULL means the server's now().
--
-- Every transition writes its event in the same statement (a data-modifying CTE), so a job
-- row and its timeline can never disagree, and it costs no extra round trip.
-- %(events)s turns the event rows off.
--
-- Every transition out of "running" is guarded by ownership: id, status, locked_by and
-- attempts must all match the attempt the caller claimed. A stale worker's update matches
-- no row; the caller sees that as a result, not an error.
--
-- A job row is written here once: the block job_columns lists its columns, and a statement
-- writes {job_columns} for that list and {job_row: column = expression, ...} (or a row
-- fragment, {finished_row: ...}) for a row's values in that order, each column the source
-- row's own unless assigned; they are expanded when the file is loaded (db/queries.py,
-- expand_macros), so the server sees plain SQL. Every job that ends leaves jobs for
-- jobs_history through one piece of statement, {move_to_history: ...}, and every send
-- probes history with {not_sent: ...}: each is written once, below, with {:slots} that
-- each statement fills. A column added to the tables passes through
-- every move unless a statement assigns it, and a test holds job_columns equal to the
-- migrated jobs, jobs_history and all_jobs. {clock_slack_ms} is history_probe.CLOCK_SLACK_MS.

-- job_columns --
-- A fragment, not a statement: the columns of a job row, in the order of the jobs table,
-- jobs_history and all_jobs (see above).
id, queue_name, actor_name, message, message_bytes, status, priority, available_at,
attempts, max_attempts, idempotency_key, locked_by, locked_until, last_error, result,
created_at, updated_at, started_at, finished_at, started, failures, interruptions,
idempotency_scope, abandoned_claims, abort_requested_at, abort_requested_by,
workflow_node

-- finished_row --
-- A fragment, not a statement: what every move to history writes on the row of a job
-- that ends (succeeded, failed or cancelled), the move being the row's DELETE from jobs
-- and, in the same statement, INSERT INTO jobs_history ({job_columns}) SELECT
-- {finished_row: status = ..., ...} FROM the deleted rows: no lock, not started, finished
-- now. Each finishing statement assigns its status and whatever else it changes.
locked_by = NULL,
locked_until = NULL,
started = false,
updated_at = coalesce(%(now)s::timestamptz, now()),
finished_at = coalesce(%(now)s::timestamptz, now())

-- owned_attempts --
-- A fragment, not a statement: the rows of the attempts %(ids)s, %(owners)s, %(attempts)s
-- that are still theirs (the ownership guard of every exit from running), locked first, in
-- id order, whatever plan the statement gets: two statements on overlapping rows (the
-- heartbeat and the outcome writer, say) never deadlock. The id = ANY(...) condition lets
-- the plan find the rows by primary key. Returns (id, lane, owner, ...): a statement
-- writing {owned_attempts: name = array, ...} also gets each attempt's element of the
-- array as that column, and one writing {owned_attempts: where = condition} locks only the
-- rows (j) that meet the condition too. A statement that changes the rows it returns
-- names each by (id, lane): an id stored in two lanes (see 0028) has a row that is not the
-- attempt's (queued, as its send left it).
SELECT j.id, j.lane, o.owner{:values}
FROM {schema}.jobs AS j
JOIN unnest(%(ids)s::uuid[], %(owners)s::text[], %(attempts)s::int[]{:arrays})
    AS o (id, owner, attempt{:names}) ON j.id = o.id
WHERE j.id = ANY(%(ids)s::uuid[])
  AND j.status = 'running' AND j.locked_by = o.owner AND j.attempts = o.attempt{:where}
ORDER BY j.id
FOR UPDATE OF j

-- move_to_history --
-- A fragment, not a statement: the move of every job that ends (succeeded, failed or
-- cancelled), three CTEs of its statement. `done` deletes from jobs the rows j {:using}
-- and {:on} select, returning j.* and the {:returning} columns; `moved` inserts them into
-- jobs_history as {finished_row: ...} with the statement's assignments to the job's
-- columns (its {:row}), returning the {:ended} columns; `freed` deletes the keys of the
-- unique jobs that end (scope 'unique', see sending/unique.py), unless a unique_for
-- period still runs: every exit frees them in the transaction that ends the job (a plain
-- job's row fails the scope test, and job_keys is not read). A statement writes, say,
-- {move_to_history: using = owned, on = j.id = owned.id, returning = owned.owner,
-- status = 'succeeded'}, then reads `done` (and `moved`) in its own CTEs.
done AS (
    DELETE FROM {schema}.jobs AS j{:using}
    WHERE {:on}
    RETURNING j.*{:returning}
), moved AS (
    INSERT INTO {schema}.jobs_history ({job_columns})
    SELECT {finished_row: {:row}}
    FROM done{:ended}
), freed AS (
    DELETE FROM {schema}.job_keys AS k
    USING done
    WHERE done.idempotency_scope = 'unique'
      AND k.actor_name = done.actor_name AND k.idempotency_scope = 'unique'
      AND k.idempotency_key = done.idempotency_key AND k.job_id = done.id
      AND (k.expires_at IS NULL OR k.expires_at <= coalesce(%(now)s::timestamptz, now()))
)

-- sent_columns --
-- A fragment, not a statement: the columns a send writes, in the order every send (one
-- message, an array of them, a staged or copied batch) gives them. The status is always
-- written ('queued'): since 0022 the column's default refuses the sends of code that
-- leaves it out (0.1.0's), whose keys and ids would not be looked up in history.
id, queue_name, actor_name, message, message_bytes, priority, available_at,
max_attempts, idempotency_key, idempotency_scope, created_at, updated_at, status

-- sent_since --
-- A fragment, not a statement: the earliest finish time of a job whose message was built
-- at {:sent_at_ms} (milliseconds since the epoch; NULL: any time), less the clocks'
-- slack. A job cannot finish before its message was built, so a probe of history by id
-- reads only the partitions from there on (pruned at execution, even in a generic plan).
coalesce(
    'epoch'::timestamptz + ({:sent_at_ms} - {clock_slack_ms}) * interval '1 millisecond',
    '-infinity')

-- not_sent --
-- A fragment, not a statement: no job has the id {:id} yet, neither finished (history,
-- from {sent_since: ...} of {:sent_at_ms} on) nor unfinished, as the send's snapshot sees
-- it (see insert_job).
NOT EXISTS (
    SELECT 1 FROM {schema}.jobs_history AS h
    WHERE h.id = {:id}
      AND h.finished_at >= {sent_since: sent_at_ms = {:sent_at_ms}}
) AND NOT EXISTS (SELECT 1 FROM {schema}.jobs AS o WHERE o.id = {:id})

-- insert_sent --
-- A fragment, not a statement: the CTEs new_keys, inserted and event of a batch send
-- (insert_jobs, insert_staged_jobs), reading the rows to send from {:rows} (the send's
-- fields and each row's position in the batch; an id {:cast} to uuid where it is text).
new_keys AS (
    INSERT INTO {schema}.job_keys
        (actor_name, idempotency_scope, idempotency_key, job_id, expires_at)
    SELECT k.actor_name, k.idempotency_scope, k.idempotency_key, k.id{:cast},
           coalesce(%(now)s::timestamptz, now()) + k.unique_for_ms * interval '1 millisecond'
    FROM {:rows} AS k
    WHERE k.idempotency_key IS NOT NULL
      AND {not_sent: id = k.id{:cast}, sent_at_ms = k.sent_at_ms}
    ORDER BY k.position
    ON CONFLICT DO NOTHING
    RETURNING job_id
), inserted AS (
    INSERT INTO {schema}.jobs AS j ({sent_columns})
    SELECT id{:cast}, queue_name, actor_name, message, message_bytes, priority,
           coalesce(%(now)s::timestamptz, now()) + delay_ms * interval '1 millisecond',
           max_attempts, idempotency_key, idempotency_scope,
           coalesce(%(now)s::timestamptz, now()) + (position - 1) * interval '1 microsecond',
           coalesce(%(now)s::timestamptz, now()), 'queued'
    FROM {:rows} AS g
    WHERE {not_sent: id = g.id{:cast}, sent_at_ms = g.sent_at_ms}
      AND (g.idempotency_key IS NULL OR g.id{:cast} IN (SELECT job_id FROM new_keys))
    ON CONFLICT DO NOTHING
    RETURNING j.id, j.created_at
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, created_at)
    SELECT id, 'created', 0, created_at FROM inserted WHERE %(events)s
)

-- insert_job --
-- Store one message as a queued job with its `created` event, and wake the queue's
-- consumers when %(channel)s is given. NOTIFY is delivered at commit and carries no
-- payload: it only says "look". A send in an application's transaction passes its queue's
-- channel (the wake-up must follow that transaction's commit); the broker's own sends pass
-- none and are told to the process's notifier once committed (sending/notifier.py): a
-- commit that notified holds PostgreSQL's database-wide notify lock through its WAL flush,
-- which would serialize every concurrent send's commit.
-- An existing id or idempotency key (per actor and scope) inserts nothing and returns no
-- row, whether its job is unfinished (jobs) or finished (jobs_history, see 0012). The id
-- is looked up in both tables with the statement's snapshot, not only left to the primary
-- key: a worker's move to history deletes the row from jobs and inserts it in history in
-- one transaction, so a snapshot sees the id in one table or the other, while the primary
-- key alone would let the insert in once the move commits (it waits for the move, then
-- finds the old row gone). The row returned says the transaction's isolation level: under
-- REPEATABLE READ or SERIALIZABLE the snapshot may predate the job's send, and the caller
-- looks for the id in history again outside it (jobs.py, JobStore._confirm_new). A job
-- cannot finish before its message was built, so the probe of history by id reads only
-- the partitions from the message's timestamp (%(sent_at_ms)s, less an hour for the
-- clocks of senders and server to differ) on: one or two days of each status, pruned at
-- execution even in a generic plan. Without a timestamp every partition is probed. A key
-- is registered in job_keys, which holds it for its job's whole life: the job is inserted
-- only if the key was new (keyed sends only; a real unique index, so no race with a move
-- to history can let a second job in), and the key only for an id not sent yet (a send
-- of a finished job's message, refused, must not take back the key its job freed). A unique job's key (scope 'unique') is a key like
-- any other here, with the end of its unique_for period (NULL: none); it is freed when
-- its job ends (move_to_history) or, failing that, by the next send that finds it
-- (release_unique_key). message_bytes is what workers decode; the jsonb view is for display only: it is
-- given when it differs from the bytes (a display-safe copy) and null when jsonb holds the
-- bytes as they are: the view all_jobs parses them on read (migration 0018), so the
-- message crosses the wire and lands in the row once.
-- A send that is not %(durable)s commits without waiting for its WAL flush: set_config(...,
-- true) is local to this statement's own transaction (the pool's connections autocommit;
-- a caller's transaction always passes durable). A server crash can then lose the sends
-- of its last moments (up to three times wal_writer_delay); nothing else changes.
WITH new_key AS (
    INSERT INTO {schema}.job_keys
        (actor_name, idempotency_scope, idempotency_key, job_id, expires_at)
    SELECT %(actor_name)s, %(idempotency_scope)s, %(idempotency_key)s, %(id)s::uuid,
           coalesce(%(now)s::timestamptz, now())
               + %(unique_for_ms)s::bigint * interval '1 millisecond'
    WHERE %(idempotency_key)s::text IS NOT NULL
      AND {not_sent: id = %(id)s::uuid, sent_at_ms = %(sent_at_ms)s::bigint}
    ON CONFLICT DO NOTHING
    RETURNING job_id
), inserted AS (
    INSERT INTO {schema}.jobs AS j ({sent_columns})
    SELECT
        %(id)s, %(queue_name)s, %(actor_name)s,
        %(message)s::jsonb, %(message_bytes)s, %(priority)s,
        coalesce(%(now)s::timestamptz, now()) + %(delay_ms)s * interval '1 millisecond',
        %(max_attempts)s, %(idempotency_key)s, %(idempotency_scope)s,
        coalesce(%(now)s::timestamptz, now()), coalesce(%(now)s::timestamptz, now()), 'queued'
    WHERE {not_sent: id = %(id)s::uuid, sent_at_ms = %(sent_at_ms)s::bigint}
      AND (%(idempotency_key)s::text IS NULL OR EXISTS (SELECT 1 FROM new_key))
    ON CONFLICT DO NOTHING
    RETURNING j.id, j.created_at
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, created_at)
    SELECT id, 'created', 0, created_at FROM inserted WHERE %(events)s
), no_flush_wait AS (
    SELECT set_config('synchronous_commit', 'off', true) WHERE NOT %(durable)s
)
SELECT id,
       CASE WHEN %(channel)s::text IS NOT NULL THEN pg_notify(%(channel)s, '') END,
       current_setting('transaction_isolation')
FROM inserted LEFT JOIN no_flush_wait ON true

-- find_existing --
-- The job that made an insert a no-op: the same message id, or the same idempotency key
-- of the same actor and scope, unfinished or in history (the key's job, from job_keys,
-- which holds every key: jobs has no index on keys since 0028).
-- The jsonb view is returned only for an older row that has no bytes (a worker or sender
-- decodes the bytes).
SELECT id, status, CASE WHEN message_bytes IS NULL THEN message END, message_bytes
FROM (
    SELECT id, status, message, message_bytes
    FROM {schema}.jobs
    WHERE id = %(id)s
       OR id = (SELECT job_id FROM {schema}.job_keys
                WHERE idempotency_key = %(idempotency_key)s AND actor_name = %(actor_name)s
                  AND idempotency_scope = %(idempotency_scope)s)
    UNION ALL
    SELECT id, status, message, message_bytes
    FROM {schema}.jobs_history
    WHERE id = %(id)s::uuid
      AND finished_at >= {sent_since: sent_at_ms = %(sent_at_ms)s::bigint}
    UNION ALL
    SELECT id, status, message, message_bytes
    FROM {schema}.jobs_history
    WHERE id = (SELECT job_id FROM {schema}.job_keys
                WHERE idempotency_key = %(idempotency_key)s AND actor_name = %(actor_name)s
                  AND idempotency_scope = %(idempotency_scope)s)
) AS found
ORDER BY (id = %(id)s::uuid) DESC
LIMIT 1

-- release_stale_key --
-- An idempotency key whose job no longer exists anywhere (deleted by hand: retention and
-- flush free the keys of the jobs they delete) is freed, so that the send can take it.
DELETE FROM {schema}.job_keys AS k
WHERE k.idempotency_key = %(idempotency_key)s AND k.actor_name = %(actor_name)s
  AND k.idempotency_scope = %(idempotency_scope)s
  AND NOT EXISTS (SELECT 1 FROM {schema}.all_jobs AS j WHERE j.id = k.job_id)

-- release_unique_key --
-- The key of a unique job that is free to take again (see sending/unique.py): its job has
-- ended (it is not in jobs: a move to history is one transaction, so the statement's
-- snapshot sees it in one table or the other) and its unique_for period, if any, has run
-- out. The move to history frees such a key itself; one is left when its period ran past
-- the job's end, or when a worker of a release before 0024 ended the job. Returns the
-- job the key was freed from; the send then inserts again.
DELETE FROM {schema}.job_keys AS k
WHERE k.idempotency_key = %(idempotency_key)s AND k.actor_name = %(actor_name)s
  AND k.idempotency_scope = %(idempotency_scope)s
  AND NOT EXISTS (SELECT 1 FROM {schema}.jobs AS j WHERE j.id = k.job_id)
  AND (k.expires_at IS NULL OR k.expires_at <= coalesce(%(now)s::timestamptz, now()))
RETURNING k.job_id

-- reenqueue_job --
-- A message enqueued again with the id of a job that is waiting or running (a snooze:
-- `broker.enqueue(message.copy(), delay=...)`): the row goes back to queued with the new
-- message, queue, priority and delay. A running attempt loses its ownership, so its
-- owner's outcome later matches nothing. The attempt already charged stays charged;
-- max_attempts is the new message's (derived by the sender, as for a new job).
-- Finished rows are never touched (the caller raises), nor a row whose abort was requested:
-- an aborted job never goes back to its queue.
WITH moved AS (
    UPDATE {schema}.jobs AS j
    SET status = 'queued',
        locked_by = NULL,
        locked_until = NULL,
        queue_name = %(queue_name)s,
        message = %(message)s::jsonb,
        message_bytes = %(message_bytes)s,
        priority = %(priority)s,
        available_at = coalesce(%(now)s::timestamptz, now()) + %(delay_ms)s * interval '1 millisecond',
        max_attempts = %(max_attempts)s,
        -- A claim whose actor never started gives its attempt back.
        attempts = CASE WHEN j.status = 'running' AND NOT j.started THEN j.attempts - 1
                        ELSE j.attempts END,
        started = false,
        updated_at = coalesce(%(now)s::timestamptz, now())
    WHERE j.id = %(id)s AND j.status IN ('queued', 'running') AND j.abort_requested_at IS NULL
    RETURNING j.id, j.attempts, j.available_at
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, data)
    SELECT id, 'retry_scheduled', attempts,
           jsonb_build_object('reason', 'enqueued again', 'delay_ms', %(delay_ms)s::bigint,
                              'available_at', available_at)
    FROM moved WHERE %(events)s
)
SELECT id, CASE WHEN %(channel)s::text IS NOT NULL THEN pg_notify(%(channel)s, '') END
FROM moved

-- insert_jobs --
-- Many messages in one statement (bulk enqueue), each with its `created` event; the arrays
-- are parallel, one element per message, each named as insert_job's parameter of the same
-- field (jobs.py SEND_FIELDS). As insert_job: an existing id or idempotency key, unfinished
-- or in history (each looked up with the statement's snapshot), inserts nothing, and the
-- rows that were inserted are returned with the transaction's isolation level. All the rows get the same now(), so created_at is advanced by one microsecond per
-- position: jobs of equal priority and availability are then claimed in the order sent.
-- Concurrent single sends share this statement (group commit, one autocommit transaction):
-- they pass %(durable)s false when none of them needs the WAL flush (as insert_job), and
-- the %(channels)s to wake only where every send notifies in its own statement (the
-- notify_sends setting `statement`); by default their queues are told to the notifier
-- once the statement committed (see insert_job). A bulk enqueue passes no channel (it
-- notifies at its end).
WITH given AS (
    SELECT *
    FROM unnest(
        %(id)s::uuid[], %(queue_name)s::text[], %(actor_name)s::text[],
        %(message)s::jsonb[], %(message_bytes)s::bytea[], %(priority)s::integer[],
        %(delay_ms)s::bigint[], %(max_attempts)s::integer[], %(idempotency_key)s::text[],
        %(idempotency_scope)s::text[], %(sent_at_ms)s::bigint[], %(unique_for_ms)s::bigint[]
    ) WITH ORDINALITY AS g (
        id, queue_name, actor_name, message, message_bytes, priority, delay_ms, max_attempts,
        idempotency_key, idempotency_scope, sent_at_ms, unique_for_ms, position
    )
), {insert_sent: rows = given}, woken AS (
    SELECT count(pg_notify(channel, '')) FROM unnest(%(channels)s::text[]) AS channel
), no_flush_wait AS (
    SELECT set_config('synchronous_commit', 'off', true) WHERE NOT %(durable)s
)
SELECT id, current_setting('transaction_isolation')
FROM inserted LEFT JOIN woken ON true LEFT JOIN no_flush_wait ON true

-- bulk_now --
-- The clock of a bulk enqueue written with COPY (COPY computes nothing): the injected clock,
-- else the transaction's now(), which every statement of the transaction shares.
SELECT coalesce(%(now)s::timestamptz, now())

-- copy_jobs --
-- A bulk enqueue with no conflict to resolve, straight into the jobs table (binary COPY, in
-- this column order). The rows arrive with available_at and created_at computed from
-- bulk_now, as insert_jobs computes them, and the jsonb view when the sender gave one
-- (the binary form of jsonb is a version byte and the text; the server parses it). COPY
-- has no ON CONFLICT: an existing id or idempotency key aborts it with a unique violation,
-- and the caller, which ran it in a savepoint, takes the staged path instead.
COPY {schema}.jobs ({sent_columns}) FROM STDIN (FORMAT BINARY)

-- copy_created_events --
-- The `created` events of the rows copy_jobs wrote (binary COPY, in this column order).
COPY {schema}.job_events (job_id, type, attempt, created_at) FROM STDIN (FORMAT BINARY)

-- copy_keys --
-- The idempotency keys of the jobs copy_jobs wrote, registered as insert_jobs registers
-- them, but with no ON CONFLICT: a key already held aborts with a unique violation, and
-- the caller takes the resolving path (as for a conflict of copy_jobs itself).
INSERT INTO {schema}.job_keys
    (actor_name, idempotency_scope, idempotency_key, job_id, expires_at)
SELECT actor_name, scope, key, job_id,
       coalesce(%(now)s::timestamptz, now()) + period * interval '1 millisecond'
FROM unnest(%(key_actors)s::text[], %(key_scopes)s::text[], %(keys)s::text[],
            %(key_ids)s::uuid[], %(key_periods)s::bigint[])
    AS k (actor_name, scope, key, job_id, period)

-- copied_in_history --
-- Whether a job just written by copy_jobs (%(ids)s) has its id in history, or in jobs
-- twice (COPY cannot probe as insert_jobs does, and the primary key is (id, lane) since
-- 0028: an id stored in another lane is no conflict to it): the caller then rolls the
-- COPY back and takes the staged path, which resolves each conflict. As in insert_job, the probe reads the partitions
-- from the oldest message's timestamp on, and the transaction's isolation level comes
-- with the answer. Under READ COMMITTED this statement's snapshot is taken after the
-- COPY, which waited for any move of one of its ids to commit: it sees that move.
SELECT EXISTS (
    SELECT 1 FROM {schema}.jobs_history AS h
    WHERE h.id = ANY(%(ids)s::uuid[])
      AND h.finished_at >= {sent_since: sent_at_ms = %(sent_at_ms)s::bigint}
) OR EXISTS (
    SELECT 1 FROM {schema}.jobs AS j
    WHERE j.id = ANY(%(ids)s::uuid[])
    GROUP BY j.id HAVING count(*) > 1
), current_setting('transaction_isolation')

-- finished_among --
-- Which of %(ids)s, just inserted by an application's transaction under REPEATABLE READ or
-- SERIALIZABLE, are in history or in jobs: run on another connection, whose statement
-- sees the rows committed after that transaction's snapshot was taken (a job sent, run
-- and finished meanwhile; or sent meanwhile into another lane, which the primary key
-- (id, lane) of 0028 does not stop), and not that transaction's own uncommitted rows. Any
-- id found means the insert gave it a second row: the caller refuses it.
SELECT DISTINCT id FROM (
    SELECT h.id FROM {schema}.jobs_history AS h
    WHERE h.id = ANY(%(ids)s::uuid[])
      AND h.finished_at >= {sent_since: sent_at_ms = %(sent_at_ms)s::bigint}
    UNION ALL
    SELECT j.id FROM {schema}.jobs AS j WHERE j.id = ANY(%(ids)s::uuid[])
) AS found

-- lane_emptyings --
-- The transaction of each lane's last emptying (0028), read on one of the pool's
-- connections (a fresh snapshot): see unseen_emptyings.
SELECT emptied_xid::text FROM {schema}.job_lanes WHERE emptied_xid IS NOT NULL

-- unseen_emptyings --
-- Whether the snapshot of the transaction open on this connection (an application's, at
-- REPEATABLE READ or SERIALIZABLE) predates one of the emptyings %(xids)s: it then sees
-- the emptied lane empty (TRUNCATE is not MVCC-safe) and not the rows copied out of it,
-- so the absence of a job is no proof there. At READ COMMITTED the statement's snapshot
-- is new: false.
SELECT coalesce(bool_or(NOT pg_visible_in_snapshot(x, pg_current_snapshot())), false)
FROM unnest(%(xids)s::text[]::xid8[]) AS x

-- refuse_send --
-- Abort the application's transaction as PostgreSQL aborts one whose snapshot cannot be
-- kept: a serialization failure (SQLSTATE 40001), which frameworks and applications retry.
-- Inside the bulk send's savepoint, only the savepoint is rolled back (the rows with it).
DO $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'serialization_failure',
        MESSAGE = 'could not serialize the send: a job with the id of a message sent in this '
                  'transaction finished after the transaction''s snapshot was taken',
        HINT = 'Retry the transaction.';
END
$$

-- stage_jobs --
-- A temporary table for a large bulk enqueue, filled with COPY (much cheaper than one huge
-- statement's parameters), read by insert_staged_jobs, dropped at once after. Temporary
-- and dropped within the transaction, so it holds no session state (poolers work). Its
-- columns are the send's fields (jobs.py SEND_FIELDS), then the position in the batch.
CREATE TEMPORARY TABLE dramatiq_pg_broker_staged_jobs (
    id text, queue_name text, actor_name text, message jsonb, message_bytes bytea,
    priority integer, delay_ms bigint, max_attempts integer,
    idempotency_key text, idempotency_scope text, sent_at_ms bigint, unique_for_ms bigint,
    position bigint
) ON COMMIT DROP

-- copy_staged_jobs --
-- Fill the staging table (binary COPY, in the order of its columns).
COPY dramatiq_pg_broker_staged_jobs FROM STDIN (FORMAT BINARY)

-- insert_staged_jobs --
-- insert_jobs, reading the staged rows instead of arrays (same rules, same events, the
-- same isolation level returned).
WITH {insert_sent: rows = dramatiq_pg_broker_staged_jobs, cast = ::uuid}
SELECT id, current_setting('transaction_isolation') FROM inserted

-- drop_staged_jobs --
-- The staging table is done with (a second bulk enqueue in the same transaction makes its own).
DROP TABLE dramatiq_pg_broker_staged_jobs

-- notify_queues --
-- Wake the consumers of several queues at once (after a bulk enqueue, an operator's retry, a
-- release or a reaper run), at commit.
SELECT pg_notify(channel, '') FROM unnest(%(channels)s::text[]) AS channel

-- wake_queues --
-- The process's notifier (sending/notifier.py): wake the consumers of the queues whose
-- sends committed since its last statement, in a transaction of its own that writes
-- nothing else, so that the notify lock is only ever waited for by other processes'
-- notifiers, never by a send. Its commit does not wait for the WAL flush
-- (set_config(..., true) is local to this autocommit statement): a NOTIFY is delivered
-- once its transaction commits, and a durable commit here put a second flush between a
-- send's commit and the worker's wake-up (a p50 1.3 to 2 x the previous one's under load,
-- docs/benchmarks.md); it also holds the lock for less. A server crash that lost it loses
-- nothing: the LISTEN connections' reconnection makes every consumer look.
WITH no_flush_wait AS (
    SELECT set_config('synchronous_commit', 'off', true)
)
SELECT count(pg_notify(channel, ''))
FROM no_flush_wait CROSS JOIN unnest(%(channels)s::text[]) AS channel

-- server_now --
-- The server's clock, for comparisons with timestamps the server wrote.
SELECT now()

-- claim_jobs --
-- Claim up to %(limit)s runnable jobs of a queue for one worker, in claim order.
-- SKIP LOCKED lets many consumers claim at once without waiting on each other's rows: a row
-- another transaction is claiming is simply not ours. Selection and update are one
-- statement (no check-then-act), committed at once; no transaction stays open while the
-- actor runs. The order (priority, available_at, created_at, id) is exactly the partial
-- index jobs_claim_order_idx, so the scan stops after %(limit)s rows (merged across the
-- lanes of jobs, 0028; the update finds each picked row in its own lane).
-- The claim is a durable commit: a worker runs a claimed message without asking the
-- database again (its start is written after the actor began), so a claim lost in a
-- server crash would let the job run twice, once here and once for whoever claims the
-- row after the restart.
-- A claim that finds nothing returns one row instead, whose id is NULL, with the wait in
-- seconds until the queue's earliest delayed job becomes runnable by the server's clock
-- and that job's available_at (both NULL: nothing waits), so an idle poll is one statement
-- and a worker whose clock differs from the server's still wakes when the server will
-- hand the job out. The wait hops from one priority to the next through the claim index
-- (a loose index scan, one probe per distinct priority in use): a plain min(available_at)
-- would read every waiting entry of the queue, 100,000 index entries for 100,000 delayed
-- jobs, on every idle poll. That row also says, in seconds, when the earliest lease of any
-- running job (of any queue) expires (NULL: no job runs): one probe of jobs_lease_expiry_idx,
-- which lets an idle worker's reaper skip its runs while no lease can have expired (see
-- leases.py). Both are read by claim_wait() (0029), a PL/pgSQL function whose statements
-- keep their plans for the session: in this statement they would be planned once per
-- lane at each of a session's first executions (0.76 ms of the claim's 1.15 ms of
-- planning, measured on PostgreSQL 15), and only an idle claim needs them.
-- A paused queue (operator control, the queues table) is claimed by nobody: the pause is
-- read here, by primary key, once per claim (a one-time filter: an unpaused queue's claim
-- walks its index as before), so no worker on any host can act on a stale copy of it. Its
-- empty row says so (paused), with no wait: nothing there becomes runnable by itself.
-- A claimed row whose abort was requested (only an older worker's requeue leaves one
-- queued) comes back marked, and its worker cancels it instead of running it.
-- One plan serves many claims. The queue, the time and the limit are read through
-- sub-selects (each evaluated once, an index condition all the same), so that a plan made
-- for the values at hand (a custom plan) is estimated no cheaper than one made for any
-- values (the generic plan), and PostgreSQL keeps the generic plan after its first five
-- executions, until an ANALYZE or a TRUNCATE of a lane makes it plan again. (A queue that
-- grew far beyond what a session's first plans saw may then get custom plans for a while:
-- PostgreSQL weighs the new generic plan against the average of the custom plans it made.)
-- With the values in sight, a queue whose table has statistics (thousands of queued jobs,
-- analyzed) was estimated cheaper by a custom plan at every execution, so the statement
-- was planned at every claim: 0.7 ms a plan over the lanes' four tables, more than the
-- claim of one job takes to run (docs/benchmarks.md, "The claim's plan").
-- The update joins the picked rows by (id, lane) (an id stored in two lanes, see 0028,
-- has a row no claim picked nor locked) and also names their ids in an array: the generic
-- plan does not know how many rows the LIMIT lets through, and where it expects many (a
-- queue of thousands of queued jobs), the join alone was planned as a hash of every
-- lane's rows; with the array, a lane that its statistics say holds rows is probed by its
-- primary key (and where the plan expects few, as on a table never analyzed, the join is
-- a nested loop of key probes, which a plain array condition would have made sequential
-- scans).
WITH RECURSIVE pause AS (
    SELECT EXISTS (
        SELECT 1 FROM {schema}.queues AS q WHERE q.queue_name = %(queue_name)s AND q.paused
    ) AS paused
), picked AS (
    SELECT id, lane
    FROM {schema}.jobs
    WHERE queue_name = (SELECT %(queue_name)s::text)
      AND status = 'queued'
      AND available_at <= (SELECT coalesce(%(now)s::timestamptz, now()))
      AND NOT (SELECT paused FROM pause)
    ORDER BY priority, available_at, created_at, id
    LIMIT (SELECT %(limit)s::integer)
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE {schema}.jobs AS j
    SET status = 'running',
        attempts = j.attempts + 1,
        locked_by = %(owner)s,
        locked_until = coalesce(%(now)s::timestamptz, now()) + %(lease_ms)s * interval '1 millisecond',
        started_at = coalesce(%(now)s::timestamptz, now()),
        updated_at = coalesce(%(now)s::timestamptz, now())
    FROM picked
    WHERE j.id = picked.id AND j.lane = picked.lane
      AND j.id = ANY (ARRAY(SELECT id FROM picked))
    RETURNING j.id, j.priority, j.available_at, j.created_at, j.attempts, j.max_attempts,
              j.message, j.message_bytes, j.failures, j.abandoned_claims,
              j.abort_requested_at IS NOT NULL AS abort_requested
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor)
    SELECT id, 'claimed', attempts, %(owner)s FROM claimed WHERE %(events)s
)
-- UPDATE ... RETURNING does not keep the selection's order: restore the claim order, so
-- the worker starts a batch's jobs in the order they were chosen.
-- The jsonb view travels only for an older row without bytes: workers decode the bytes.
SELECT id, priority, attempts, max_attempts,
       CASE WHEN message_bytes IS NULL THEN message END, message_bytes,
       failures, abandoned_claims, NULL::float8 AS wait_seconds,
       available_at, created_at, NULL::float8 AS lease_seconds_left, abort_requested,
       NULL::boolean AS paused
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       CASE WHEN NOT pause.paused THEN w.wait_seconds END,
       CASE WHEN NOT pause.paused THEN w.next_available_at END,
       NULL, w.lease_seconds_left, NULL, pause.paused
FROM pause, {schema}.claim_wait(%(queue_name)s, coalesce(%(now)s::timestamptz, now())) AS w
WHERE NOT EXISTS (SELECT 1 FROM claimed)
ORDER BY 2, 10, 11, 1

-- limited_queue_room --
-- How many more jobs of a limited queue may run now (JobStore.claim_limited, after the
-- queue's lock, limits.sql lock_limited_queue): its limit less its running jobs (claimed,
-- started, or held by a worker that stopped renewing them, until their lease runs out),
-- and the limit itself (NULL: the queue has no limit any more, and the claim is not
-- bounded). A running job whose lease ran out (lease_ran_out, the reaper's own test)
-- holds no place: the reaper may requeue it at any moment, and its worker, dead or cut
-- off, has lost it; so a crashed worker's place comes back within one lease, not when
-- the reaper next runs. Running rows are few (one per busy worker thread): the count
-- reads the running-rows index (jobs_lease_expiry_idx). Also whether an operator paused
-- the queue: a paused queue at its limit is paused, not at its limit (its consumers wait
-- for the resume's announcement instead of looking again every few milliseconds).
SELECT l.max_running,
       greatest(0, l.max_running - (
           SELECT count(*) FROM {schema}.jobs
           WHERE queue_name = %(queue_name)s AND status = 'running'
             AND NOT coalesce({lease_ran_out}, false)
       ))::int,
       coalesce(
           (SELECT q.paused FROM {schema}.queues AS q WHERE q.queue_name = %(queue_name)s),
           false
       )
FROM (SELECT 1) AS one
LEFT JOIN {schema}.queue_limits AS l ON l.queue_name = %(queue_name)s

-- start_jobs --
-- Claimed attempts whose actors run or are about to: from here on each is an attempt (a
-- worker that dies later has interrupted it; before this, its claim is given back
-- uncharged). Returns the attempts still owned. With %(lease_ms)s the lease starts afresh
-- (a start recorded before its actor runs); with NULL it is left as it is, so the update
-- changes no indexed column and is a HOT update (a start recorded after its actor began,
-- whose lease the heartbeat keeps). Like a claim, this commits without waiting for its WAL
-- flush: a start lost in a server crash only makes the attempt look unstarted, and the
-- next durable commit flushes it.
WITH owned AS MATERIALIZED (
    {owned_attempts}
), marked AS (
    UPDATE {schema}.jobs AS j
    SET started = true,
        locked_until = coalesce(
            coalesce(%(now)s::timestamptz, now()) + %(lease_ms)s * interval '1 millisecond',
            j.locked_until)
    FROM owned
    WHERE j.id = owned.id AND j.lane = owned.lane
    RETURNING j.id
)
SELECT id FROM marked, (SELECT set_config('synchronous_commit', 'off', true)) AS no_flush_wait

-- complete_jobs --
-- running -> succeeded for many attempts at once (acks are written in batches). A finished
-- job leaves the jobs table for jobs_history in this statement: the row is deleted and
-- inserted there as it ends (the same columns, in the same order, see 0012: every value
-- carried over but what finished_row and the statement set).
WITH owned AS MATERIALIZED (
    {owned_attempts}
), {move_to_history:
    using = owned, on = j.id = owned.id, returning = owned.owner, status = 'succeeded'
}, event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor)
    SELECT id, 'succeeded', attempts, owner FROM done WHERE %(events)s
)
SELECT id FROM done

-- complete_in_transaction --
-- running -> succeeded for one attempt, in the application's own transaction (an actor's
-- `current_job().complete_in(conn)` block, see completion.py): the job succeeds if and
-- when that transaction commits, and with it the actor's writes. Guarded by ownership like
-- every exit from running, and by the absence of an abort request: an aborted attempt must
-- not commit its effects. The row lock stays with the application's transaction until it
-- ends; the worker neither renews nor records the start of the attempt meanwhile
-- (inflight.py), and its own outcome later finds the row gone (committed) or still this
-- attempt's (rolled back). Returns the transaction's id, by which the worker learns how
-- the transaction ended (completion_status); no row: the attempt is no longer owned.
-- The finish time is this statement's, not now(): the application's transaction may have
-- begun well before it.
WITH owned AS MATERIALIZED (
    SELECT j.id
    FROM {schema}.jobs AS j
    WHERE j.id = %(id)s AND j.status = 'running' AND j.locked_by = %(owner)s
      AND j.attempts = %(attempt)s AND j.abort_requested_at IS NULL
    FOR UPDATE OF j
), {move_to_history:
    using = owned, on = j.id = owned.id,
    status = 'succeeded',
    updated_at = coalesce(%(now)s::timestamptz, statement_timestamp()),
    finished_at = coalesce(%(now)s::timestamptz, statement_timestamp())
}, event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor, data)
    SELECT id, 'succeeded', attempts, %(owner)s, jsonb_build_object('in_transaction', true)
    FROM done WHERE %(events)s
)
SELECT id, pg_current_xact_id()::text FROM done

-- transaction_isolation --
-- The isolation level of the transaction open on the connection (read committed,
-- repeatable read, ...). SHOW takes no snapshot: a transaction that has read nothing yet
-- still takes its snapshot at its next statement.
SHOW transaction_isolation

-- pin_completion --
-- A complete_in() block in a REPEATABLE READ or SERIALIZABLE transaction begins (see
-- completion.py): the worker writes its attempt's row once more before the transaction's
-- snapshot is taken, then leaves the row alone until the block's transaction ends (no
-- renewal, no start record). The start is recorded (the attempt counts) and the lease
-- renewed; the new locked_until marks this version of the row, which the block's
-- transaction must see (lock_for_completion). Returns it and whether an abort was
-- requested; no row: the attempt is no longer owned.
UPDATE {schema}.jobs AS j
SET started = true,
    locked_until = coalesce(%(now)s::timestamptz, now()) + %(lease_ms)s * interval '1 millisecond'
WHERE j.id = %(id)s AND j.status = 'running' AND j.locked_by = %(owner)s AND j.attempts = %(attempt)s
RETURNING j.locked_until, j.abort_requested_at IS NOT NULL

-- lock_lanes_for_completion --
-- Before lock_for_completion, at REPEATABLE READ or SERIALIZABLE: wait for an emptying
-- of a lane (0028) to commit and keep the next one out until the transaction ends. LOCK
-- takes no snapshot, and a statement takes the transaction's snapshot before it waits for
-- the lanes' locks: without this, a block whose first statement met the emptying of its
-- job's lane would see that lane empty and the row's copy not yet made, and lose its
-- attempt for nothing. ROW SHARE, what the row lock that follows takes anyway.
LOCK TABLE {schema}.jobs IN ROW SHARE MODE

-- lock_for_completion --
-- The first statement of a complete_in() block's use of a REPEATABLE READ or SERIALIZABLE
-- transaction, right after pin_completion: locks the job's row until the transaction ends
-- and says whether the transaction's snapshot sees the pinned version (%(pinned)s, its
-- locked_until), and whether that version is the attempt's, with no abort requested. A
-- snapshot taken by this statement sees it; one the transaction took before the block
-- does not, and the success could never be written in it: at these levels a transaction
-- cannot delete a row written after its snapshot (a serialization failure). FOR KEY SHARE,
-- the weakest lock: the reaper (FOR UPDATE SKIP LOCKED) passes the row by while it is
-- held, and an operator's abort (abort_job, FOR NO KEY UPDATE) is not kept waiting; its
-- mark on the row then fails the block's success, as it must. An id stored in two lanes
-- (docs/internals/job-row.md) has two rows: the attempt's (this owner's, the pinned
-- version) is the one read, whatever order the lanes come in.
SELECT j.locked_until = %(pinned)s::timestamptz,
       j.status = 'running' AND j.locked_by = %(owner)s AND j.attempts = %(attempt)s
           AND j.abort_requested_at IS NULL
FROM {schema}.jobs AS j
WHERE j.id = %(id)s
ORDER BY j.locked_by IS NOT DISTINCT FROM %(owner)s DESC,
         j.locked_until IS NOT DISTINCT FROM %(pinned)s::timestamptz DESC
LIMIT 1
FOR KEY SHARE OF j

-- completion_status --
-- How the application's transaction that ran complete_in_transaction for an attempt ended,
-- read by the worker once the actor returned: pg_xact_status of its id ('committed',
-- 'aborted' or 'in progress'), and whether the row is still this attempt's (a transaction
-- that committed after rolling back the savepoint the statement ran in leaves it so).
-- A plain read: it never waits for the row's lock.
SELECT pg_xact_status(%(xid)s::xid8),
       EXISTS (
           SELECT 1 FROM {schema}.jobs AS j
           WHERE j.id = %(id)s AND j.status = 'running' AND j.locked_by = %(owner)s
             AND j.attempts = %(attempt)s
       )

-- fail_jobs --
-- running -> failed (the dead-letter state) for many attempts at once, keeping each error.
-- The attempt counts as a failure. The job moves to jobs_history, as in complete_jobs.
-- A job whose abort was requested ends cancelled instead, with an `aborted` event naming
-- who asked (written whatever %(events)s says, as in abort_attempts): the request reached
-- the row before its notice reached the worker, which then took the attempt's failure
-- for an ordinary one (reschedule_job does the same for a retry).
WITH owned AS MATERIALIZED (
    {owned_attempts: error = %(errors)s::text[]}
), {move_to_history:
    using = owned, on = j.id = owned.id, returning = owned.owner, owned.error,
    status = CASE WHEN abort_requested_at IS NOT NULL THEN 'cancelled' ELSE 'failed' END,
    last_error = error, failures = failures + 1
}, event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor, data)
    SELECT id, 'failed', attempts, owner, jsonb_build_object('error', error)
    FROM done WHERE abort_requested_at IS NULL AND %(events)s
    UNION ALL
    SELECT id, 'aborted', attempts, abort_requested_by,
           jsonb_build_object('worker', owner, 'error', error)
    FROM done WHERE abort_requested_at IS NOT NULL
)
SELECT id FROM done

-- reschedule_job --
-- running -> queued to run again after %(delay_ms)s (a retry with backoff). The attempt is
-- charged as a failure. %(message)s / %(message_bytes)s replace the stored message when given (Dramatiq's
-- own Retries middleware re-enqueues the message with updated options); %(max_attempts)s,
-- when given, is the limit the sender derived for that message (it never denies the retry
-- just scheduled, see messages.max_attempts_for).
-- A job whose abort was requested is never retried: its failed attempt ends it cancelled,
-- with an `aborted` event naming who asked (the request reached the row before it reached
-- the worker), and moves to jobs_history, as in complete_jobs.
WITH requeued AS (
    UPDATE {schema}.jobs AS j
    SET status = 'queued',
        locked_by = NULL,
        locked_until = NULL,
        available_at = coalesce(%(now)s::timestamptz, now()) + %(delay_ms)s * interval '1 millisecond',
        last_error = coalesce(%(error)s, j.last_error),
        message = CASE WHEN %(replace_message)s THEN %(message)s ELSE j.message END,
        message_bytes = CASE WHEN %(replace_message)s THEN %(message_bytes)s ELSE j.message_bytes END,
        max_attempts = coalesce(%(max_attempts)s::integer, j.max_attempts),
        failures = j.failures + 1,
        started = false,
        updated_at = coalesce(%(now)s::timestamptz, now())
    WHERE j.id = %(id)s AND j.status = 'running' AND j.locked_by = %(owner)s AND j.attempts = %(attempt)s
      AND j.abort_requested_at IS NULL
    RETURNING j.id, j.attempts, j.available_at, j.queue_name, j.status, j.abort_requested_by
), {move_to_history:
    on = j.id = %(id)s AND j.status = 'running' AND j.locked_by = %(owner)s
         AND j.attempts = %(attempt)s AND j.abort_requested_at IS NOT NULL,
    status = 'cancelled',
    message = CASE WHEN %(replace_message)s THEN %(message)s ELSE message END,
    message_bytes = CASE WHEN %(replace_message)s THEN %(message_bytes)s ELSE message_bytes END,
    max_attempts = coalesce(%(max_attempts)s::integer, max_attempts),
    last_error = coalesce(%(error)s, last_error),
    failures = failures + 1,
    ended = id, attempts, available_at, queue_name, status, abort_requested_by
}, changed AS (
    SELECT * FROM requeued UNION ALL SELECT * FROM moved
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor, data)
    SELECT id, 'retry_scheduled', attempts, %(owner)s,
           jsonb_build_object('error', %(error)s::text, 'delay_ms', %(delay_ms)s::bigint,
                              'available_at', available_at)
    FROM changed WHERE status = 'queued' AND %(events)s
    UNION ALL
    SELECT id, 'aborted', attempts, abort_requested_by,
           jsonb_build_object('worker', %(owner)s::text, 'error', %(error)s::text)
    FROM changed WHERE status = 'cancelled'
)
SELECT id, pg_notify(%(channel)s, '') FROM changed

-- release_jobs --
-- running -> queued at once for claimed messages that never started (worker shutdown): the
-- attempt their claim added is given back. The caller wakes the queues' consumers.
WITH owned AS MATERIALIZED (
    {owned_attempts: where = NOT j.started}
), released AS (
    UPDATE {schema}.jobs AS j
    SET status = 'queued',
        attempts = j.attempts - 1,
        locked_by = NULL,
        locked_until = NULL,
        updated_at = coalesce(%(now)s::timestamptz, now())
    FROM owned
    WHERE j.id = owned.id AND j.lane = owned.lane
    RETURNING j.id, j.attempts, owned.owner, j.queue_name
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor)
    SELECT id, 'released', attempts, owner FROM released WHERE %(events)s
)
SELECT id, queue_name FROM released

-- renew_leases --
-- Extend the leases of attempts a worker still owns; returns the ones it still owns, each
-- with whether an operator asked for its abort (the heartbeat's way of learning it when no
-- NOTIFY reaches the worker: listen=False, a transaction-mode pooler).
-- %(record)s writes a lease_renewed event (explicit renewals by an actor; the background
-- heartbeat renews silently so that the timeline is not flooded).
WITH owned AS MATERIALIZED (
    {owned_attempts}
), renewed AS (
    UPDATE {schema}.jobs AS j
    SET locked_until = coalesce(%(now)s::timestamptz, now()) + %(lease_ms)s * interval '1 millisecond'
    FROM owned
    WHERE j.id = owned.id AND j.lane = owned.lane
    RETURNING j.id, j.attempts, j.locked_until, owned.owner,
              j.abort_requested_at IS NOT NULL AS abort_requested
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor, data)
    SELECT id, 'lease_renewed', attempts, owner, jsonb_build_object('locked_until', locked_until)
    FROM renewed WHERE %(events)s AND %(record)s
)
SELECT id, abort_requested FROM renewed

-- record_progress --
-- A running attempt reports progress: the lease is renewed and a `progress` event keeps the
-- data. Returns nothing if the caller no longer owns the attempt.
WITH owned AS (
    UPDATE {schema}.jobs AS j
    SET locked_until = coalesce(%(now)s::timestamptz, now()) + %(lease_ms)s * interval '1 millisecond',
        updated_at = coalesce(%(now)s::timestamptz, now())
    WHERE j.id = %(id)s AND j.status = 'running' AND j.locked_by = %(owner)s AND j.attempts = %(attempt)s
    RETURNING j.id, j.attempts
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor, data)
    SELECT id, 'progress', attempts, %(owner)s, %(data)s FROM owned WHERE %(events)s
)
SELECT id FROM owned

-- record_progress_event --
-- A running attempt reports progress while a complete_in() block's transaction holds its
-- job's row (see inflight_completions.py): the `progress` event alone, the row left as it
-- is. A plain read of the row, which waits for no lock: the attempt is still the caller's
-- as the row's last committed version says. Returns nothing if it is not.
WITH owned AS (
    SELECT j.id, j.attempts
    FROM {schema}.jobs AS j
    WHERE j.id = %(id)s AND j.status = 'running' AND j.locked_by = %(owner)s AND j.attempts = %(attempt)s
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor, data)
    SELECT id, 'progress', attempts, %(owner)s, %(data)s FROM owned WHERE %(events)s
)
SELECT id FROM owned

-- lease_ran_out --
-- A running row's lease ran out: its worker died, hung or lost the database. A lease that
-- ran out while the server was down could not be renewed, so it counts only once the
-- server has been up for a whole lease (%(lease_ms)s): the owners of live attempts renew
-- them, or write their outcomes, first. The reaper takes such rows back; a limited
-- queue's claim no longer counts them (limited_queue_room).
locked_until < coalesce(%(now)s::timestamptz, now())
AND pg_postmaster_start_time() + %(lease_ms)s * interval '1 millisecond'
    < coalesce(%(now)s::timestamptz, now())

-- leases_ran_out --
-- Running jobs whose lease ran out (lease_ran_out, the reaper's own test) more than
-- %(grace_s)s seconds ago, which a live worker's reaper gives back within its interval
-- (`doctor`'s expired_leases): how many, how long ago the oldest lease ended, their
-- queues, and a few ids. Reads the running-rows index (jobs_lease_expiry_idx).
SELECT count(*),
       extract(epoch FROM now() - min(locked_until))::float8,
       coalesce(array_agg(DISTINCT queue_name), ARRAY[]::text[]),
       (array_agg(id::text ORDER BY locked_until))[1:5]
FROM {schema}.jobs
WHERE status = 'running' AND {lease_ran_out}
  AND locked_until < now() - %(grace_s)s * interval '1 second'

-- reap_expired --
-- Give back running jobs whose lease expired: their worker died, hung or lost the database.
-- A claim that never started goes back at once, uncharged. A started attempt was
-- interrupted: the job is requeued after %(backoff_ms)s[interruptions] (the delays come
-- from the worker's one backoff function), or failed once interruptions reach
-- %(max_interruptions)s. Failures are not counted here: only an attempt's own outcome is one.
-- Expired is lease_ran_out: never while the server has been up for less than a lease.
-- A job whose abort was requested ends cancelled instead (its worker died before it could
-- stop the attempt), with an `aborted` event naming who asked.
-- Bounded by %(batch)s and SKIP LOCKED, so many processes can run it at once, each taking
-- different rows, and an idle run costs one index probe. The error of an expired lease
-- begins with %(lease_expired)s (jobs.py LEASE_EXPIRED), which the monitoring looks for.
-- An operator runs the same statement (requeue_expired) with %(by)s, their name, on the
-- jobs %(ids)s or of the queue %(queue_name)s (NULL: any), with a backoff of 0: the same
-- guard (only rows whose lease has expired; a live worker renews its lease first), the
-- same outcomes, and an event that is always written, naming the operator (its actor)
-- and the worker that lost the job (data.worker).
WITH expired AS MATERIALIZED (
    SELECT id, lane, locked_by, started,
           -- The attempt ends the job (cancelled or failed): it moves to jobs_history.
           abort_requested_at IS NOT NULL
               OR (started AND interruptions + 1 >= %(max_interruptions)s) AS ends
    FROM {schema}.jobs
    WHERE status = 'running' AND {lease_ran_out}
      AND (%(ids)s::uuid[] IS NULL OR id = ANY(%(ids)s::uuid[]))
      AND (%(queue_name)s::text IS NULL OR queue_name = %(queue_name)s)
    ORDER BY locked_until
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE {schema}.jobs AS j
    SET status = CASE
            WHEN j.abort_requested_at IS NOT NULL THEN 'cancelled'
            WHEN expired.started AND j.interruptions + 1 >= %(max_interruptions)s THEN 'failed'
            ELSE 'queued'
        END,
        attempts = CASE WHEN expired.started THEN j.attempts ELSE j.attempts - 1 END,
        interruptions = j.interruptions + CASE WHEN expired.started THEN 1 ELSE 0 END,
        abandoned_claims = j.abandoned_claims + CASE WHEN expired.started THEN 0 ELSE 1 END,
        started = false,
        available_at = CASE
            WHEN j.abort_requested_at IS NOT NULL THEN j.available_at
            WHEN NOT expired.started THEN coalesce(%(now)s::timestamptz, now())
            WHEN j.interruptions + 1 >= %(max_interruptions)s THEN j.available_at
            ELSE coalesce(%(now)s::timestamptz, now())
                 + (%(backoff_ms)s::bigint[])[least(j.interruptions + 1, cardinality(%(backoff_ms)s::bigint[]))]
                   * interval '1 millisecond'
        END,
        finished_at = CASE
            WHEN j.abort_requested_at IS NOT NULL
                 OR (expired.started AND j.interruptions + 1 >= %(max_interruptions)s)
            THEN coalesce(%(now)s::timestamptz, now())
        END,
        last_error = CASE
            WHEN NOT expired.started OR j.abort_requested_at IS NOT NULL THEN j.last_error
            WHEN j.interruptions + 1 >= %(max_interruptions)s
            THEN %(lease_expired)s || ' ' || expired.locked_by || ' stopped renewing attempt '
                 || j.attempts || '; interrupted ' || (j.interruptions + 1)
                 || ' times (the limit): its worker died, hung or lost its lease each time'
            ELSE %(lease_expired)s || ' ' || expired.locked_by
                 || ' stopped renewing attempt ' || j.attempts
        END,
        locked_by = NULL,
        locked_until = NULL,
        updated_at = coalesce(%(now)s::timestamptz, now())
    FROM expired
    WHERE j.id = expired.id AND j.lane = expired.lane AND NOT expired.ends
    RETURNING j.id, j.status, j.attempts, j.available_at, j.last_error, j.queue_name,
              j.actor_name, j.message, j.message_bytes, j.failures, j.interruptions,
              expired.locked_by AS previous_owner, expired.started, j.abort_requested_by
), {move_to_history:
    using = expired, on = j.id = expired.id AND expired.ends,
    returning = expired.locked_by AS previous_owner, expired.started AS was_started,
    status = CASE WHEN abort_requested_at IS NOT NULL THEN 'cancelled' ELSE 'failed' END,
    attempts = CASE WHEN was_started THEN attempts ELSE attempts - 1 END,
    last_error = CASE WHEN abort_requested_at IS NOT NULL THEN last_error
        ELSE %(lease_expired)s || ' ' || previous_owner || ' stopped renewing attempt '
             || attempts || '; interrupted ' || (interruptions + 1)
             || ' times (the limit): its worker died, hung or lost its lease each time'
    END,
    interruptions = interruptions + CASE WHEN was_started THEN 1 ELSE 0 END,
    abandoned_claims = abandoned_claims + CASE WHEN was_started THEN 0 ELSE 1 END,
    ended = id, status, attempts, available_at, last_error, queue_name, actor_name,
            message, message_bytes, failures, interruptions
}, ended_with_owner AS (
    SELECT e.*, r.previous_owner, r.was_started AS started, r.abort_requested_by
    FROM moved AS e JOIN done AS r ON r.id = e.id
), changed AS (
    SELECT * FROM requeued UNION ALL SELECT * FROM ended_with_owner
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor, data)
    SELECT id,
           CASE WHEN status = 'cancelled' THEN 'aborted'
                WHEN status = 'failed' THEN 'failed'
                WHEN started THEN 'timeout_requeued'
                ELSE 'released' END,
           attempts,
           CASE WHEN status = 'cancelled' THEN abort_requested_by
                ELSE coalesce(%(by)s::text, previous_owner) END,
           CASE WHEN status = 'cancelled'
                THEN jsonb_build_object('worker', previous_owner, 'reason', 'lease expired')
                WHEN started
                THEN jsonb_build_object('error', last_error, 'available_at', available_at,
                                        'interruptions', interruptions)
                WHEN %(by)s::text IS NOT NULL THEN jsonb_build_object()
           END
           || CASE WHEN %(by)s::text IS NOT NULL AND status <> 'cancelled'
                   THEN jsonb_build_object('worker', previous_owner, 'requeued_by', %(by)s::text)
                   ELSE jsonb_build_object() END
    FROM changed WHERE %(events)s OR status = 'cancelled' OR %(by)s::text IS NOT NULL
)
SELECT id, status, queue_name, started, actor_name, message, message_bytes, failures,
       interruptions, last_error
FROM changed

-- retry_failed --
-- failed -> queued by an operator: attempts start again from zero, runnable at once. The
-- jobs are %(ids)s or, without ids, up to %(limit)s failed jobs (of %(queue_name)s when
-- given) that failed at or before %(failed_before)s, oldest failure first, after the
-- (%(after_finished_at)s, %(after_id)s) the previous batch ended at: `jobs retry
-- --all-failed` goes through every failed job in bounded batches, one statement and one
-- commit each, reading jobs_history_finished_idx from where the last batch stopped, and never picks
-- up a job that failed anew after it began. Rows are locked in the order picked (two
-- operators never deadlock); a row another one retried meanwhile is left out. The caller
-- wakes the queues returned. An abort requested while a job last ran (it failed before its
-- worker stopped it) is forgotten: the operator wants it to run. The job moves back from
-- jobs_history to the jobs table in this statement (its partition is found from the
-- finish time picked, so only that one partition is touched per job).
-- A job whose id has another row (in jobs, or a second one in history: earlier releases
-- could leave one, see DuplicateJobId) is not moved, which would give the id a second row
-- in jobs or fail on its primary key: it is returned with skipped true (and no queue), so
-- that the batches go on past it and the operator is told.
-- A unique job takes its key back (retaken) if no other job holds it (or still holds it
-- itself: a unique_for period not run out; a key left by another job that ended, its
-- period run out, holds nothing); if another unique job with the same
-- arguments was sent since and holds it, the retried job runs without its key (the row
-- keeps none: the operator asked for this job to run again, beside the newer one).
WITH candidates AS (
    SELECT id, finished_at
    FROM {schema}.jobs_history
    WHERE status = 'failed'
      AND (%(ids)s::uuid[] IS NULL OR id = ANY(%(ids)s::uuid[]))
      AND (%(queue_name)s::text IS NULL OR queue_name = %(queue_name)s)
      AND (%(failed_before)s::timestamptz IS NULL OR finished_at <= %(failed_before)s)
      AND (%(after_finished_at)s::timestamptz IS NULL
           OR (finished_at >= %(after_finished_at)s
               AND (finished_at, id) > (%(after_finished_at)s, %(after_id)s::uuid)))
    ORDER BY finished_at, id
    LIMIT %(limit)s
    FOR UPDATE
), doubled AS (
    SELECT c.id, c.finished_at
    FROM candidates AS c
    WHERE EXISTS (SELECT 1 FROM {schema}.jobs AS j WHERE j.id = c.id)
       OR (SELECT count(*) FROM (SELECT 1 FROM {schema}.jobs_history AS o
                                 WHERE o.id = c.id LIMIT 2) AS two) > 1
), picked AS (
    SELECT id, finished_at FROM candidates
    WHERE id NOT IN (SELECT id FROM doubled)
), removed AS (
    DELETE FROM {schema}.jobs_history AS h
    USING picked
    WHERE h.id = picked.id AND h.status = 'failed' AND h.finished_at = picked.finished_at
    RETURNING h.*
), retaken AS (
    -- One job per key: a batch may retry two failed jobs of the same arguments (the
    -- earlier failure takes the key), and one statement cannot write a key row twice.
    INSERT INTO {schema}.job_keys AS k (actor_name, idempotency_scope, idempotency_key, job_id)
    SELECT DISTINCT ON (actor_name, idempotency_key)
           actor_name, idempotency_scope, idempotency_key, id
    FROM removed
    WHERE idempotency_scope = 'unique' AND idempotency_key IS NOT NULL
    ORDER BY actor_name, idempotency_key, finished_at, id
    ON CONFLICT (actor_name, idempotency_scope, idempotency_key)
        DO UPDATE SET job_id = excluded.job_id,
                      expires_at = CASE WHEN k.job_id = excluded.job_id THEN k.expires_at END
        WHERE k.job_id = excluded.job_id
           -- A key free to take again: its job ended (it is in history, and not in jobs)
           -- and its period, if any, ran out. Ended, not merely absent from jobs: a key
           -- this statement waited for belongs to a send committed after its snapshot,
           -- whose job the snapshot does not see in either table.
           OR (EXISTS (SELECT 1 FROM {schema}.jobs_history AS h WHERE h.id = k.job_id)
               AND NOT EXISTS (SELECT 1 FROM {schema}.jobs AS j WHERE j.id = k.job_id)
               AND (k.expires_at IS NULL
                    OR k.expires_at <= coalesce(%(now)s::timestamptz, now())))
    RETURNING job_id
), moved AS (
    INSERT INTO {schema}.jobs ({job_columns})
    SELECT {job_row:
        idempotency_key = CASE
            WHEN idempotency_scope <> 'unique' OR id IN (SELECT job_id FROM retaken)
            THEN idempotency_key
        END,
        status = 'queued',
        available_at = coalesce(%(now)s::timestamptz, now()),
        attempts = 0,
        locked_by = NULL,
        locked_until = NULL,
        updated_at = coalesce(%(now)s::timestamptz, now()),
        finished_at = NULL,
        started = false,
        failures = 0,
        interruptions = 0,
        abandoned_claims = 0,
        abort_requested_at = NULL,
        abort_requested_by = NULL}
    FROM removed
    RETURNING id, queue_name
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor)
    SELECT id, 'manual_retry', 0, %(by)s FROM moved
)
SELECT moved.id, moved.queue_name, picked.finished_at, false AS skipped
FROM moved JOIN picked ON picked.id = moved.id
UNION ALL
SELECT id, NULL, finished_at, true FROM doubled

-- cancel_job --
-- queued -> cancelled by an operator. A running job cannot be cancelled (its worker owns it).
-- The job moves to jobs_history, as in complete_jobs.
WITH {move_to_history: on = j.id = %(id)s AND j.status = 'queued', status = 'cancelled'},
event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor)
    SELECT id, 'cancelled', attempts, %(by)s FROM done
)
SELECT id FROM done

-- abort_job --
-- An operator aborts a job. A waiting job (queued, delayed included) is cancelled at once
-- with an `aborted` event. A running job is marked (who asked, when; the first request
-- is kept) with an `abort_requested` event: the worker that owns the attempt learns it
-- from the NOTIFY the caller sends (notify_abort), or from its next lease heartbeat, and
-- ends it cancelled (abort_attempts). Returns the job's status and queue, nothing for a
-- job that does not exist or has finished (the caller says which). A cancelled job moves
-- to jobs_history, as in complete_jobs.
-- FOR NO KEY UPDATE, not FOR UPDATE: the lock a complete_in() block's transaction holds on
-- the row while it runs (lock_for_completion, FOR KEY SHARE) does not keep the request
-- waiting. The success such a block wrote holds the row until its transaction ends; the
-- caller bounds that wait (set_lock_timeout) and says who holds the row (job_row_holder).
WITH target AS MATERIALIZED (
    SELECT id, status FROM {schema}.jobs WHERE id = %(id)s FOR NO KEY UPDATE
), {move_to_history:
    using = target, on = j.id = target.id AND target.status = 'queued',
    status = 'cancelled',
    abort_requested_at = coalesce(%(now)s::timestamptz, now()),
    abort_requested_by = %(by)s,
    ended = id, attempts, status, queue_name, NULL::text AS locked_by
}, flagged AS (
    UPDATE {schema}.jobs AS j
    SET abort_requested_at = coalesce(j.abort_requested_at, coalesce(%(now)s::timestamptz, now())),
        abort_requested_by = coalesce(j.abort_requested_by, %(by)s),
        updated_at = coalesce(%(now)s::timestamptz, now())
    FROM target
    WHERE j.id = target.id AND target.status = 'running'
    RETURNING j.id, j.attempts, j.status, j.queue_name, j.locked_by
), changed AS (
    SELECT * FROM moved UNION ALL SELECT * FROM flagged
), event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor, data)
    SELECT id, CASE WHEN status = 'cancelled' THEN 'aborted' ELSE 'abort_requested' END,
           attempts, %(by)s,
           CASE WHEN status = 'cancelled' THEN jsonb_build_object('waiting', true)
                ELSE jsonb_build_object('worker', locked_by) END
    FROM changed
)
SELECT id, status, queue_name FROM changed

-- job_row_xmax --
-- The id that locked or wrote a job's row last (its xmax, as text): a transaction's, a
-- savepoint's within one, or a MultiXact's when several did (see job_row_holder).
SELECT j.xmax::text FROM {schema}.jobs AS j WHERE j.id = %(id)s

-- multixact_members --
-- The transaction ids of the MultiXact %(xmax)s (a row locked by several transactions, or
-- locked and written in two savepoints of one). PostgreSQL refuses an id that is not one.
SELECT m.xid::text FROM pg_get_multixact_members(%(xmax)s::xid) AS m

-- job_row_holder --
-- Who holds a job's row (an abort, or an actor's renewal, that could not lock it says so):
-- its backend, state, how long its transaction has been open, and its application_name.
-- %(xids)s are the ids that hold the row (job_row_xmax, or its MultiXact's members). Each
-- is the holder of its own id's lock while its transaction (or savepoint) runs; a
-- savepoint released into its transaction no longer holds one, and is then that of the
-- transaction with the latest id up to it among those holding a lock on the jobs table
-- (a savepoint's id comes after its transaction's), unless %(exact)s. No row: none found.
WITH candidate AS (
    SELECT x::xid AS xid FROM unnest(%(xids)s::text[]) AS x
), holder AS (
    SELECT l.pid, -1 AS distance
    FROM candidate
    JOIN pg_locks AS l ON l.locktype = 'transactionid' AND l.transactionid = candidate.xid
        AND l.granted
    UNION ALL
    SELECT a.pid, age(a.backend_xid) - age(candidate.xid)
    FROM candidate, {schema}.jobs AS j
    JOIN pg_locks AS l ON l.locktype = 'relation' AND l.relation = j.tableoid AND l.granted
    JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE NOT %(exact)s AND j.id = %(id)s AND a.backend_xid IS NOT NULL
      AND age(a.backend_xid) >= age(candidate.xid)
)
SELECT a.pid, a.state, extract(epoch FROM now() - a.xact_start)::float8, a.application_name
FROM holder
JOIN pg_stat_activity AS a ON a.pid = holder.pid
WHERE a.pid <> pg_backend_pid()
ORDER BY holder.distance
LIMIT 1

-- set_lock_timeout --
-- The longest the statements of this transaction wait for a lock (milliseconds).
SELECT set_config('lock_timeout', %(ms)s::text, true)

-- notify_abort --
-- Tell the consumers of a queue (on every host) that a job's abort was requested: the
-- payload names the job; the process holding its attempt stops it. Delivered at commit.
SELECT pg_notify(%(channel)s, %(payload)s)

-- abort_attempts --
-- running -> cancelled for attempts this worker stopped because an abort was requested:
-- guarded by ownership like every exit from running, and by the request itself (the other
-- exits that end a running job cancelled, fail_jobs, reschedule_job and reap_expired, do
-- so on the request too; cancel_skipped on a middleware's word). The `aborted` event
-- names who asked (its actor) and the worker that stopped the attempt; it is written
-- whatever %(events)s says, as every operator action's event is. The attempt stays
-- counted: it ran, or was claimed to run.
-- The job moves to jobs_history, as in complete_jobs.
WITH owned AS MATERIALIZED (
    {owned_attempts: where = j.abort_requested_at IS NOT NULL}
), {move_to_history:
    using = owned, on = j.id = owned.id, returning = owned.owner, status = 'cancelled'
}, event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor, data)
    SELECT id, 'aborted', attempts, abort_requested_by, jsonb_build_object('worker', owner)
    FROM done
)
SELECT id FROM done

-- cancel_skipped --
-- running -> cancelled for attempts whose message a middleware skipped before the actor ran
-- without failing it (dramatiq-abort's cancel of a job that had not started, any
-- middleware's SkipMessage): Dramatiq acks such a message, but nothing ran, so nothing
-- succeeded. Guarded by ownership like every exit from running. The `cancelled` event says
-- who skipped it (its actor: the middleware) and why: data is %(skips)s's element, a JSON
-- object {reason, skipped_by, message, worker}. It is written whatever %(events)s says, as
-- an operator's cancel is: nothing else explains the status. The attempt stays counted (it
-- was claimed to run). The job moves to jobs_history, as in complete_jobs.
WITH owned AS MATERIALIZED (
    {owned_attempts: skip = %(skips)s::jsonb[]}
), {move_to_history:
    using = owned, on = j.id = owned.id, returning = owned.owner, owned.skip,
    status = 'cancelled'
}, event AS (
    INSERT INTO {schema}.job_events (job_id, type, attempt, actor, data)
    SELECT id, 'cancelled', attempts, skip ->> 'skipped_by',
           skip || jsonb_build_object('worker', owner)
    FROM done
)
SELECT id FROM done

-- finished_attempts --
-- Of these attempts, the ones whose job already ended with one of the given statuses at
-- that very attempt: an outcome statement that committed as the connection dropped, then
-- found nothing to change when the writer sent it again. A finished row keeps no owner,
-- so the attempt number tells it (another worker's attempt would have counted one more).
-- Read only when an outcome finds its job gone, so never on the hot path.
SELECT h.id
FROM {schema}.jobs_history AS h
JOIN unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS o (id, attempt) ON h.id = o.id
WHERE h.id = ANY(%(ids)s::uuid[]) AND h.status = ANY(%(statuses)s::text[])
  AND h.attempts = o.attempt

-- get_job --
-- One job row, unfinished or finished (the view all_jobs reads both tables).
SELECT id, queue_name, actor_name, message, message_bytes, status, priority, available_at,
       attempts, max_attempts, failures, interruptions, abandoned_claims, started, idempotency_key, locked_by, locked_until, last_error, result,
       created_at, updated_at, started_at, finished_at, abort_requested_at, abort_requested_by,
       workflow_node
FROM {schema}.all_jobs
WHERE id = %(id)s

-- find_job_ids --
-- The jobs whose id starts with a prefix (at most a limit of them, in id order). A uuid
-- sorts as its hex text, so "starts with 3dd0ad24" is the range from 3dd0ad24-0000-... to
-- 3dd0ad24-ffff-...: a range scan of the primary key, never a scan of id::text.
SELECT id, queue_name, actor_name, status, created_at
FROM {schema}.all_jobs
WHERE id BETWEEN %(low)s::uuid AND %(high)s::uuid
ORDER BY id
LIMIT %(limit)s

-- get_job_events --
-- A job's timeline, oldest first.
SELECT id, job_id, type, attempt, actor, data, created_at
FROM {schema}.job_events
WHERE job_id = %(id)s
ORDER BY id

-- count_unfinished --
-- Jobs of a queue that are still waiting (including delayed) or running.
SELECT count(*)
FROM {schema}.jobs
WHERE queue_name = %(queue_name)s AND status IN ('queued', 'running')

-- count_failed_since --
-- Jobs of a queue that failed at or after a moment (join's fail-fast check): the failed
-- partitions of history from that moment on.
SELECT count(*)
FROM {schema}.jobs_history
WHERE queue_name = %(queue_name)s AND status = 'failed' AND finished_at >= %(since)s

-- count_by_queue --
-- Per queue, its unfinished and failed jobs grouped by the facts that put a job in its
-- state (jobs/states.py): stored status, whether available_at has passed (waiting jobs),
-- whether the lease is current (running jobs), whether an operator paused the queue; with
-- each group's count, its earliest available_at (how long the oldest runnable job has
-- waited; when the next delayed one becomes runnable) and the server's clock. No state is
-- named here: queue_counts_of (states.py) names each group's. Three aggregates: the
-- waiting and running parts each read a partial index of the jobs table (claim order,
-- lease expiry), the failed part the failed partitions of jobs_history, so the succeeded
-- rows are never read; the waiting jobs, usually the most numerous, are counted from the
-- claim-order index alone (it holds queue_name and available_at). The pause is read once
-- per group. The CLI's stats and queue list, the admin API and its metrics all read this
-- one count. With %(failed)s false the failed part is not run: a history of millions of
-- failed jobs costs a count of them all, which the admin API's stats leave out.
WITH parts AS (
    SELECT queue_name, 'queued'::text AS status,
           available_at <= coalesce(%(now)s::timestamptz, now()) AS due,
           NULL::boolean AS lease_current, count(*) AS n, min(available_at) AS first_at
    FROM {schema}.jobs
    WHERE status = 'queued'
    GROUP BY queue_name, due
    UNION ALL
    SELECT queue_name, 'running', NULL,
           locked_until >= coalesce(%(now)s::timestamptz, now()) AS lease_current, count(*),
           NULL
    FROM {schema}.jobs
    WHERE status = 'running'
    GROUP BY queue_name, lease_current
    UNION ALL
    SELECT queue_name, 'failed', NULL, NULL, count(*), NULL
    FROM {schema}.jobs_history
    WHERE status = 'failed' AND %(failed)s::boolean
    GROUP BY queue_name
)
SELECT p.queue_name, p.status, p.due, coalesce(q.paused, false), p.lease_current, p.n,
       p.first_at, coalesce(%(now)s::timestamptz, now())
FROM parts AS p
LEFT JOIN {schema}.queues AS q ON q.queue_name = p.queue_name
ORDER BY p.queue_name

-- flush_queue --
-- Drop the waiting and running jobs of a queue (Dramatiq's flush), with their events,
-- idempotency keys and owner rows (the admin API's job_owners); finished history stays.
-- Returns how many jobs went.
WITH flushed AS (
    DELETE FROM {schema}.jobs
    WHERE queue_name = %(queue_name)s AND status IN ('queued', 'running')
    RETURNING id, actor_name, idempotency_scope, idempotency_key
), events AS (
    DELETE FROM {schema}.job_events AS e
    USING flushed
    WHERE e.job_id = flushed.id
), keys AS (
    DELETE FROM {schema}.job_keys AS k
    USING flushed
    WHERE k.actor_name = flushed.actor_name AND k.idempotency_scope = flushed.idempotency_scope
      AND k.idempotency_key = flushed.idempotency_key AND k.job_id = flushed.id
), owners AS (
    DELETE FROM {schema}.job_owners AS o
    USING flushed
    WHERE o.job_id = flushed.id
)
SELECT count(*) FROM flushed

-- stale_statistics --
-- The job tables whose planner statistics fell far behind what they hold: the lanes of
-- jobs (0028) and the leaf partitions of jobs_history that hold more than four times the
-- rows (and at least %(min_rows)s) their last ANALYZE or VACUUM counted. The live rows are the server's
-- running count (pg_stat_get_live_tuples, kept by every insert and delete): reading it
-- costs no scan. See statistics.py.
SELECT c.oid::regclass::text
FROM pg_class AS c
WHERE c.oid IN (
    SELECT relid FROM pg_partition_tree('{schema}.jobs'::regclass) WHERE isleaf
    UNION ALL
    SELECT relid FROM pg_partition_tree('{schema}.jobs_history'::regclass) WHERE isleaf
)
  AND pg_stat_get_live_tuples(c.oid) >= greatest(4 * c.reltuples, %(min_rows)s)
ORDER BY c.oid

-- empty_job_lane --
-- Empty the lane due in this period (migrations 0028 and 0029, jobs/lanes.py): its number,
-- what was done, the rows moved to the long lane and the seconds until the next one is
-- due. %(always)s: whether no snapshot holds the horizon or not.
SELECT lane, outcome, moved, next_due_seconds
FROM {schema}.empty_job_lane(%(max_moved)s, %(lock_wait)s::interval, %(always)s)
