"""User and API token management, for admins."""

from __future__ import annotations

import falcon
from pydantic import Field

from ..accounts import MIN_PASSWORD_LENGTH, ROLES, AccountStore
from ..auth import ADMINS
from ..errors import bad_request
from ..pagination import link_to
from ..validation import Body, Secret, Text, choice, given, read_body, read_query

Role = choice(ROLES)


class UserRequest(Body):
    """The body of POST /api/users."""

    email: Text = Field(max_length=254, description="Email address; unique whatever its case.")
    password: Secret = Field(
        min_length=MIN_PASSWORD_LENGTH, description="8 characters to 72 bytes (in UTF-8)."
    )
    role: Role = Field(description="What the user may do.")
    active: bool = Field(True, description="A deactivated user cannot log in or use tokens.")


class UserUpdate(Body):
    """The body of PATCH /api/users/{user_id}: at least one of its fields."""

    role: Role = Field(None, description="What the user may do.")
    active: bool = Field(None, description="Deactivating ends the user's sessions.")
    password: Secret = Field(
        None,
        min_length=MIN_PASSWORD_LENGTH,
        description="A new password, 8 characters to 72 bytes (in UTF-8); ends the user's "
        "sessions.",
    )


class TokenRequest(Body):
    """The body of POST /api/users/{user_id}/tokens."""

    name: Text = Field(max_length=100, description="What the token is for.")


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
        read_query(req)
        users = [user.as_dict() for user in self.accounts.list_users()]
        resp.media = {"count": len(users), "results": users}

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_body(req, UserRequest)
        user = self.accounts.create_user(body.email, body.password, body.role, active=body.active)
        resp.status = falcon.HTTP_201
        resp.location = link_to(req, f"/api/users/{user.id}")
        resp.media = user.as_dict()


class UserDetail:
    """``GET /api/users/{id}`` and ``PATCH /api/users/{id}`` (role, active, password)."""

    permissions = {"GET": ADMINS, "PATCH": ADMINS}

    def __init__(self, accounts: AccountStore) -> None:
        self.accounts = accounts

    def on_get(self, req: falcon.Request, resp: falcon.Response, user_id: str) -> None:
        read_query(req)
        resp.media = self.accounts.get_user(id_param(user_id, "user")).as_dict()

    def on_patch(self, req: falcon.Request, resp: falcon.Response, user_id: str) -> None:
        user_id_value = id_param(user_id, "user")
        values = given(read_body(req, UserUpdate))
        if not values:
            raise bad_request(f"give at least one of {', '.join(UserUpdate.model_fields)}")
        resp.media = self.accounts.update_user(user_id_value, **values).as_dict()


class UserTokens:
    """``GET /api/users/{id}/tokens`` and ``POST /api/users/{id}/tokens`` (the token's value
    is in the response once, never again)."""

    permissions = {"GET": ADMINS, "POST": ADMINS}

    def __init__(self, accounts: AccountStore) -> None:
        self.accounts = accounts

    def on_get(self, req: falcon.Request, resp: falcon.Response, user_id: str) -> None:
        read_query(req)
        user = self.accounts.get_user(id_param(user_id, "user"))
        tokens = [token.as_dict() for token in self.accounts.list_tokens(user.id)]
        resp.media = {"count": len(tokens), "results": tokens}

    def on_post(self, req: falcon.Request, resp: falcon.Response, user_id: str) -> None:
        user_id_value = id_param(user_id, "user")
        body = read_body(req, TokenRequest)
        new = self.accounts.create_token(user_id_value, body.name)
        resp.status = falcon.HTTP_201
        resp.media = {**new.token.as_dict(), "token": new.secret}


class TokenDetail:
    """``DELETE /api/tokens/{id}``: revoke a token."""

    permissions = {"DELETE": ADMINS}

    def __init__(self, accounts: AccountStore) -> None:
        self.accounts = accounts

    def on_delete(self, req: falcon.Request, resp: falcon.Response, token_id: str) -> None:
        read_query(req)
        self.accounts.revoke_token(id_param(token_id, "token"))
        resp.status = falcon.HTTP_204
