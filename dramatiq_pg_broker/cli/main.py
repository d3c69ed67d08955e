"""``dramatiq-pg-broker`` and ``python -m dramatiq_pg_broker``: operate the database side.

Commands:
  migrate [--check] [--force]
                     apply pending migrations (safe to run twice, or from two hosts at once);
                     with --check, apply nothing: exit 1 when migrations are pending; a
                     breaking migration refuses (exit 2) while processes that cannot check
                     the schema show live work, unless --force
  status             list applied, pending and unknown (newer) migrations, and whether this
                     code fits the schema (see :mod:`.handshake`)
  embedded url|stop  the local PostgreSQL used when no DRAMATIQ_PG_URL is set
  jobs list|show|retry|cancel|abort, stats, prune, schedules
                     the operator's commands (:mod:`.cli_jobs`)
  queues list|pause|resume, workers, actors
                     operator control (:mod:`.cli_control`)
  user ..., token ...  admin API accounts (the ``admin`` extra adds them: its entry points
                     in the group ``dramatiq_pg_broker.commands``)

Every command that touches jobs or accounts passes the schema handshake first: against a
schema this code does not fit, it prints ``error: <why>`` and exits with status 2.
``migrate`` and ``status`` report on the schema instead of refusing it.

Every group of commands is added explicitly in :func:`build_parser` (the entry points'
too), so the parser is the same whether this module runs as ``dramatiq-pg-broker``,
``python -m dramatiq_pg_broker`` or ``python -m dramatiq_pg_broker.cli``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

import psycopg

from ..config import Settings
from ..errors import ConfigurationError, PgBrokerError
from ..version import __version__

#: The entry point group of the commands another part of the distribution adds (see
#: :func:`add_entry_point_commands`).
COMMANDS_GROUP = "dramatiq_pg_broker.commands"


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


def database_url(args: argparse.Namespace) -> str:
    from ..db.core import resolve_url

    return resolve_url(settings_from(args))


def _schema_state(args: argparse.Namespace):
    """This code, and what the database says about its schema (see :mod:`.handshake`)."""
    from ..db.handshake import read_state, this_code

    settings = settings_from(args)
    with psycopg.connect(database_url(args), autocommit=True) as conn:
        return this_code(), read_state(conn, settings.schema)


def _verdict(code, state) -> str:
    """One line on whether this code may use the schema."""
    from ..db.handshake import newer_message, too_old_message

    if not state.admits(code):
        return f"this code may not use the schema: {too_old_message(state, code)}"
    pending = state.pending(code)
    if pending:
        return (
            f"{code.describe()} needs the {len(pending)} pending migration(s): run "
            "`dramatiq-pg-broker migrate`"
        )
    unknown = state.unknown(code)
    if unknown:
        return f"the database is newer than this code: {newer_message(state, code, unknown)}"
    return f"{code.describe()} fits the schema"


def _kind(migration) -> str:
    if migration.compatibility is None:
        return ""
    return f" ({migration.compatibility}: {migration.reason})"


def add_migration_commands(sub: argparse._SubParsersAction) -> None:
    def run_migrate(args: argparse.Namespace) -> int:
        from ..db.migrate import migrate

        if args.check:
            return check_migrations(args)
        settings = settings_from(args)

        def report(migration, took: float | None) -> None:
            # One line per migration: its name as it starts, its time once applied.
            if took is None:
                print(f"applying {migration.version:04d}_{migration.name} ... ", end="", flush=True)
            else:
                print(f"done in {took:.1f} s", flush=True)

        applied = migrate(database_url(args), settings.schema, force=args.force, report=report)
        if not applied:
            print(f"schema {settings.schema!r} is up to date")
        code, state = _schema_state(args)
        if not state.admits(code) or state.unknown(code):
            print(_verdict(code, state))
        return 0

    def check_migrations(args: argparse.Namespace) -> int:
        """``migrate --check``: 0 when nothing is pending, 1 (listing them) when migrations
        are; an edited migration or code the schema no longer admits is an error (2)."""
        from ..db.handshake import too_old_message
        from ..db.migrate import discover, live_work, status
        from ..errors import CodeTooOld, MigrationChecksumError

        settings = settings_from(args)
        states = status(database_url(args), settings.schema)
        changed = [s for s in states if s.state == "changed"]
        if changed:
            names = ", ".join(f"{s.version:04d}_{s.name}" for s in changed)
            raise MigrationChecksumError(
                f"applied migration(s) {names} differ from this code's files: released "
                "migrations must not be edited"
            )
        code, state = _schema_state(args)
        if not state.admits(code):
            raise CodeTooOld(too_old_message(state, code))
        by_version = {m.version: m for m in discover()}
        pending = [by_version[s.version] for s in states if s.state == "pending"]
        if pending:
            print(f"{len(pending)} migration(s) pending in schema {settings.schema!r}:")
            for migration in pending:
                print(f"  {migration.filename}{_kind(migration)}")
            breaking = next((m for m in pending if m.breaking), None)
            if breaking is not None:
                with psycopg.connect(database_url(args), autocommit=True) as conn:
                    seen = live_work(conn, settings.schema)
                if seen:
                    print(
                        f"`migrate` would refuse {breaking.filename} now, seeing live work of "
                        f"processes that cannot check the schema: {seen.describe()}"
                    )
            return 1
        print(f"schema {settings.schema!r} is up to date: {_verdict(code, state)}")
        return 0

    def run_status(args: argparse.Namespace) -> int:
        from ..db.migrate import status

        settings = settings_from(args)
        states = status(database_url(args), settings.schema)
        code, state = _schema_state(args)
        kinds = {m.version: m for m in state.applied}
        print(f"schema {settings.schema!r}; this code: {code.describe()}")
        for s in states:
            when = s.applied_at.isoformat(timespec="seconds") if s.applied_at else ""
            line = f"  {s.version:04d}_{s.name:<30} {s.state:<8} {when}"
            applied = kinds.get(s.version)
            if applied is not None and applied.compatibility:
                line += f"  {applied.compatibility}"
                if not s.known and applied.code_version:
                    line += f", applied by {applied.code_version}"
            print(line.rstrip())
        pending = sum(1 for s in states if s.state == "pending")
        changed = sum(1 for s in states if s.state == "changed")
        unknown = sum(1 for s in states if s.state == "unknown")
        summary = f"{len(states) - pending - unknown} applied, {pending} pending, {changed} changed"
        if unknown:
            summary += f", {unknown} unknown to this code"
        print(summary)
        if state.raised_by is not None:
            print(
                f"minimum code level: {state.min_code_level:04d} (set by the breaking "
                f"migration {state.raised_by.label})"
            )
        else:
            print("minimum code level: none (no breaking migration applied)")
        print(_verdict(code, state))
        _print_partitions(args, settings)
        return 1 if changed else 0

    migrate_parser = sub.add_parser("migrate", help="apply pending migrations")
    migrate_parser.add_argument(
        "--check",
        action="store_true",
        help="apply nothing: exit 0 when up to date, 1 when migrations are pending (listed)",
    )
    migrate_parser.add_argument(
        "--force",
        action="store_true",
        help="apply a breaking migration even while processes that cannot check the schema "
        "show live work (leases, recent sends or claims); without it, migrate refuses",
    )
    migrate_parser.set_defaults(func=run_migrate)
    sub.add_parser(
        "status", help="list applied and pending migrations, and whether this code fits"
    ).set_defaults(func=run_status)


def _print_partitions(args: argparse.Namespace, settings: Settings) -> None:
    """``status``: how many days ahead history's partitions exist, and the rows of the
    DEFAULT partitions (which maintenance keeps empty); nothing before migration 0013."""
    from ..history.retention import partition_status

    try:
        with psycopg.connect(database_url(args), autocommit=True) as conn:
            found = partition_status(conn, settings.schema)
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction):
        return  # migrations 0012-0013 not applied yet
    if found.days_ahead < 0:
        print("history partitions: today's partitions are missing (run prune)")
    else:
        print(
            f"history partitions: {found.days_ahead} day(s) ahead "
            f"(through {found.through:%Y-%m-%d})"
        )
    rows = ", ".join(f"{name} {count}" for name, count in found.default_rows.items())
    print(f"DEFAULT partitions (kept empty by prune): {rows}")
    if found.pending:
        print(f"partitions not attached yet: {', '.join(found.pending)}")


def add_embedded_commands(sub: argparse._SubParsersAction) -> None:
    def run_embedded(args: argparse.Namespace) -> int:
        from ..db import embedded

        if args.action == "url":
            print(embedded.embedded_url())
        elif args.action == "status":
            info = embedded.status()
            state = f"running (pid {info['pid']})" if info["running"] else "not running"
            print(f"data directory  {info['data_dir']}")
            print(f"chosen by       {info['why']}")
            print(f"server          {state}")
            if info["url"]:
                print(f"url             {info['url']}")
        else:
            path = embedded.data_dir()
            print(f"stopped ({path})" if embedded.stop() else f"not running ({path})")
        return 0

    parser = sub.add_parser("embedded", help="the local PostgreSQL used without DRAMATIQ_PG_URL")
    parser.add_argument(
        "action",
        choices=["url", "status", "stop"],
        help="url: print its URL, starting it if it is not running; status: which server "
        "(its data directory, and why that one) and whether it runs; stop: stop it",
    )
    parser.set_defaults(func=run_embedded)


def add_entry_point_commands(sub: argparse._SubParsersAction) -> None:
    """The commands other parts add, each an entry point of the group
    :data:`COMMANDS_GROUP` named after its command (the admin extra's ``user`` and
    ``token``: ``user = admin_api.cli:add_user_commands [admin]``), whose function adds it
    to ``sub``. The broker never imports the admin side itself. When an extra the entry
    point needs is not installed, its command is there anyway and says how to install it.
    """
    for entry in entry_points(group=COMMANDS_GROUP):  # in the order setup.cfg lists them
        try:
            add = entry.load()
        except ModuleNotFoundError as e:
            own = entry.module.split(".")[0]
            if not entry.extras or e.name is None or e.name.startswith(f"{own}."):
                raise  # not an extra's dependency: a bug worth its traceback
            _add_missing(sub, entry)
            continue
        add(sub)


def _add_missing(sub: argparse._SubParsersAction, entry) -> None:
    extras = ",".join(entry.extras)
    install = f"pip install '{entry.dist.name if entry.dist else 'dramatiq-pg-broker'}[{extras}]'"

    def missing(args: argparse.Namespace) -> int:
        print(
            f"error: the {entry.name} commands need the {extras} extra: {install}", file=sys.stderr
        )
        return 2

    parser = sub.add_parser(entry.name, help=f"{entry.name} commands (needs the {extras} extra)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=missing)


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments print one line (no usage block) and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from .control import add_control_commands
    from .jobs import add_operator_commands

    parser = OneLineErrorParser(
        prog="dramatiq-pg-broker", description="Operate the dramatiq-pg-broker database."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--url", help="database URL (default: DRAMATIQ_PG_URL, else embedded)")
    parser.add_argument("--schema", help="schema name (default: DRAMATIQ_PG_SCHEMA or dramatiq)")
    sub = parser.add_subparsers(dest="command", required=True)
    add_migration_commands(sub)
    add_embedded_commands(sub)
    add_operator_commands(sub)
    add_control_commands(sub)
    add_entry_point_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    #: The command line as given, to repeat it in advice (see settings_from).
    args.argv = argv
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader went away (`... | head`): not an error of ours. Python's own advice:
        # point stdout at devnull so that the interpreter's final flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
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
