-- Named statements of the admin API's login throttle (migration 0007). Same layout as
-- accounts.sql: "-- name --", a description, the statement; every value a bind parameter.

-- login_retry_after --
-- Seconds until every key in %(keys)s may try again (0: none is blocked).
SELECT coalesce(ceil(max(extract(epoch FROM blocked_until - now()))), 0)::integer
FROM {schema}.login_throttle
WHERE key = ANY(%(keys)s) AND blocked_until > now()

-- record_login_failure --
-- Count a failed login for one key, and block the key once it has more than %(free)s
-- failures in its window: for 1 s, then twice as long at each further failure, at most
-- %(max_block)s seconds. A window that is over (and not blocked) starts again at 1.
-- Returns the key's failures and the seconds until it may try again.
INSERT INTO {schema}.login_throttle AS t (key, failures, window_start, blocked_until)
VALUES (
    %(key)s, 1, now(),
    CASE WHEN %(free)s < 1 THEN now() + interval '1 second' END
)
ON CONFLICT (key) DO UPDATE
SET failures = CASE
        WHEN t.window_start < now() - make_interval(secs => %(window)s)
             AND (t.blocked_until IS NULL OR t.blocked_until <= now()) THEN 1
        ELSE t.failures + 1
    END,
    window_start = CASE
        WHEN t.window_start < now() - make_interval(secs => %(window)s)
             AND (t.blocked_until IS NULL OR t.blocked_until <= now()) THEN now()
        ELSE t.window_start
    END,
    blocked_until = CASE
        WHEN t.window_start < now() - make_interval(secs => %(window)s)
             AND (t.blocked_until IS NULL OR t.blocked_until <= now()) THEN NULL
        WHEN t.failures + 1 > %(free)s THEN now() + make_interval(
            secs => least(%(max_block)s::float8, power(2, least(t.failures - %(free)s, 30)))
        )
        ELSE t.blocked_until
    END
RETURNING failures, coalesce(ceil(extract(epoch FROM blocked_until - now())), 0)::integer

-- clear_login_failures --
-- Forget the failures of one key (a successful login from this client for this account).
DELETE FROM {schema}.login_throttle WHERE key = %(key)s

-- prune_login_throttle --
-- Drop windows that are over and hold no running block.
DELETE FROM {schema}.login_throttle
WHERE window_start < now() - make_interval(secs => %(window)s)
  AND (blocked_until IS NULL OR blocked_until <= now())
