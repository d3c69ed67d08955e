"""Who is calling, and may they?

Credentials, checked in this order:

1. ``Authorization: Bearer <token>``: an API token made with ``dramatiq-pg-broker token
   create`` or ``POST /api/users/{id}/tokens``. For scripts.
2. The session cookie set by ``POST /api/auth/login`` (HttpOnly, SameSite=Lax, Secure
   when ``DRAMATIQ_PG_COOKIE_SECURE`` is on). For browsers.

Each responder's operation names the roles that may call it (:mod:`admin_api.operations`);
a public one needs no credentials (health, login, logout, the docs page, the dashboard's
pages). No credentials (or bad ones) is a 401; a role that may not is a 403; a method the
resource has no responder for is a 405, whoever asks.

Cross-site requests: a browser sends the session cookie with any request to the API,
including one a hostile page triggers. So a state-changing request (POST, PATCH, PUT,
DELETE) that is not authenticated by a bearer token must

- carry the header ``X-Requested-With`` (any value). A cross-site page can only send a
  custom header through CORS, whose preflight the API answers only for the origins in
  ``DRAMATIQ_PG_CORS_ORIGINS``; a plain HTML form cannot send one at all;
- and, when the browser says where it comes from (``Origin``), come from the API's own
  origin or one of those origins. Origins are compared whole: scheme, host and port
  (``http://api.example`` is not ``https://api.example``, nor ``https://api.example:8443``).
  The API's own origin is that of ``DRAMATIQ_PG_PUBLIC_URL`` when it is set, else the
  scheme, host and port the request was addressed to.

Bearer requests need neither: a browser never adds a bearer token on its own.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import falcon

from dramatiq_pg_broker.config import Settings

from .accounts import AccountStore, User
from .errors import ApiError
from .operations import PUBLIC, Operation

logger = logging.getLogger(__name__)

#: The session cookie's name.
SESSION_COOKIE = "dpb_session"
#: The header a cookie-authenticated state change must carry.
CSRF_HEADER = "X-Requested-With"

#: Who may read jobs, events and settings (members only their own jobs).
READERS = frozenset({"viewer", "operator", "admin", "member"})
#: Who may see everything (stats, every job).
OBSERVERS = frozenset({"viewer", "operator", "admin"})
#: Who may create jobs.
CREATORS = frozenset({"operator", "admin", "member"})
#: Who may retry and cancel jobs.
OPERATORS = frozenset({"operator", "admin"})
#: Who may manage users and tokens.
ADMINS = frozenset({"admin"})

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {"http": 80, "https": 443}

#: An origin: scheme, host (lower case) and port.
Origin = tuple[str, str, int]


def parse_origin(text: str, *, base_url: bool = False) -> Origin | None:
    """The origin of ``text``, an ``Origin`` header (or, with ``base_url``, a base URL
    whose path is ignored), or None when it has none (``null``, another scheme, a path,
    credentials ...)."""
    try:
        parts = urlsplit(text.strip())
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.username is not None:
            return None
        if (parts.path not in ("", "/") and not base_url) or parts.query or parts.fragment:
            return None
        return scheme, parts.hostname.lower(), parts.port or _DEFAULT_PORTS[scheme]
    except ValueError:  # a port that is not a number, or out of range
        return None


_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="dramatiq-pg-broker"'}


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, headers=_CHALLENGE)


def owner_scope(user: User) -> int | None:
    """The owner id a user's job reads are limited to: their own for members, else None."""
    return user.id if user.role == "member" else None


