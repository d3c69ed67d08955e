"""What the Django integration reads from Django's databases: the broker's connection
string, whether a database alias can carry the broker, and the ``atomic()`` block a send
joins."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.db.utils import load_backend
from dramatiq.errors import BrokerConnectionError
from psycopg.conninfo import make_conninfo

from ...errors import SchemaMissing
from ...sending.blocks import Transaction

#: Keys of a database's ``OPTIONS`` that Django (or psycopg's Python API) reads itself: they
#: are not libpq parameters, so the broker's connection string leaves them out.
NOT_LIBPQ = frozenset(
    {
        "assume_role",
        "autocommit",
        "context",
        "cursor_factory",
        "isolation_level",
        "pool",
        "prepare_threshold",
        "row_factory",
        "server_side_binding",
    }
)


def database_settings(alias: str) -> dict[str, Any]:
    """``DATABASES[alias]``.

    Raises:
      ImproperlyConfigured: no such alias.
    """
    databases = settings.DATABASES
    if alias not in databases:
        raise ImproperlyConfigured(
            f"dramatiq_pg_broker: the broker's database {alias!r} is not in DATABASES "
            f"(known: {', '.join(sorted(databases)) or 'none'}); set the `database` option of "
            "DRAMATIQ_BROKER to one of them"
        )
    return databases[alias]


def conninfo(alias: str) -> str:
    """The libpq connection string of a Django database alias (see :func:`conninfo_from`),
    read from the connection's live settings, so that a test runner's switch to its test
    database is followed when the broker connects after it."""
    return conninfo_from(connections[alias].settings_dict)


def conninfo_from(settings_dict: dict[str, Any]) -> str:
    """The libpq connection string of a ``DATABASES`` entry, as Django's PostgreSQL
    backend connects: its NAME, USER, PASSWORD, HOST, PORT and the libpq parameters of its
    OPTIONS (``sslmode``, ``sslrootcert``, ``service``, ``options``, ``connect_timeout``
    ...), without the options Django reads itself (:data:`NOT_LIBPQ`)."""
    options = dict(settings_dict.get("OPTIONS") or {})
    params: dict[str, Any] = {}
    name = settings_dict.get("NAME")
    if name:
        params["dbname"] = name
    elif name is None and not options.get("service"):
        params["dbname"] = "postgres"  # what Django connects to for NAME = None
    for key, value in options.items():
        if key in NOT_LIBPQ or not isinstance(value, (str, int, float)):
            continue
        params[key] = value
    for key, field in (("user", "USER"), ("password", "PASSWORD"), ("host", "HOST")):
        if settings_dict.get(field):
            params[key] = settings_dict[field]
    if settings_dict.get("PORT"):
        params["port"] = str(settings_dict["PORT"])
    return make_conninfo("", **params)


def backend_of(alias: str) -> tuple[str, str]:
    """The vendor of the alias's Django backend (``postgresql`` for Django's PostgreSQL
    backend and the ones built on it, such as PostGIS) and the driver it goes through
    (``psycopg`` for psycopg 3, ``psycopg2``)."""
    wrapper = load_backend(database_settings(alias).get("ENGINE") or "").DatabaseWrapper
    driver = getattr(getattr(wrapper, "Database", None), "__name__", "?")
    return getattr(wrapper, "vendor", "?"), driver


def check_alias(alias: str, *, join_atomic: bool, url_given: bool) -> None:
    """Refuse, at start-up, a configuration that could only fail at the first send.

    The broker writes on Django's connection (``join_atomic``) only through Django's
    PostgreSQL backend on psycopg 3 (Django 4.2 and later, with psycopg 3 installed, which
    this package requires). Its own connections need only a PostgreSQL database.

    Raises:
      ImproperlyConfigured: the alias is unknown; or it is not PostgreSQL, and the broker
        was to connect to it (no ``url``) or to join its atomic blocks; or it goes through
        psycopg2 and ``join_atomic`` is on.
    """
    engine = database_settings(alias).get("ENGINE") or ""
    vendor, driver = backend_of(alias)
    if vendor != "postgresql":
        if join_atomic or not url_given:
            raise ImproperlyConfigured(
                f"dramatiq_pg_broker: database {alias!r} uses {engine!r}, a {vendor} "
                "backend, not PostgreSQL: name a PostgreSQL database in the `database` "
                "option of DRAMATIQ_BROKER, or give the broker a `url` of its own with "
                "`join_atomic: False`"
            )
        return
    if driver != "psycopg" and join_atomic:
        raise ImproperlyConfigured(
            f"dramatiq_pg_broker: database {alias!r} goes through {driver}, not psycopg 3 "
            "(Django's psycopg 3 backend needs Django 4.2 or later). Sends inside "
            "transaction.atomic() are written on Django's connection (the `join_atomic` "
            "option, on by default), which must be psycopg 3: upgrade Django, or set "
            "`join_atomic: False` in DRAMATIQ_BROKER's OPTIONS (sends then commit at once, "
            "through the broker's own connections)."
        )


class AtomicBlocks:
    """The :attr:`Sender.resolver <dramatiq_pg_broker.sending.Sender.resolver>` that makes
    a send join the ``transaction.atomic()`` block open on Django's connection.

    A send joins when this thread's connection for the alias is open and a transaction is
    in progress on it: inside ``atomic()`` (``ATOMIC_REQUESTS`` puts every view there), or
    after ``transaction.set_autocommit(False)``. Savepoints are Django's: a send made inside
    a nested ``atomic()`` is written inside its savepoint and goes with its rollback.

    Parameters:
      alias(str): the Django database alias.
      check(callable): ``check(transaction)`` refuses a connection that reaches another
        database than the broker's (None: the broker connects to the alias itself, so it
        cannot).
    """

    def __init__(self, alias: str, check=None) -> None:
        self.alias = alias
        self._check = check

    def __call__(self) -> Transaction | None:
        connection = connections[self.alias]
        raw = connection.connection
        if raw is None or raw.closed:
            return None
        # The attribute, not get_autocommit(), which may not be called from an event loop.
        if not (connection.in_atomic_block or not connection.autocommit):
            return None
        block = Transaction(raw, guard=lambda: self._guard(connection))
        if self._check is not None:
            self._check(block)
        return block

    @contextlib.contextmanager
    def _guard(self, connection: Any) -> Iterator[None]:
        # As for a query through Django: refused in a block already marked for rollback,
        # and a failed write marks the block, so that Django rolls it back instead of
        # committing a transaction PostgreSQL has aborted.
        connection.validate_no_broken_transaction()
        try:
            yield
        except (psycopg.Error, BrokerConnectionError, SchemaMissing):
            if connection.in_atomic_block:
                transaction.set_rollback(True, using=self.alias)
            raise
