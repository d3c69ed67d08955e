"""Accounts of the admin API: users, login sessions, API tokens and job owners.

It belongs to the admin side (installed with the ``admin`` extra): the broker package
never imports it. The ``dramatiq-pg-broker user|token`` commands (:mod:`admin_api.cli`)
use it to create the first admin and the API tokens. Its tables come from migration 0002,
which ``dramatiq-pg-broker migrate`` applies in every install.

What is stored:

- users: email (unique whatever its case, kept lower-case), a bcrypt password hash, a role
  and an active flag. Users are deactivated, never deleted.
- sessions and API tokens: only the SHA-256 of the value the client holds. Both values are
  256 bits from :mod:`secrets`, so a fast hash is enough: nobody can guess a preimage, and a
  copy of the table lets nobody in.
- job owners: the user who created a job through the API, written in the same transaction
  as the job.

Roles:

======== ===========================================================================
viewer   reads jobs, events, stats and settings
operator viewer, and creates, retries and cancels jobs
admin    operator, and manages users and tokens
member   creates jobs and sees only the jobs they created
======== ===========================================================================
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import re
import secrets
import threading
import unicodedata
from collections.abc import Callable
from typing import Any, NamedTuple

import bcrypt
import psycopg

from dramatiq_pg_broker.db import ProcessPool, Queries
from dramatiq_pg_broker.errors import PgBrokerError

#: Every role, from the least to the most trusted (member stands apart: it sees only its
#: own jobs).
ROLES = ("viewer", "operator", "admin", "member")

#: bcrypt's work factor for new password hashes (2^12 rounds, about a quarter second).
DEFAULT_BCRYPT_ROUNDS = 12

#: Longest wait for a free password-hashing slot before a login is refused (429).
HASH_WAIT_SECONDS = 2.0

#: Shortest password accepted.
MIN_PASSWORD_LENGTH = 8
#: bcrypt reads at most 72 bytes; a longer password would be silently cut, so it is refused.
MAX_PASSWORD_BYTES = 72
#: Longest email address (RFC 5321's limit on a path).
MAX_EMAIL_LENGTH = 254
#: Longest token name.
MAX_TOKEN_NAME_LENGTH = 100

#: Prefix of API tokens, so that a leaked one is easy to recognise (and to scan for).
TOKEN_PREFIX = "dpb_"

_EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+$")


class AccountError(PgBrokerError):
    """An account operation cannot be done."""


class InvalidAccountData(AccountError):
    """A value given for an account (email, password, role, token name) cannot be used."""


class EmailTaken(AccountError):
    """Another user already has this email address."""


class UserNotFound(AccountError):
    """No user has this id or email."""


class TokenNotFound(AccountError):
    """No API token has this id."""


class LastAdmin(AccountError):
    """The change would leave no active admin."""


class HashingBusy(AccountError):
    """Too many password checks are running in this process; try again in a moment."""


@dataclasses.dataclass(frozen=True)
class User:
    """An account, without its password hash."""

    id: int
    email: str
    role: str
    active: bool
    created_at: dt.datetime

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Token:
    """An API token's record (its value is never stored)."""

    id: int
    name: str
    user_id: int
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    revoked: bool

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class NewToken(NamedTuple):
    """A token just created: ``secret`` is shown once and never again."""

    token: Token
    secret: str


def hash_secret(value: str) -> str:
    """The stored form of a session id or an API token: its SHA-256, in hex."""
    return hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()


