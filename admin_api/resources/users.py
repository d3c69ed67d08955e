"""User and API token management, for admins."""

from __future__ import annotations

from typing import Annotated

import falcon
from pydantic import ConfigDict, Field, StringConstraints

from .. import responses
from ..accounts import MIN_PASSWORD_LENGTH, ROLES, AccountStore
from ..auth import ADMINS
from ..errors import bad_request
from ..operations import operation
from ..pagination import link_to
from ..validation import Body, Secret, Text, choice, given
from .jobs import ActionRequest

Role = choice(ROLES)
#: A new password: its least length is in the document as it is in the check.
Password = Annotated[Secret, StringConstraints(min_length=MIN_PASSWORD_LENGTH)]
#: What an operation on a user answers when there is none.
NO_USER = "No such user."
#: What creating a user or changing a password answers when too many hashes run at once.
HASHING_BUSY = "Too many password hashes at once; Retry-After: 1."


class UserRequest(Body):
    """The body of POST /api/users."""

    email: Text = Field(max_length=254, description="Email address; unique whatever its case.")
    password: Password = Field(description="8 characters to 72 bytes (in UTF-8).")
    role: Role = Field(description="What the user may do.")
    active: bool = Field(True, description="A deactivated user cannot log in or use tokens.")


class UserUpdate(Body):
    """The body of PATCH /api/users/{user_id}: at least one of its fields."""

    # Said in the document too: a client reading it must not send {}.
    model_config = ConfigDict(json_schema_extra={"minProperties": 1})

    role: Role = Field(None, description="What the user may do.")
    active: bool = Field(None, description="Deactivating ends the user's sessions.")
    password: Password = Field(
        None,
        description="A new password, 8 characters to 72 bytes (in UTF-8); ends the user's "
        "sessions.",
    )


class TokenRequest(Body):
    """The body of POST /api/users/{user_id}/tokens."""

    name: Text = Field(max_length=100, description="What the token is for.")


class UserList:
    """``GET /api/users`` and ``POST /api/users``."""

    route = "/api/users"

    def __init__(self, accounts: AccountStore) -> None:
        self.accounts = accounts

    @operation(
        roles=ADMINS,
        summary="Every user.",
        responses={200: (responses.UserList, "The users.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        users = [user.as_dict() for user in self.accounts.list_users()]
        resp.media = {"count": len(users), "results": users}

    @operation(
        roles=ADMINS,
        summary="Create a user.",
        body=UserRequest,
        responses={
            201: (responses.User, "The new user."),
            409: "The email is taken.",
            429: HASHING_BUSY,
        },
    )
    def on_post(self, req: falcon.Request, resp: falcon.Response, body: UserRequest) -> None:
        user = self.accounts.create_user(body.email, body.password, body.role, active=body.active)
        resp.status = falcon.HTTP_201
        resp.location = link_to(req, f"/api/users/{user.id}")
        resp.media = user.as_dict()


class UserDetail:
    """``GET /api/users/{id}`` and ``PATCH /api/users/{id}`` (role, active, password)."""

    route = "/api/users/{user_id}"

    def __init__(self, accounts: AccountStore) -> None:
        self.accounts = accounts

    @operation(
        roles=ADMINS,
        summary="One user.",
        responses={200: (responses.User, "The user."), 404: NO_USER},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response, user_id: int) -> None:
        resp.media = self.accounts.get_user(user_id).as_dict()

    @operation(
        roles=ADMINS,
        summary="Change a user's role, active flag or password.",
        body=UserUpdate,
        responses={
            200: (responses.User, "The user."),
            404: NO_USER,
            409: "It would leave no active admin.",
            429: HASHING_BUSY,
        },
    )
    def on_patch(
        self, req: falcon.Request, resp: falcon.Response, user_id: int, body: UserUpdate
    ) -> None:
        values = given(body)
        if not values:
            raise bad_request(f"give at least one of {', '.join(UserUpdate.model_fields)}")
        resp.media = self.accounts.update_user(user_id, **values).as_dict()


class UserTokens:
    """``GET /api/users/{id}/tokens`` and ``POST /api/users/{id}/tokens`` (the token's value
    is in the response once, never again)."""

    route = "/api/users/{user_id}/tokens"

    def __init__(self, accounts: AccountStore) -> None:
        self.accounts = accounts

    @operation(
        roles=ADMINS,
        summary="A user's API tokens (never their values).",
        responses={200: (responses.TokenList, "The tokens."), 404: NO_USER},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response, user_id: int) -> None:
        user = self.accounts.get_user(user_id)
        tokens = [token.as_dict() for token in self.accounts.list_tokens(user.id)]
        resp.media = {"count": len(tokens), "results": tokens}

    @operation(
        roles=ADMINS,
        summary="Create an API token; its value is in this response only.",
        body=TokenRequest,
        responses={201: (responses.Token, "The token, with its value."), 404: NO_USER},
    )
    def on_post(
        self, req: falcon.Request, resp: falcon.Response, user_id: int, body: TokenRequest
    ) -> None:
        new = self.accounts.create_token(user_id, body.name)
        resp.status = falcon.HTTP_201
        resp.media = {**new.token.as_dict(), "token": new.secret}


class TokenDetail:
    """``DELETE /api/tokens/{id}``: revoke a token."""

    route = "/api/tokens/{token_id}"

    def __init__(self, accounts: AccountStore) -> None:
        self.accounts = accounts

    @operation(
        roles=ADMINS,
        summary="Revoke an API token.",
        body=ActionRequest,
        body_required=False,
        responses={204: "Revoked.", 404: "No such token."},
    )
    def on_delete(self, req: falcon.Request, resp: falcon.Response, token_id: int, body) -> None:
        self.accounts.revoke_token(token_id)
        resp.status = falcon.HTTP_204
