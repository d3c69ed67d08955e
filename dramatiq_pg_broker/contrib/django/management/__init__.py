"""The management commands' common ground: the broker's database, as django_dramatiq built
the broker."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def run_cli(arguments: Sequence[str]) -> None:
    """Run ``dramatiq-pg-broker <arguments>`` against the database and schema of the broker
    django_dramatiq built from ``DRAMATIQ_BROKER`` (so the command and the broker never
    disagree on where the jobs are).

    Raises:
      CommandError: the configured broker is not this package's.
      SystemExit: the command failed (its status; it said why on stderr).
    """
    import dramatiq.broker
    from django.core.management.base import CommandError

    from ....broker import PostgresBroker
    from ....cli.main import main

    broker = dramatiq.broker.global_broker
    if not isinstance(broker, PostgresBroker):
        raise CommandError(
            "DRAMATIQ_BROKER does not name dramatiq_pg_broker.contrib.django.PostgresBroker "
            f"(the broker is {type(broker).__name__ if broker else 'not set'}); is "
            "django_dramatiq in INSTALLED_APPS?"
        )
    status = main(["--url", broker.pool.url, "--schema", broker.settings.schema, *arguments])
    if status:
        sys.exit(status)