class Authentication:
    """Falcon middleware: identifies the caller, lets the roles of the responder's operation
    call it, and enforces the cross-site rules above. Sets ``req.context.user`` (a
    :class:`User` or None) and ``req.context.via`` (``"token"``, ``"session"`` or None).

    Parameters:
      accounts(AccountStore): users, sessions and tokens.
      settings(Settings): for the allowed origins.
    """

    def __init__(self, accounts: AccountStore, settings: Settings) -> None:
        self.accounts = accounts
        self.allowed_origins = frozenset(
            origin for origin in map(parse_origin, settings.cors_origins) if origin is not None
        )
        self.public_origin = (
            parse_origin(settings.public_url, base_url=True) if settings.public_url else None
        )

    def process_resource(self, req: falcon.Request, resp, resource, params) -> None:
        req.context.user = None
        req.context.via = None
        if resource is None or req.method == "OPTIONS":
            return  # an unknown route (404), or a CORS preflight
        # HEAD is GET without the body (the router's with_head): the same roles may.
        method = "get" if req.method == "HEAD" else req.method.lower()
        responder = getattr(resource, f"on_{method}", None)
        if responder is None:
            return  # Falcon answers 405
        declared: Operation | None = getattr(responder, "operation", None)
        # A responder without a declaration is refused to everyone (the router refuses to
        # add one: see admin_api.app.build).
        allowed = frozenset() if declared is None else declared.roles
        if allowed is PUBLIC:
            # Login and logout are browser requests too; a cross-site page cannot send an
            # Authorization header without a CORS preflight.
            if req.get_header("Authorization") is None:
                self._check_cross_site(req)
            return
        bearer = self._bearer(req)
        user = self._identify(req, bearer)
        req.context.user = user
        if req.context.via == "session":
            self._check_cross_site(req)
        if user.role not in allowed:
            raise ApiError(
                403,
                f"Your role ({user.role}) may not {req.method} {req.path}; it needs one of "
                f"{', '.join(sorted(allowed)) or 'no role'}.",
            )

    @staticmethod
    def _bearer(req: falcon.Request) -> str | None:
        header = req.get_header("Authorization")
        if header is None:
            return None
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized(
                "The Authorization header must be 'Bearer <token>' with an API token."
            )
        return token.strip()

    def _identify(self, req: falcon.Request, bearer: str | None) -> User:
        if bearer is not None:
            user = self.accounts.token_user(bearer)
            if user is None:
                raise unauthorized(
                    "The API token is not valid: it is unknown, revoked, or its user is "
                    "deactivated."
                )
            req.context.via = "token"
            return user
        session_id = req.cookies.get(SESSION_COOKIE)
        if session_id:
            user = self.accounts.session_user(session_id)
            if user is None:
                raise unauthorized("Your session has expired or ended: log in again.")
            req.context.via = "session"
            return user
        raise unauthorized(
            "Credentials are required: log in with POST /api/auth/login or send "
            "'Authorization: Bearer <token>'."
        )

    def _check_cross_site(self, req: falcon.Request) -> None:
        if req.method in _SAFE_METHODS:
            return
        origin = req.get_header("Origin")
        if origin is not None and not self._origin_allowed(req, origin):
            raise ApiError(
                403,
                f"Requests from origin {origin!r} are not allowed: add it to "
                "DRAMATIQ_PG_CORS_ORIGINS to call the API from that site.",
            )
        if not req.get_header(CSRF_HEADER):
            raise ApiError(
                403,
                f"A {req.method} without a bearer token must send the header {CSRF_HEADER} "
                "(any value), which protects browser sessions from cross-site requests.",
            )

    def _origin_allowed(self, req: falcon.Request, origin: str) -> bool:
        parsed = parse_origin(origin)
        if parsed is None:
            return False
        if parsed in self.allowed_origins:
            return True
        if self.public_origin is not None:
            return parsed == self.public_origin
        scheme = req.scheme.lower()
        own = (scheme, req.host.lower(), req.port or _DEFAULT_PORTS.get(scheme, 0))
        return parsed == own


class SecurityHeaders:
    """Falcon middleware: headers every response carries.

    - ``Cache-Control: no-store``: responses hold job data, session cookies and, once, new
      API tokens; no browser or proxy cache may keep them.
    - ``X-Content-Type-Options: nosniff``: a browser never reads a JSON body as HTML.
    - ``Vary: Origin`` when cross-site origins are configured: the CORS headers depend on
      the request's ``Origin``, so a shared cache must not serve one origin's answer to
      another.
    """

    def __init__(self, settings: Settings) -> None:
        self.vary_origin = bool(settings.cors_origins)
        self.public_base = (settings.public_url or "").rstrip("/")

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        # Where links point (see admin_api.pagination.link_to).
        req.context.public_base = self.public_base

    def process_response(self, req, resp: falcon.Response, resource, req_succeeded) -> None:
        resp.set_header("Cache-Control", "no-store")
        resp.set_header("X-Content-Type-Options", "nosniff")
        if self.vary_origin:
            vary = [v.strip() for v in (resp.get_header("Vary") or "").split(",") if v.strip()]
            if "origin" not in {v.lower() for v in vary}:
                resp.set_header("Vary", ", ".join([*vary, "Origin"]))


def set_session_cookie(resp: falcon.Response, session_id: str, settings: Settings) -> None:
    resp.set_cookie(
        SESSION_COOKIE,
        session_id,
        max_age=int(settings.session_hours * 3600),
        path="/api",
        secure=settings.cookie_secure,
        http_only=True,
        same_site="Lax",
    )


def clear_session_cookie(resp: falcon.Response, settings: Settings) -> None:
    resp.unset_cookie(SESSION_COOKIE, path="/api", same_site="Lax")
