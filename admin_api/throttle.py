"""Login throttling, stored in PostgreSQL so that it holds across gunicorn workers and
hosts (table ``login_throttle``, migration 0007).

Each failed login counts against three keys; a key with more failures in its window than
its allowance is blocked for 1 s, then twice as long at each further failure, up to its
longest block. While any key of a login is blocked, the login is answered 429 with
``Retry-After`` before any password is checked, so a blocked guesser costs one indexed
read and no bcrypt work.

============================ ========= ============= ===================================
key                          allowance longest block what it stops
============================ ========= ============= ===================================
``pair:<email> <client>``    5         15 minutes    one client guessing one account
``client:<client>``          30        15 minutes    one client trying many accounts
``account:<email>``          20        1 minute      many clients guessing one account
============================ ========= ============= ===================================

The account-wide block is short on purpose: it is the one an attacker can trigger for a
real user from elsewhere, so it can keep the user out for at most a minute at a time,
while still holding a distributed guesser to about one guess a minute. A successful login
clears only its own ``pair`` key (clearing the account key would hand a distributed
guesser a new allowance each time the real user logs in). Windows last 15 minutes.
"""

from __future__ import annotations

import dataclasses

import falcon

from dramatiq_pg_broker.db import ProcessPool, Queries


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one kind of key is throttled."""

    prefix: str
    #: Failures allowed in a window before the key is blocked.
    free: int
    #: The longest block, in seconds.
    max_block: float


PAIR = Rule("pair", free=5, max_block=900)
CLIENT = Rule("client", free=30, max_block=900)
ACCOUNT = Rule("account", free=20, max_block=60)
#: Seconds a window of failures lasts.
WINDOW_SECONDS = 900


class LoginThrottle:
    """The throttle over one schema.

    Parameters:
      pool(ProcessPool): where connections come from.
      schema(str): the schema holding ``login_throttle``.
      rules(tuple[Rule, Rule, Rule]): the pair, client and account rules (tests lower them).
    """

    def __init__(
        self, pool: ProcessPool, schema: str, *, rules: tuple[Rule, Rule, Rule] | None = None
    ) -> None:
        self.pool = pool
        self.statements = Queries(schema, "throttle.sql", package="admin_api")
        self.rules = rules or (PAIR, CLIENT, ACCOUNT)

    def _keys(self, email: str, client: str) -> list[tuple[Rule, str]]:
        pair, by_client, account = self.rules
        email = email.strip().lower()[:300]
        return [
            (pair, f"{pair.prefix}:{email} {client}"),
            (by_client, f"{by_client.prefix}:{client}"),
            (account, f"{account.prefix}:{email}"),
        ]

    def retry_after(self, email: str, client: str) -> int:
        """Seconds until this login may be tried (0: now)."""
        keys = [key for _rule, key in self._keys(email, client)]
        with self.pool.connection() as conn:
            return conn.execute(self.statements["login_retry_after"], {"keys": keys}).fetchone()[0]

    def failed(self, email: str, client: str) -> int:
        """Count a failed login; returns the seconds until the next may be tried."""
        wait = 0
        with self.pool.connection() as conn, conn.transaction():
            for rule, key in self._keys(email, client):
                params = {
                    "key": key,
                    "free": rule.free,
                    "max_block": float(rule.max_block),
                    "window": float(WINDOW_SECONDS),
                }
                _failures, blocked = conn.execute(
                    self.statements["record_login_failure"], params
                ).fetchone()
                wait = max(wait, blocked)
        return wait

    def succeeded(self, email: str, client: str) -> None:
        """Clear this client's failures for this account, and prune windows that are over."""
        pair_key = self._keys(email, client)[0][1]
        with self.pool.connection() as conn:
            conn.execute(self.statements["clear_login_failures"], {"key": pair_key})
            conn.execute(self.statements["prune_login_throttle"], {"window": float(WINDOW_SECONDS)})


def client_address(req: falcon.Request, trusted_proxies: frozenset[str]) -> str:
    """The client's address: the peer's, or, when the peer is a trusted reverse proxy, the
    last address in ``X-Forwarded-For`` that is not one of the trusted proxies (the ones
    before it are whatever the client sent)."""
    address = req.remote_addr or "unknown"
    if address not in trusted_proxies:
        return address
    forwarded = [a.strip() for a in (req.get_header("X-Forwarded-For") or "").split(",")]
    for hop in reversed([a for a in forwarded if a]):
        if hop not in trusted_proxies:
            return hop[:64]
    return address
