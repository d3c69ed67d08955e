"""The broker django_dramatiq instantiates: ``DRAMATIQ_BROKER["BROKER"] =
"dramatiq_pg_broker.contrib.django.PostgresBroker"``."""

from __future__ import annotations

import dataclasses
from typing import Any

from dramatiq.middleware import Middleware

from ... import broker as base
from ...config import Settings
from .database import AtomicBlocks, check_alias, conninfo


class PostgresBroker(base.PostgresBroker):
    """:class:`dramatiq_pg_broker.PostgresBroker` for a Django project.

    django_dramatiq builds it from ``DRAMATIQ_BROKER``: ``MIDDLEWARE`` becomes
    ``middleware=`` and ``OPTIONS`` its keyword arguments, the base broker's (``schema``,
    ``listen``, ``lease_seconds``, ``poll_interval`` ...) and these:

    Parameters:
      database(str): the Django database alias the broker uses (default ``"default"``).
        Without ``url``, the broker connects to it with what ``DATABASES`` says (NAME,
        USER, PASSWORD, HOST, PORT and the libpq parameters of OPTIONS, such as
        ``sslmode``), read when it first connects; ``DRAMATIQ_PG_URL`` is not read.
      join_atomic(bool): a send made inside ``transaction.atomic()`` on that database is
        written on Django's connection, in the block's transaction (default True): it
        commits with the block, disappears with its rollback, and follows savepoints.
        Outside a transaction, sends go through the broker's own connections and commit at
        once. False: always the broker's own connections.
      url(str): a PostgreSQL URL for the broker instead of the alias (a database of its
        own, say). With ``join_atomic``, sends inside ``atomic()`` still go through
        Django's connection, which must then reach the same database: the first such send
        on a connection to another database raises ``TransactionError``.

    The schema is the base broker's setting: the ``schema`` option, else
    ``DRAMATIQ_PG_SCHEMA``, else ``dramatiq``.

    Raises:
      ImproperlyConfigured: the alias is unknown, or its backend cannot serve (not
        PostgreSQL, or psycopg2 with ``join_atomic``): said when Django starts, not at
        the first send.
    """

    def __init__(
        self,
        *,
        database: str = "default",
        join_atomic: bool = True,
        url: str | None = None,
        middleware: list[Middleware] | None = None,
        settings: Settings | None = None,
        **options: Any,
    ) -> None:
        check_alias(database, join_atomic=join_atomic, url_given=url is not None)
        fields = {field.name for field in dataclasses.fields(Settings)}
        if settings is None:
            known = {k: v for k, v in options.items() if k in fields}
            settings = Settings.load(**known)
        # The alias, not the environment's DRAMATIQ_PG_URL: the project's database is the
        # one its settings name.
        settings = dataclasses.replace(settings, url=url)
        super().__init__(middleware=middleware, settings=settings, **options)
        #: The Django database alias.
        self.database = database
        #: Whether sends inside ``transaction.atomic()`` join it.
        self.join_atomic = join_atomic
        if url is None:
            self.pool.conninfo = lambda: conninfo(database)
        if join_atomic:
            # A broker on the alias's own database needs no check; one given a URL checks
            # that Django's connection reaches it (once per connection).
            check = None if url is None else self._check_reaches_broker
            self.sender.resolver = AtomicBlocks(database, check)

    def _check_reaches_broker(self, block) -> None:
        from ...sending.blocks import identity

        self.sender.check_database(identity(block.view))
