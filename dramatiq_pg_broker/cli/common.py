"""What every command module of the CLI shares and :mod:`.main` builds on: whether the
command line asked for JSON, how an error or a warning is printed, and the command's
settings. Kept apart from :mod:`.main` (which imports every command module) so that a
command module needs nothing of :mod:`.main`."""

from __future__ import annotations

import argparse
import contextvars
import json
import os
import sys

from ..config import Settings
from ..errors import ConfigurationError

#: Whether the command line asked for JSON: its errors are JSON too (argparse's own
#: included, which come before the arguments are parsed).
_json_errors: contextvars.ContextVar[bool] = contextvars.ContextVar("json_errors", default=False)


def fail(message: str) -> int:
    """Print an error as the command line asked (one line of text, or a JSON object with
    ``--json``) on stderr; return the exit status, 2."""
    if _json_errors.get():
        print(json.dumps({"error": message}), file=sys.stderr)
    else:
        print(f"error: {message}", file=sys.stderr)
    return 2


def warn(message: str) -> None:
    """Print a warning on stderr (a JSON object with ``--json``); the command goes on."""
    if _json_errors.get():
        print(json.dumps({"warning": message}), file=sys.stderr)
    else:
        print(f"warning: {message}", file=sys.stderr)


def settings_from(args: argparse.Namespace) -> Settings:
    """The command's settings: ``--url`` and ``--schema``, then ``DRAMATIQ_PG_*``.

    Raises:
      ConfigurationError: no URL is given inside a Django project (see
        :func:`django_project`): its jobs are in the database its settings name, which only
        ``python manage.py dramatiq_pg`` reads; the embedded server would show other jobs.
    """
    settings = Settings.load(url=args.url, schema=args.schema)
    if not settings.url:
        where = django_project()
        if where:
            command = " ".join(getattr(args, "argv", None) or [args.command])
            raise ConfigurationError(
                f"no database URL, and this is a Django project ({where}): run "
                f"`python manage.py dramatiq_pg {command}` to use the database and schema "
                "of the project's broker, or name a database with --url or DRAMATIQ_PG_URL"
            )
    return settings


def django_project(cwd: str | None = None) -> str | None:
    """Why this looks like a Django project (``DJANGO_SETTINGS_MODULE`` is set, or a
    ``manage.py`` is in the working directory), or None."""
    if os.environ.get("DJANGO_SETTINGS_MODULE"):
        return f"DJANGO_SETTINGS_MODULE={os.environ['DJANGO_SETTINGS_MODULE']}"
    if os.path.isfile(os.path.join(cwd or os.getcwd(), "manage.py")):
        return "manage.py in this directory"
    return None
