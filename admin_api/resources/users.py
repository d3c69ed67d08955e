"""User and API token management, for admins."""

from __future__ import annotations

import falcon

from ..accounts import MIN_PASSWORD_LENGTH, ROLES, AccountStore
from ..auth import ADMINS
from ..errors import bad_request
from ..pagination import link_to
from ..validation import Field, Query, read_object

USER_FIELDS = {
    "email": Field(
        "string", "Email address; unique whatever its case.", required=True, max_length=254
    ),
    "password": Field(
        "string",
        "8 characters to 72 bytes (in UTF-8).",
        required=True,
        trim=False,
        min_length=MIN_PASSWORD_LENGTH,
    ),
    "role": Field("string", "What the user may do.", required=True, enum=ROLES),
    "active": Field("boolean", "A deactivated user cannot log in or use tokens.", default=True),
}

USER_UPDATE_FIELDS = {
    "role": Field("string", "What the user may do.", enum=ROLES),
    "active": Field("boolean", "Deactivating ends the user's sessions."),
    "password": Field(
        "string",
        "A new password, 8 characters to 72 bytes (in UTF-8); ends the user's sessions.",
        trim=False,
        min_length=MIN_PASSWORD_LENGTH,
    ),
}

TOKEN_FIELDS = {
    "name": Field("string", "What the token is for.", required=True, max_length=100),
}


def id_param(raw: str, what: str) -> int:
    """A user or token id from the path (a bigint, so at most 18 digits here)."""
    if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
        raise bad_request(f"{what} id must be a positive integer, not {raw[:40]!r}")
    return int(raw)


class UserList:
    """``GET /api/users`` and ``POST /api/users``."""

    permissions = {"GET": ADMINS, "POST": ADMINS}

    def __init__(self, accounts: AccountStore) -> None:
        self.accounts = accounts

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        Query(req, ())
        users = [user.as_dict() for user in self.accounts.list_users()]
        resp.media = {"count": len(users), "results": users}

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        values = read_object(req, USER_FIELDS)
        user = self.accounts.create_user(
            values["email"], values["password"], values["role"], active=values.get("active", True)
        )
        resp.status = falcon.HTTP_201
        resp.location = link_to(req, f"/api/users/{user.id}")
        resp.media = user.as_dict()


class UserDetail:
    """``GET /api/users/{id}`` and ``PATCH /api/users/{id}`` (role, active, password)."""

    permissions = {"GET": ADMINS, "PATCH": ADMINS}

    def __init__(self, accounts: AccountStore) -> None:
        self.accounts = accounts

    def on_get(self, req: falcon.Request, resp: falcon.Response, user_id: str) -> None:
        Query(req, ())
        resp.media = self.accounts.get_user(id_param(user_id, "user")).as_dict()

    def on_patch(self, req: falcon.Request, resp: falcon.Response, user_id: str) -> None:
        user_id_value = id_param(user_id, "user")
        values = read_object(req, USER_UPDATE_FIELDS)
        if not values:
            raise bad_request("give at least one of role, active, password")
        resp.media = self.accounts.update_user(user_id_value, **values).as_dict()


class UserTokens:
    """``GET /api/users/{id}/tokens`` and ``POST /api/users/{id}/tokens`` (the token's value
    is in the response once, never again)."""

    permissions = {"GET": ADMINS, "POST": ADMINS}

    def __init__(self, accounts: AccountStore) -> None:
        self.accounts = accounts

    def on_get(self, req: falcon.Request, resp: falcon.Response, user_id: str) -> None:
        Query(req, ())
        user = self.accounts.get_user(id_param(user_id, "user"))
        tokens = [token.as_dict() for token in self.accounts.list_tokens(user.id)]
        resp.media = {"count": len(tokens), "results": tokens}

    def on_post(self, req: falcon.Request, resp: falcon.Response, user_id: str) -> None:
        user_id_value = id_param(user_id, "user")
        values = read_object(req, TOKEN_FIELDS)
        new = self.accounts.create_token(user_id_value, values["name"])
        resp.status = falcon.HTTP_201
        resp.media = {**new.token.as_dict(), "token": new.secret}


class TokenDetail:
    """``DELETE /api/tokens/{id}``: revoke a token."""

    permissions = {"DELETE": ADMINS}

    def __init__(self, accounts: AccountStore) -> None:
        self.accounts = accounts

    def on_delete(self, req: falcon.Request, resp: falcon.Response, token_id: str) -> None:
        Query(req, ())
        self.accounts.revoke_token(id_param(token_id, "token"))
        resp.status = falcon.HTTP_204