def normalize_email(email: Any) -> str:
    """Return ``email`` trimmed and lower-cased.

    Raises:
      InvalidAccountData: it is not a string that looks like an email address.
    """
    if not isinstance(email, str):
        raise InvalidAccountData("email must be a string such as ops@example.com")
    email = _email_key(email)
    if len(email) > MAX_EMAIL_LENGTH or not _EMAIL_RE.match(email) or "\x00" in email:
        raise InvalidAccountData(
            f"email must be an address such as ops@example.com of at most "
            f"{MAX_EMAIL_LENGTH} characters"
        )
    # Control and format characters (bidirectional overrides such as U+202E, zero-width
    # joiners, ...) would make one address display as another in a list of users.
    hidden = [c for c in email if unicodedata.category(c) in ("Cc", "Cf", "Co", "Cs", "Cn")]
    if hidden:
        raise InvalidAccountData(
            f"email must not contain invisible or control characters (found U+{ord(hidden[0]):04X})"
        )
    return email


def _email_key(email: str) -> str:
    """An email as looked up: lower-cased here, as stored. The SQL's ``lower()`` alone
    would not match every stored address: PostgreSQL lower-cases by the database's
    collation (only ASCII under ``C``), Python by Unicode."""
    return email.strip().lower()


def check_password(password: Any) -> bytes:
    """Return the password's UTF-8 bytes.

    Raises:
      InvalidAccountData: it is not a string of 8 characters to 72 bytes without NUL.
    """
    if not isinstance(password, str):
        raise InvalidAccountData("password must be a string")
    try:
        data = password.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidAccountData("password must be valid Unicode text") from None
    if len(password) < MIN_PASSWORD_LENGTH:
        raise InvalidAccountData(f"password must have at least {MIN_PASSWORD_LENGTH} characters")
    if len(data) > MAX_PASSWORD_BYTES:
        raise InvalidAccountData(
            f"password must be at most {MAX_PASSWORD_BYTES} bytes long in UTF-8 "
            "(bcrypt ignores anything longer)"
        )
    if b"\x00" in data:
        raise InvalidAccountData("password must not contain NUL characters")
    return data


def check_role(role: Any) -> str:
    """Return ``role``.

    Raises:
      InvalidAccountData: it is not one of :data:`ROLES`.
    """
    if role not in ROLES:
        raise InvalidAccountData(f"role must be one of {', '.join(ROLES)}")
    return role


def check_token_name(name: Any) -> str:
    """Return ``name`` trimmed.

    Raises:
      InvalidAccountData: it is not a non-blank string of at most 100 characters.
    """
    if not isinstance(name, str) or not name.strip() or "\x00" in name:
        raise InvalidAccountData("token name must be a non-blank string")
    name = name.strip()
    if len(name) > MAX_TOKEN_NAME_LENGTH:
        raise InvalidAccountData(
            f"token name must be at most {MAX_TOKEN_NAME_LENGTH} characters long"
        )
    return name


