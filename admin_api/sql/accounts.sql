-- Named statements of the admin API's accounts: users, sessions, API tokens and job owners.
-- Same layout as queries.sql: "-- name --", a description, the statement. {schema} is
-- filled in once as an identifier; every value is a bind parameter. Session ids and tokens
-- arrive here already hashed (%(id_hash)s, %(token_hash)s): the clear values never do.

-- insert_user --
-- A new account. An email already used (in any case) inserts nothing and returns no row.
INSERT INTO {schema}.users (email, password_hash, role, active)
VALUES (%(email)s, %(password_hash)s, %(role)s, %(active)s)
ON CONFLICT DO NOTHING
RETURNING id, email, role, active, created_at

-- list_users --
-- Every account, oldest first.
SELECT id, email, role, active, created_at
FROM {schema}.users
ORDER BY id

-- get_user --
-- One account by id.
SELECT id, email, role, active, created_at
FROM {schema}.users
WHERE id = %(id)s

-- get_user_by_email --
-- One account by email, with its password hash (for logging in). %(email)s arrives
-- lower-cased as stored; lower() here matches the unique index users_email_uq.
SELECT id, email, role, active, created_at, password_hash
FROM {schema}.users
WHERE lower(email) = lower(%(email)s)

-- update_user --
-- Change the role, the active flag and/or the password hash; NULL keeps the current value.
UPDATE {schema}.users
SET role = coalesce(%(role)s, role),
    active = coalesce(%(active)s, active),
    password_hash = coalesce(%(password_hash)s, password_hash)
WHERE id = %(id)s
RETURNING id, email, role, active, created_at

-- lock_active_admins --
-- The active admins, locked until the end of the transaction that changes a user, so that
-- the last one may not lock everybody out even when two admins are changed at once. In id
-- order, so that concurrent changes queue up instead of deadlocking; a row another
-- transaction changed meanwhile is checked again, so the ids are the committed admins.
SELECT id
FROM {schema}.users
WHERE role = 'admin' AND active
ORDER BY id
FOR UPDATE

-- insert_session --
-- A new session for a user, valid until %(expires_at)s.
INSERT INTO {schema}.sessions (id_hash, user_id, expires_at)
VALUES (%(id_hash)s, %(user_id)s, %(expires_at)s)

-- find_session_user --
-- The active user behind an unexpired session.
SELECT u.id, u.email, u.role, u.active, u.created_at
FROM {schema}.sessions AS s
JOIN {schema}.users AS u ON u.id = s.user_id
WHERE s.id_hash = %(id_hash)s AND s.expires_at > now() AND u.active

-- delete_session --
-- End one session (logout).
DELETE FROM {schema}.sessions WHERE id_hash = %(id_hash)s

-- delete_user_sessions --
-- End every session of a user (deactivated, or their password changed).
DELETE FROM {schema}.sessions WHERE user_id = %(user_id)s

-- delete_expired_sessions --
-- Prune sessions that can no longer be used (run at each login, bounded by the index).
DELETE FROM {schema}.sessions WHERE expires_at <= now()

-- insert_token --
-- A new API token for a user.
INSERT INTO {schema}.api_tokens (token_hash, name, user_id)
VALUES (%(token_hash)s, %(name)s, %(user_id)s)
RETURNING id, name, user_id, created_at, last_used_at, revoked

-- find_token_user --
-- The active user behind an unrevoked token, and the token's id and last use.
SELECT u.id, u.email, u.role, u.active, u.created_at, t.id, t.last_used_at
FROM {schema}.api_tokens AS t
JOIN {schema}.users AS u ON u.id = t.user_id
WHERE t.token_hash = %(token_hash)s AND NOT t.revoked AND u.active

-- touch_token --
-- Record a token's use. Written at most once a minute per token, so that a script polling
-- the API does not turn every read into a write.
UPDATE {schema}.api_tokens
SET last_used_at = now()
WHERE id = %(id)s AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')

-- list_tokens --
-- A user's tokens (never their values), oldest first.
SELECT id, name, user_id, created_at, last_used_at, revoked
FROM {schema}.api_tokens
WHERE user_id = %(user_id)s
ORDER BY id

-- revoke_token --
-- Revoke one token; returns it, or nothing when no token has this id.
UPDATE {schema}.api_tokens
SET revoked = true
WHERE id = %(id)s
RETURNING id, name, user_id, created_at, last_used_at, revoked

-- revoke_user_tokens --
-- Revoke every token of a user (deactivated, or their password changed): for good, so that
-- reactivating the user brings none back.
UPDATE {schema}.api_tokens SET revoked = true WHERE user_id = %(user_id)s AND NOT revoked

-- insert_job_owner --
-- Record the user who created a job through the admin API (in the enqueue's transaction,
-- which has just inserted it into jobs), with the job's created_at (a member's job list
-- walks job_owners_user_created_idx in the list's order).
INSERT INTO {schema}.job_owners (job_id, user_id, created_at)
SELECT j.id, %(user_id)s, j.created_at
FROM {schema}.jobs AS j
WHERE j.id = %(job_id)s
ON CONFLICT (job_id) DO NOTHING
