-- compatibility: breaking
-- The jobs table refuses the claims and the sends of code older than this migration (0.1.0, and builds that do not ship it): they would run jobs they cannot finish (0012 moved finished jobs out of their reach) and send keyed jobs twice; this release's claims and sends are unchanged in what they store.
--
-- 0022: code too old for the schema cannot claim or send.
--
-- Since 0012 a worker of 0.1.0 claims jobs and runs them, then cannot record any outcome
-- (the jobs table refuses finished rows): each job runs again after its lease, and again.
-- A sender of 0.1.0 does not register idempotency keys (job_keys, 0012) nor look for an id
-- in history, so a key or an id whose job finished makes a second job. Both started
-- before the schema handshake existed (0.2.0), so they cannot refuse the schema
-- themselves, and the released code cannot change: the refusal comes from the table.
--
-- - A send must say the row's status. The status column's default, which every send of
--   earlier code relies on (its column list leaves it out), is now a function that
--   raises: such an INSERT or COPY fails before it writes anything, with a message that
--   says to upgrade. This release's sends name the column ('queued'): the row it stores
--   is the same, and no default is evaluated for it.
-- - A claim must say which code claims. Every release wrote the owner of a claim
--   (locked_by) as host:pid:thread:<8 hex digits>; from this one on, the owner ends with
--   the code's schema level (`:L0022`). A trigger refuses, before the claim commits, a
--   claim whose owner ends the old way: the claim statement fails whole, nothing is
--   claimed, nothing runs. It fires only for statements that set locked_by (the claim;
--   every other statement sets it to NULL or leaves it), and only calls its function for
--   an owner shaped like an old one (a LIKE on the trigger's WHEN): this release's claims
--   pay one LIKE per claimed row, and every update of the table the fetch of the row's
--   old version an AFTER trigger needs (about 2 us of server time per claimed row in a
--   loop of single-row claims; a few percent of a claim statement's, within the noise of
--   a loaded 2-core machine).
-- - The worker registry records each worker's schema level (the highest migration its
--   code ships): `migrate` compares levels, not package versions, before a breaking
--   migration (two builds of one version may ship different migrations).
--
-- A later breaking migration that must refuse the claims of code from 0022 on compares
-- the level the owner ends with: recreate the trigger with its own floor.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified;
-- applied in one transaction with 0012 on a schema that lacks both (see the upgrading
-- guide), so that no 0.1.0 process still connected claims between the two.
--
-- Locking and duration: ALTER TABLE jobs (the default) and CREATE TRIGGER take ACCESS
-- EXCLUSIVE and SHARE ROW EXCLUSIVE locks on jobs for the instant of the catalog change;
-- ALTER TABLE workers likewise on the small registry. Nothing is scanned or rewritten.

CREATE FUNCTION refuse_outdated_send() RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'feature_not_supported',
        MESSAGE = format(
            'schema %I refuses this send: it comes from dramatiq-pg-broker code older than '
            'the schema admits (migration 0022_refuse_outdated_code is breaking), which '
            'cannot honour idempotency keys or message ids of finished jobs',
            current_schema()),
        HINT = 'Upgrade dramatiq-pg-broker in the application that sends to a release that '
               'ships migration 0022 (0.2.0 or later).';
END
$$;
ALTER FUNCTION refuse_outdated_send() SET search_path FROM CURRENT;

ALTER TABLE jobs ALTER COLUMN status SET DEFAULT refuse_outdated_send();

CREATE FUNCTION refuse_outdated_claim() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.locked_by ~ ':[0-9a-f]{8}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'feature_not_supported',
            MESSAGE = format(
                'schema %I refuses the claim of worker %s: its dramatiq-pg-broker code is '
                'older than the schema admits (migration 0022_refuse_outdated_code is '
                'breaking) and could not record the outcome of the jobs it ran',
                current_schema(), split_part(NEW.locked_by, ':', 1) || ':'
                                  || split_part(NEW.locked_by, ':', 2)),
            HINT = 'Stop this worker and upgrade dramatiq-pg-broker on its host to a release '
                   'that ships migration 0022 (0.2.0 or later).';
    END IF;
    RETURN NULL;
END
$$;
ALTER FUNCTION refuse_outdated_claim() SET search_path FROM CURRENT;

CREATE TRIGGER jobs_refuse_outdated_claims
    AFTER UPDATE OF locked_by ON jobs
    FOR EACH ROW
    WHEN (NEW.locked_by LIKE '%:________')
    EXECUTE FUNCTION refuse_outdated_claim();

-- The highest migration the worker's code ships (NULL for rows of earlier builds).
ALTER TABLE workers ADD COLUMN schema_level integer;