class AccountStore:
    """Users, sessions, API tokens and job owners over one schema.

    Parameters:
      pool(ProcessPool): where connections come from.
      schema(str): the schema holding the tables (migration 0002).
      bcrypt_rounds(int): the work factor of new password hashes. Tests lower it; a
        password's own hash keeps the factor it was made with.
      hash_concurrency(int): the most bcrypt computations this store runs at once (None:
        no bound). A flood of logins then queues for :data:`HASH_WAIT_SECONDS` at most and
        is refused (:class:`HashingBusy`) instead of taking every core from the requests
        that are not logins.
    """

    def __init__(
        self,
        pool: ProcessPool,
        schema: str,
        *,
        bcrypt_rounds: int = DEFAULT_BCRYPT_ROUNDS,
        hash_concurrency: int | None = None,
    ) -> None:
        self.pool = pool
        self.schema = schema
        self.bcrypt_rounds = bcrypt_rounds
        #: The slots of the bound on concurrent bcrypt computations (None: no bound). A
        #: test holds one with ``acquire()`` to see what a login does when all are busy.
        self.hash_slots = threading.BoundedSemaphore(hash_concurrency) if hash_concurrency else None
        self.statements = Queries(schema, "accounts.sql", package="admin_api")
        self._dummy_hash: bytes | None = None

    def _rows(self, name: str, params: dict[str, Any], conn=None) -> list[tuple]:
        with self.pool.use(conn) as c:
            cur = c.execute(self.statements[name], params)
            return cur.fetchall() if cur.description is not None else []

    def _bcrypt(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one bcrypt computation, within the bound on how many run at once."""
        slots = self.hash_slots
        if slots is None:
            return fn(*args)
        if not slots.acquire(timeout=HASH_WAIT_SECONDS):
            raise HashingBusy("too many password checks are running; try again in a second")
        try:
            return fn(*args)
        finally:
            slots.release()

    def _hash_password(self, password: Any) -> str:
        data = check_password(password)
        salt = bcrypt.gensalt(self.bcrypt_rounds)
        return self._bcrypt(bcrypt.hashpw, data, salt).decode("ascii")

    # -- users ---------------------------------------------------------------------------

    def create_user(self, email: Any, password: Any, role: Any, *, active: bool = True) -> User:
        """Create an account.

        Raises:
          InvalidAccountData: the email, password or role cannot be used.
          EmailTaken: another user has this email.
        """
        email = normalize_email(email)
        role = check_role(role)
        password_hash = self._hash_password(password)
        rows = self._rows(
            "insert_user",
            {"email": email, "password_hash": password_hash, "role": role, "active": active},
        )
        if not rows:
            raise EmailTaken(f"a user with email {email} already exists")
        return User(*rows[0])

    def list_users(self) -> list[User]:
        """Every user, oldest first."""
        return [User(*row) for row in self._rows("list_users", {})]

    def get_user(self, user_id: int) -> User:
        """One user.

        Raises:
          UserNotFound: no user has this id.
        """
        rows = self._rows("get_user", {"id": user_id})
        if not rows:
            raise UserNotFound(f"no user with id {user_id}")
        return User(*rows[0])

    def find_user(self, email: str) -> User | None:
        """The user with this email (whatever its case), or None."""
        rows = self._rows("get_user_by_email", {"email": _email_key(email)})
        return User(*rows[0][:5]) if rows else None

    def update_user(
        self,
        user_id: int,
        *,
        role: str | None = None,
        active: bool | None = None,
        password: str | None = None,
    ) -> User:
        """Change a user's role, active flag or password; None keeps the current value.

        Deactivating a user or changing their password ends their sessions and revokes
        their API tokens for good.

        Raises:
          InvalidAccountData: the role or password cannot be used.
          UserNotFound: no user has this id.
          LastAdmin: the change would leave no active admin.
        """
        if role is not None:
            check_role(role)
        password_hash = self._hash_password(password) if password is not None else None
        with self.pool.use(None) as conn, conn.transaction():
            # Locked before anything is read: two admins demoting each other at the same
            # time must not both see the other one still active.
            admins = {row[0] for row in self._rows("lock_active_admins", {}, conn)}
            current = self._rows("get_user", {"id": user_id}, conn)
            if not current:
                raise UserNotFound(f"no user with id {user_id}")
            before = User(*current[0])
            demoted = role is not None and role != "admin"
            if admins == {user_id} and (demoted or active is False):
                raise LastAdmin(
                    f"{before.email} is the last active admin: make another user admin first"
                )
            row = self._rows(
                "update_user",
                {"id": user_id, "role": role, "active": active, "password_hash": password_hash},
                conn,
            )[0]
            if active is False or password is not None:
                # Whoever held the old password (or the account) keeps nothing: no session
                # and no token outlives the change, and reactivating the user later brings
                # none of them back.
                self._rows("delete_user_sessions", {"user_id": user_id}, conn)
                self._rows("revoke_user_tokens", {"user_id": user_id}, conn)
        return User(*row)

    def authenticate(self, email: Any, password: Any) -> User | None:
        """The active user with this email and password, or None.

        An unknown email costs the same bcrypt check as a wrong password, so response times
        do not tell which emails exist.
        """
        if not isinstance(email, str) or not isinstance(password, str):
            return None
        try:
            rows = self._rows("get_user_by_email", {"email": _email_key(email)})
        except (ValueError, UnicodeEncodeError):  # NUL or lone surrogates: nobody's email
            rows = []
        candidate = password.encode("utf-8", "replace")
        # Exactly one full bcrypt check whatever the input: a password longer than bcrypt
        # reads (never a valid one: none is stored) is checked cut, then refused, so that
        # it cannot tell a known email (instant refusal) from an unknown one (a check).
        stored = rows[0][-1].encode("ascii") if rows else self._dummy()
        try:
            ok = self._bcrypt(bcrypt.checkpw, candidate[:MAX_PASSWORD_BYTES], stored)
        except ValueError:  # a stored hash bcrypt cannot read
            ok = False
        if not rows or not ok or len(candidate) > MAX_PASSWORD_BYTES:
            return None
        user = User(*rows[0][:-1])
        return user if user.active else None

    def _dummy(self) -> bytes:
        if self._dummy_hash is None:
            self._dummy_hash = bcrypt.hashpw(b"not a password", bcrypt.gensalt(self.bcrypt_rounds))
        return self._dummy_hash

    # -- sessions ------------------------------------------------------------------------

    def create_session(self, user_id: int, hours: float) -> str:
        """Start a session lasting ``hours``; returns the session id for the cookie (only
        its hash is stored). Expired sessions are pruned on the way."""
        session_id = secrets.token_urlsafe(32)
        expires_at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=hours)
        with self.pool.use(None) as conn:
            conn.execute(self.statements["delete_expired_sessions"])
            conn.execute(
                self.statements["insert_session"],
                {"id_hash": hash_secret(session_id), "user_id": user_id, "expires_at": expires_at},
            )
        return session_id

    def session_user(self, session_id: str) -> User | None:
        """The active user of an unexpired session, or None."""
        rows = self._rows("find_session_user", {"id_hash": hash_secret(session_id)})
        return User(*rows[0]) if rows else None

    def delete_session(self, session_id: str) -> None:
        """End a session (logging out); an unknown id is ignored."""
        self._rows("delete_session", {"id_hash": hash_secret(session_id)})

    # -- API tokens ----------------------------------------------------------------------

    def create_token(self, user_id: int, name: Any) -> NewToken:
        """Create an API token for a user; its value is returned once, only its hash is
        stored.

        Raises:
          InvalidAccountData: the name is blank or too long.
          UserNotFound: no user has this id.
        """
        name = check_token_name(name)
        self.get_user(user_id)
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        row = self._rows(
            "insert_token", {"token_hash": hash_secret(secret), "name": name, "user_id": user_id}
        )[0]
        return NewToken(Token(*row), secret)

    def token_user(self, secret: str) -> User | None:
        """The active user of an unrevoked token, or None; records the token's use."""
        rows = self._rows("find_token_user", {"token_hash": hash_secret(secret)})
        if not rows:
            return None
        *fields, token_id, _last_used = rows[0]
        self._rows("touch_token", {"id": token_id})
        return User(*fields)

    def list_tokens(self, user_id: int) -> list[Token]:
        """A user's tokens, oldest first (their values are never stored)."""
        return [Token(*row) for row in self._rows("list_tokens", {"user_id": user_id})]

    def revoke_token(self, token_id: int) -> Token:
        """Revoke a token for good.

        Raises:
          TokenNotFound: no token has this id.
        """
        rows = self._rows("revoke_token", {"id": token_id})
        if not rows:
            raise TokenNotFound(f"no API token with id {token_id}")
        return Token(*rows[0])

    # -- job owners ----------------------------------------------------------------------

    def record_owner(self, job_id: str, user_id: int, *, conn: psycopg.Connection) -> None:
        """Record who created a job, on the connection (and in the transaction) that
        enqueued it."""
        self._rows("insert_job_owner", {"job_id": job_id, "user_id": user_id}, conn)
