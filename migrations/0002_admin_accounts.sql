-- 0002: accounts of the admin API (users, sessions, API tokens), who created which job, and
-- an index for the admin API's newest-first job list.
--
-- Applied with search_path set to the broker's schema, so the names here are unqualified.
-- Secrets never reach the database in the clear: passwords are bcrypt hashes, session ids
-- and API tokens are stored as the hex SHA-256 of the value the client holds (both are
-- 256-bit random values, so a fast hash is enough; a leaked table gives nothing to replay).

CREATE TABLE users (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    email           text        NOT NULL CHECK (email <> '' AND email = btrim(email)),
    -- bcrypt ("$2b$..."), which carries its own salt and cost.
    password_hash   text        NOT NULL CHECK (password_hash LIKE '$2%'),
    -- viewer: read; operator: read, create, retry, cancel; admin: operator and accounts;
    -- member: create jobs and see only the jobs they created.
    role            text        NOT NULL CHECK (role IN ('viewer', 'operator', 'admin', 'member')),
    -- Users are deactivated, never deleted, so that job ownership keeps its meaning.
    active          boolean     NOT NULL DEFAULT true,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- One account per address, whatever its case.
CREATE UNIQUE INDEX users_email_uq ON users (lower(email));

CREATE TABLE sessions (
    -- SHA-256 (hex) of the session id in the client's cookie.
    id_hash     text        PRIMARY KEY CHECK (length(id_hash) = 64),
    user_id     bigint      NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    expires_at  timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Ending every session of a user (deactivation, password change), and pruning expired ones.
CREATE INDEX sessions_user_id_idx ON sessions (user_id);
CREATE INDEX sessions_expires_at_idx ON sessions (expires_at);

CREATE TABLE api_tokens (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- SHA-256 (hex) of the bearer token.
    token_hash      text        NOT NULL UNIQUE CHECK (length(token_hash) = 64),
    name            text        NOT NULL CHECK (name <> ''),
    user_id         bigint      NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    created_at      timestamptz NOT NULL DEFAULT now(),
    last_used_at    timestamptz,
    revoked         boolean     NOT NULL DEFAULT false
);

CREATE INDEX api_tokens_user_id_idx ON api_tokens (user_id);

-- Who created a job through the admin API. A side table rather than a column on jobs: the
-- hot table stays as narrow as the workers need, and jobs sent by application code (most
-- of them) cost nothing here. Deleting a job (retention) deletes its owner row.
CREATE TABLE job_owners (
    job_id      uuid    PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    user_id     bigint  NOT NULL REFERENCES users (id)
);

-- A member's job list: their jobs, newest first, without touching anyone else's.
CREATE INDEX job_owners_user_id_idx ON job_owners (user_id, job_id);

-- The admin API lists jobs newest first, a page at a time. Without this index every page
-- sorts the whole table (a top-N sort over millions of finished rows); with it a page reads
-- LIMIT + OFFSET index entries. The write cost: one btree entry per row version that is
-- not a HOT update. Status changes are never HOT anyway (status is in the predicates of the
-- claim and reaper indexes), so this is one entry at enqueue and one per transition, the
-- same cost as the primary key's; lease renewals and other HOT updates add nothing.
CREATE INDEX jobs_created_at_idx ON jobs (created_at, id);

-- The dead-letter states operators watch. Partial, so a row enters it only when it fails or
-- is cancelled (rare next to succeeding): the stats count failed and cancelled jobs exactly
-- from it, and the list filtered by ?status=failed reads it newest first, without
-- scanning the succeeded rows.
CREATE INDEX jobs_dead_idx ON jobs (status, created_at, id)
    WHERE status IN ('failed', 'cancelled');
