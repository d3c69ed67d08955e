"""Logging in and out with a session cookie, and who am I."""

from __future__ import annotations

import falcon
from pydantic import Field

from dramatiq_pg_broker.config import Settings

from .. import responses
from ..accounts import AccountStore
from ..auth import READERS, SESSION_COOKIE, clear_session_cookie, set_session_cookie
from ..errors import ApiError
from ..operations import PUBLIC, operation
from ..throttle import LoginThrottle, client_address
from ..validation import Body, Secret, Text
from .jobs import ActionRequest

#: The 403 of a public state change (see :class:`admin_api.auth.Authentication`).
CROSS_SITE = "X-Requested-With missing, or an origin not allowed."


class LoginRequest(Body):
    """The body of POST /api/auth/login."""

    email: Text = Field(max_length=254, description="The account's email address.")
    password: Secret = Field(description="The account's password.")


class Login:
    """``POST /api/auth/login``: check email and password, start a session, set its cookie
    (HttpOnly, SameSite=Lax, Secure when DRAMATIQ_PG_COOKIE_SECURE is on)."""

    route = "/api/auth/login"

    def __init__(self, accounts: AccountStore, settings: Settings, throttle: LoginThrottle) -> None:
        self.accounts = accounts
        self.settings = settings
        self.throttle = throttle
        self.trusted_proxies = frozenset(settings.trusted_proxies)

    @operation(
        roles=PUBLIC,
        summary="Log in: sets the session cookie dpb_session.",
        description="Send the header X-Requested-With (any value).",
        body=LoginRequest,
        responses={
            200: (responses.Login, "Logged in."),
            401: "Wrong email or password, or a deactivated account.",
            403: CROSS_SITE,
            429: "Too many failed logins for this account or from this address, or too many "
            "password checks at once; Retry-After gives the seconds to wait.",
        },
    )
    def on_post(self, req: falcon.Request, resp: falcon.Response, body: LoginRequest) -> None:
        email, client = body.email, client_address(req, self.trusted_proxies)
        wait = self.throttle.retry_after(email, client)
        if wait > 0:
            raise too_many_logins(wait)
        user = self.accounts.authenticate(email, body.password)
        if user is None:
            wait = self.throttle.failed(email, client)
            raise ApiError(
                401,
                "The email or the password is wrong, or the account is deactivated."
                + (f" Too many failed logins: the next may be tried in {wait} s." if wait else ""),
                headers={"Retry-After": str(wait)} if wait else None,
            )
        self.throttle.succeeded(email, client)
        previous = req.cookies.get(SESSION_COOKIE)
        if previous:
            # A new session id at every login, and the browser's previous session ends:
            # a cookie planted or left in the browser before the login never carries it.
            self.accounts.delete_session(previous)
        session_id = self.accounts.create_session(user.id, self.settings.session_hours)
        set_session_cookie(resp, session_id, self.settings)
        resp.media = {"user": user.as_dict(), "expires_in": int(self.settings.session_hours * 3600)}


def too_many_logins(wait: int) -> ApiError:
    return ApiError(
        429,
        f"Too many failed logins for this account or from this address: try again in {wait} s.",
        headers={"Retry-After": str(wait)},
    )


class Logout:
    """``POST /api/auth/logout``: end the session on the server and clear the cookie. Always
    204, so that logging out twice is harmless."""

    route = "/api/auth/logout"

    def __init__(self, accounts: AccountStore, settings: Settings) -> None:
        self.accounts = accounts
        self.settings = settings

    @operation(
        roles=PUBLIC,
        summary="Log out: ends the session on the server and clears the cookie.",
        description="Send the header X-Requested-With (any value).",
        body=ActionRequest,
        body_required=False,
        responses={204: "Logged out (also when no session was open).", 403: CROSS_SITE},
    )
    def on_post(self, req: falcon.Request, resp: falcon.Response, body) -> None:
        session_id = req.cookies.get(SESSION_COOKIE)
        if session_id:
            self.accounts.delete_session(session_id)
        clear_session_cookie(resp, self.settings)
        resp.status = falcon.HTTP_204


class Me:
    """``GET /api/auth/me``: the caller's account and how they authenticated."""

    route = "/api/auth/me"

    @operation(
        roles=READERS,
        summary="The caller's account.",
        responses={200: (responses.Caller, "The account.")},
    )
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"user": req.context.user.as_dict(), "via": req.context.via}
