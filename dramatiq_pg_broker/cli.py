"""``dramatiq-pg-broker`` and ``python -m dramatiq_pg_broker``: operate the database side.

Commands:
  migrate            apply pending migrations (safe to run twice, or from two hosts at once)
  status             list applied and pending migrations
  embedded url|stop  the local PostgreSQL used when no DRAMATIQ_PG_URL is set
  jobs list|show|retry|cancel|abort, stats, prune, schedules
                     the operator's commands (:mod:`.cli_jobs`)
  queues list|pause|resume, workers, actors
                     operator control (:mod:`.cli_control`)
  user ..., token ...  admin API accounts (:mod:`admin_api.cli`; needs the ``admin`` extra)

Every group of commands is added explicitly in :func:`build_parser`, so the parser is the
same whether this module runs as ``dramatiq-pg-broker``, ``python -m dramatiq_pg_broker``
or ``python -m dramatiq_pg_broker.cli``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import psycopg

from .config import Settings
from .errors import PgBrokerError

#: The modules the ``admin`` extra installs; without them the account commands say how to
#: get them instead of failing with an import error.
ADMIN_EXTRA_MODULES = frozenset({"falcon", "bcrypt", "sqlalchemy", "gunicorn"})


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings.load(url=args.url, schema=args.schema)


def database_url(args: argparse.Namespace) -> str:
    from .db import resolve_url

    return resolve_url(settings_from(args))


def add_migration_commands(sub: argparse._SubParsersAction) -> None:
    def run_migrate(args: argparse.Namespace) -> int:
        from .migrate import migrate

        settings = settings_from(args)
        applied = migrate(database_url(args), settings.schema)
        if applied:
            for migration in applied:
                print(f"applied {migration.filename}")
        else:
            print(f"schema {settings.schema!r} is up to date")
        return 0

    def run_status(args: argparse.Namespace) -> int:
        from .migrate import status

        settings = settings_from(args)
        states = status(database_url(args), settings.schema)
        print(f"schema {settings.schema!r}")
        for state in states:
            when = state.applied_at.isoformat(timespec="seconds") if state.applied_at else ""
            print(f"  {state.version:04d}_{state.name:<30} {state.state:<8} {when}")
        pending = sum(1 for s in states if s.state == "pending")
        changed = sum(1 for s in states if s.state == "changed")
        print(f"{len(states) - pending} applied, {pending} pending, {changed} changed")
        return 1 if changed else 0

    sub.add_parser("migrate", help="apply pending migrations").set_defaults(func=run_migrate)
    sub.add_parser("status", help="list applied and pending migrations").set_defaults(
        func=run_status
    )


def add_embedded_commands(sub: argparse._SubParsersAction) -> None:
    def run_embedded(args: argparse.Namespace) -> int:
        from . import embedded

        if args.action == "url":
            print(embedded.embedded_url())
        else:
            print("stopped" if embedded.stop() else "not running")
        return 0

    parser = sub.add_parser("embedded", help="the local PostgreSQL used without DRAMATIQ_PG_URL")
    parser.add_argument("action", choices=["url", "stop"])
    parser.set_defaults(func=run_embedded)


def add_admin_commands(sub: argparse._SubParsersAction) -> None:
    """The admin API's ``user`` and ``token`` commands, from :mod:`admin_api.cli`. It is
    imported only here, when the parser is built (never by the broker itself); without the
    ``admin`` extra each command answers with how to install it."""
    try:
        from admin_api.cli import add_account_commands
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] not in ADMIN_EXTRA_MODULES | {"admin_api"}:
            raise

        def missing(args: argparse.Namespace) -> int:
            print(
                f"error: the {args.command} commands manage admin API accounts and need the "
                "admin extra: pip install 'dramatiq-pg-broker[admin]'",
                file=sys.stderr,
            )
            return 2

        for name in ("user", "token"):
            parser = sub.add_parser(name, help="admin API accounts (needs the admin extra)")
            parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            parser.set_defaults(func=missing)
        return
    add_account_commands(sub)


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments print one line (no usage block) and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from .cli_control import add_control_commands
    from .cli_jobs import add_operator_commands

    parser = OneLineErrorParser(
        prog="dramatiq-pg-broker", description="Operate the dramatiq-pg-broker database."
    )
    parser.add_argument("--url", help="database URL (default: DRAMATIQ_PG_URL, else embedded)")
    parser.add_argument("--schema", help="schema name (default: DRAMATIQ_PG_SCHEMA or dramatiq)")
    sub = parser.add_subparsers(dest="command", required=True)
    add_migration_commands(sub)
    add_embedded_commands(sub)
    add_operator_commands(sub)
    add_control_commands(sub)
    add_admin_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PgBrokerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as e:
        print(f"error: cannot connect to the database: {e}".strip(), file=sys.stderr)
        return 2
    except psycopg.ProgrammingError as e:
        if "connection" not in str(e).lower():
            raise
        # libpq's message quotes part of the string, which may be the password.
        print(
            "error: the database URL is not a connection string libpq can parse: check "
            "--url or DRAMATIQ_PG_URL",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
