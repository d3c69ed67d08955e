"""Database URLs: checked before they are used, and shown without their secrets."""

from __future__ import annotations

import re

from .errors import InvalidDatabaseURL

#: Connection parameters that are secrets (libpq's names): masked wherever a connection
#: string is shown.
SECRET_PARAMETERS = ("password", "sslpassword")
#: What a connection string libpq cannot parse is shown as (its text may hold a password).
UNPARSEABLE = "(a connection string libpq cannot parse)"


def mask_url(url: str | None) -> str | None:
    """Return a connection string that is safe to show: ``url`` parsed by libpq's own
    parser (``psycopg.conninfo``), so every form libpq accepts is understood (a URL with or
    without a user name, query parameters, ``key=value`` pairs, quoted values, passwords
    holding ``@`` or ``/``), with each secret parameter replaced by ``***``.

    The result is in ``key=value`` form, whatever form ``url`` had. A string libpq cannot
    parse is replaced whole by :data:`UNPARSEABLE`: libpq's own error message would quote
    part of it.
    """
    if not url:
        return url
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        params = conninfo_to_dict(url)
    except Exception:  # psycopg.ProgrammingError, or a string with a NUL byte
        return UNPARSEABLE
    for name in SECRET_PARAMETERS:
        if params.get(name) is not None:
            params[name] = "***"
    return make_conninfo("", **params)


#: SQLAlchemy's PostgreSQL drivers: ``postgresql+<driver>://`` is the URL an application
#: using SQLAlchemy already has; libpq reads only ``postgresql://`` and ``postgres://``.
SQLALCHEMY_DRIVERS = frozenset(
    {"psycopg", "psycopg2", "psycopg2cffi", "psycopg_async", "asyncpg", "pg8000"}
)
_URI_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_PASSWORD_PARAM_RE = re.compile(r"\b(?:ssl)?password\s*=\s*('(?:[^'\\]|\\.)*'|[^&\s]*)")


def _secrets(url: str) -> list[str]:
    """Every part of ``url`` that may be a password, longest first (what a message that
    quotes the URL must not show)."""
    found = [value.strip("'") for value in _PASSWORD_PARAM_RE.findall(url)]
    match = _URI_RE.match(url)
    if match:
        rest = url[match.end() :]
        authority = re.split(r"[/?]", rest, maxsplit=1)[0]
        for userinfo in (authority.rpartition("@")[0], rest.partition("@")[0]):
            if "@" in rest and ":" in userinfo:
                found.append(userinfo.split(":", 1)[1])
    return sorted({secret for secret in found if secret}, key=len, reverse=True)


def _without_secrets(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def check_url(url: str) -> str:
    """Return ``url`` in a spelling libpq reads, or refuse it with the reason.

    Accepted: libpq's URLs (``postgresql://``, ``postgres://``), SQLAlchemy's spellings of
    them (``postgresql+psycopg://``, ``postgresql+psycopg2://``, ``postgres+asyncpg://``,
    ... : rewritten to ``postgresql://``) and libpq's ``key=value`` connection strings.
    The URL is parsed by libpq's own parser (``psycopg.conninfo``), so what passes here is
    what a connection will read; a host that does not answer is an outage, not this error.

    Raises:
      InvalidDatabaseURL: another scheme (``mysql://``, ``sqlite://``), a string libpq
        cannot parse, an unknown query parameter, a port that is not a number. The message
        names the problem and shows the URL with its password masked.
    """
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    secrets = _secrets(url)
    shown = _without_secrets(url, secrets)

    def refuse(problem: str) -> InvalidDatabaseURL:
        return InvalidDatabaseURL(
            f"database URL {shown!r} cannot be used: {_without_secrets(problem, secrets)}"
        )

    match = _URI_RE.match(url)
    if match:
        scheme = match.group(1)
        base, _, driver = scheme.lower().partition("+")
        if base not in ("postgresql", "postgres") or (driver and driver not in SQLALCHEMY_DRIVERS):
            raise refuse(
                f"{scheme}:// is not a PostgreSQL URL; write postgresql://user:password@host"
                "/dbname (SQLAlchemy's postgresql+psycopg:// is accepted too)"
            )
        url = "postgresql://" + url[match.end() :]
    try:
        params = conninfo_to_dict(url)
    except ProgrammingError as e:
        raise refuse(str(e).strip()) from None
    except Exception:  # a NUL byte: libpq's message would not help
        raise refuse("it is not a connection string libpq can parse") from None
    for port in str(params.get("port") or "").split(","):
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise refuse(f"port {port!r} is not a number between 1 and 65535")
    return url
