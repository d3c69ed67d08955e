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
  workflows list|show|abort|retry
                     workflows and their steps (:mod:`.workflows`)
  doctor [--json]    the live database's health as the broker sees it, each finding with
                     what to do; exit 0 healthy, 1 warnings, 2 problems
  user ..., token ...  admin API accounts (the ``admin`` extra adds them: its entry points
                     in the group ``dramatiq_pg_broker.commands``)

Every command that touches jobs or accounts passes the schema handshake first: against a
schema this code does not fit, it prints ``error: <why>`` and exits with status 2.
``migrate`` and ``status`` report on the schema instead of refusing it.

Every command that needs the database reaches it first, once, waiting at most
:data:`CONNECT_SECONDS`: a database that does not exist, a server that refuses or does not
answer, a role or password it refuses, each prints one line (``error: cannot connect to
the database: <why>``) and exits with status 2, within those seconds. With ``--json``, an
error is one JSON object on stderr (``{"error": "..."}``). ``--url`` and ``--schema`` may
be given before the command or after it; ``--json`` is accepted by every command.

Every group of commands is added explicitly in :func:`build_parser` (the entry points'
too), so the parser is the same whether this module runs as ``dramatiq-pg-broker``,
``python -m dramatiq_pg_broker`` or ``python -m dramatiq_pg_broker.cli``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

import psycopg

from ..config import Settings
from ..db.core import BrokerConnectionError
from ..errors import PgBrokerError
from ..version import __version__
from .common import _json_errors, django_project, fail, settings_from, warn  # noqa: F401

#: The entry point group of the commands another part of the distribution adds (see
#: :func:`add_entry_point_commands`).
COMMANDS_GROUP = "dramatiq_pg_broker.commands"

#: The longest a command waits to reach the database (libpq's ``connect_timeout``): past
#: it, the command says why and exits 2, instead of retrying as a worker does.
CONNECT_SECONDS = 5

#: The options every command accepts where it is named, as well as before it.
EVERYWHERE = (
    ("--url", "database URL (default: DRAMATIQ_PG_URL, else embedded)"),
    ("--schema", "schema name (default: DRAMATIQ_PG_SCHEMA or dramatiq)"),
)


class DatabaseUnreachable(PgBrokerError):
    """The command cannot reach the database."""


def one_line_error(error: BaseException) -> str:
    """A driver's error as one line: libpq's messages run over several."""
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


def connect(args: argparse.Namespace, **kwargs) -> psycopg.Connection:
    """An autocommit connection to the command's database, reached within
    :data:`CONNECT_SECONDS`.

    Raises:
      DatabaseUnreachable: the server cannot be reached, or refuses the connection (no such
        database, role or password), with libpq's reason.
    """
    url = database_url(args)
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_SECONDS, **kwargs)
    except psycopg.OperationalError as e:
        raise DatabaseUnreachable(f"cannot connect to the database: {one_line_error(e)}") from e


def reach_database(args: argparse.Namespace) -> None:
    """Reach the database once before a command runs (see the module docstring), so that
    a command fails fast and says why, where the pool it then uses would retry for its
    whole timeout, quietly, as a worker's does."""
    connect(args).close()


def database_url(args: argparse.Namespace) -> str:
    from ..db.core import resolve_url

    return resolve_url(settings_from(args))


def _schema_state(args: argparse.Namespace):
    """This code, and what the database says about its schema (see :mod:`.handshake`)."""
    from ..db.handshake import read_state, this_code

    settings = settings_from(args)
    with connect(args) as conn:
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


def _json_flag(parser: argparse.ArgumentParser) -> None:
    from .jobs import _json_flag as add_json_flag

    add_json_flag(parser)


def print_json(data) -> None:
    """``data`` as indented JSON (times in ISO 8601) on stdout."""
    from .jobs import to_json

    print(to_json(data))


def add_migration_commands(sub: argparse._SubParsersAction) -> None:
    def run_migrate(args: argparse.Namespace) -> int:
        from ..db.migrate import migrate

        if args.check:
            return check_migrations(args)
        settings = settings_from(args)
        applied_now: list[dict] = []

        line_open = False

        def report(migration, took: float | None) -> None:
            # One line per migration: its name as it starts, its time once applied.
            nonlocal line_open
            label = f"{migration.version:04d}_{migration.name}"
            if args.json:
                if took is not None:
                    applied_now.append({"migration": label, "seconds": round(took, 3)})
            elif took is None:
                print(f"applying {label} ... ", end="", flush=True)
                line_open = True
            else:
                print(f"done in {took:.1f} s", flush=True)
                line_open = False

        def say(line: str) -> None:
            # A wait for a lock, on a line of its own (the migration's line starts again
            # when its transaction is tried again); on stderr beside --json's document.
            nonlocal line_open
            if args.json:
                print(line, file=sys.stderr, flush=True)
                return
            if line_open:
                print("waiting", flush=True)
                line_open = False
            print(line, flush=True)

        applied = migrate(
            database_url(args), settings.schema, force=args.force, report=report, say=say
        )
        code, state = _schema_state(args)
        if args.json:
            verdict = _verdict(code, state)
            print_json({"schema": settings.schema, "applied": applied_now, "verdict": verdict})
            return 0
        if not applied:
            print(f"schema {settings.schema!r} is up to date")
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
        refusal = None
        breaking = next((m for m in pending if m.breaking), None)
        if breaking is not None:
            # The code still running must ship every breaking migration pending.
            level = [m for m in pending if m.breaking][-1].version
            with connect(args) as conn:
                seen = live_work(conn, settings.schema, level=level)
            if seen:
                refusal = (
                    f"`migrate` would refuse {breaking.filename} now, seeing live work of "
                    f"processes whose code does not ship it: {seen.describe()}"
                )
        if args.json:
            print_json(
                {
                    "schema": settings.schema,
                    "pending": [
                        {
                            "migration": m.filename,
                            "compatibility": m.compatibility,
                            "reason": m.reason,
                        }
                        for m in pending
                    ],
                    "would_refuse": refusal,
                    "verdict": _verdict(code, state),
                }
            )
            return 1 if pending else 0
        if pending:
            print(f"{len(pending)} migration(s) pending in schema {settings.schema!r}:")
            for migration in pending:
                print(f"  {migration.filename}{_kind(migration)}")
            if refusal:
                print(refusal)
            return 1
        print(f"schema {settings.schema!r} is up to date: {_verdict(code, state)}")
        return 0

    def run_status(args: argparse.Namespace) -> int:
        from ..db.migrate import status

        settings = settings_from(args)
        states = status(database_url(args), settings.schema)
        code, state = _schema_state(args)
        kinds = {m.version: m for m in state.applied}
        counts = {
            name: sum(1 for s in states if s.state == name)
            for name in ("pending", "changed", "unknown")
        }
        counts["applied"] = len(states) - counts["pending"] - counts["unknown"]
        partitions = _partitions(args, settings)
        if args.json:
            rows = []
            for s in states:
                applied = kinds.get(s.version)
                rows.append(
                    {
                        "migration": f"{s.version:04d}_{s.name}",
                        "state": s.state,
                        "applied_at": s.applied_at,
                        "compatibility": applied.compatibility if applied else None,
                        "applied_by": applied.code_version
                        if applied is not None and not s.known
                        else None,
                    }
                )
            print_json(
                {
                    "schema": settings.schema,
                    "code": code.describe(),
                    "migrations": rows,
                    **counts,
                    "min_code_level": state.min_code_level if state.raised_by else None,
                    "min_code_level_set_by": state.raised_by.label if state.raised_by else None,
                    "verdict": _verdict(code, state),
                    "partitions": partitions,
                }
            )
            return 1 if counts["changed"] else 0
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
        summary = (
            f"{counts['applied']} applied, {counts['pending']} pending, {counts['changed']} changed"
        )
        if counts["unknown"]:
            summary += f", {counts['unknown']} unknown to this code"
        print(summary)
        if state.raised_by is not None:
            print(
                f"minimum code level: {state.min_code_level:04d} (set by the breaking "
                f"migration {state.raised_by.label})"
            )
        else:
            print("minimum code level: none (no breaking migration applied)")
        print(_verdict(code, state))
        _print_partitions(partitions)
        return 1 if counts["changed"] else 0

    migrate_parser = sub.add_parser("migrate", help="apply pending migrations")
    migrate_parser.add_argument(
        "--check",
        action="store_true",
        help="apply nothing: exit 0 when up to date, 1 when migrations are pending (listed)",
    )
    migrate_parser.add_argument(
        "--force",
        action="store_true",
        help="apply a breaking migration even while processes whose code does not ship it "
        "show live work (leases, recent sends or claims); without it, migrate refuses",
    )
    _json_flag(migrate_parser)
    migrate_parser.set_defaults(func=run_migrate)
    status_parser = sub.add_parser(
        "status", help="list applied and pending migrations, and whether this code fits"
    )
    _json_flag(status_parser)
    status_parser.set_defaults(func=run_status)


def _partitions(args: argparse.Namespace, settings: Settings) -> dict | None:
    """``status``: how many days ahead history's partitions exist (through which day), the
    rows of the DEFAULT partitions (which maintenance keeps empty) and the tables not
    attached yet; None before migration 0013."""
    from ..history.retention import partition_status

    try:
        with connect(args) as conn:
            found = partition_status(conn, settings.schema)
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction):
        return None  # migrations 0012-0013 not applied yet
    return {
        "days_ahead": found.days_ahead,
        "through": found.through,
        "default_rows": dict(found.default_rows),
        "pending": list(found.pending),
    }


def _print_partitions(found: dict | None) -> None:
    if found is None:
        return
    if found["days_ahead"] < 0:
        print("history partitions: today's partitions are missing (run prune)")
    else:
        print(
            f"history partitions: {found['days_ahead']} day(s) ahead "
            f"(through {found['through']:%Y-%m-%d})"
        )
    rows = ", ".join(f"{name} {count}" for name, count in found["default_rows"].items())
    print(f"DEFAULT partitions (kept empty by prune): {rows}")
    if found["pending"]:
        print(f"partitions not attached yet: {', '.join(found['pending'])}")


# -- doctor -------------------------------------------------------------------------------
# ``dramatiq-pg-broker doctor``: look at the live database and say what is wrong, each
# finding with what to do (:mod:`..health.doctor` holds the checks). Exit status: 0 when
# every finding is ok, 1 with warnings, 2 with problems (and, as for every command, 2 when
# the database cannot be reached). ``--json`` prints the report for scripts; ``--check
# NAME`` runs only the named checks; each threshold is an option
# (``--snapshot-warning-seconds 120``).


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def run_doctor(args: argparse.Namespace) -> int:
    from ..db.core import connect
    from ..health.doctor import Thresholds, examine, render
    from .jobs import printable, to_json

    settings = settings_from(args)
    thresholds = Thresholds(
        **{
            name: getattr(args, name)
            for name, _, _ in Thresholds.documented()
            if getattr(args, name) is not None
        }
    )
    with connect(database_url(args)) as conn:
        report = examine(
            conn,
            settings.schema,
            thresholds=thresholds,
            checks=args.check or None,
            lease_seconds=settings.lease_seconds,
        )
    if args.json:
        print(to_json(report.as_dict()))
    else:
        # Wrapped on a terminal; one line per finding, detail and advice when piped.
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
        for line in render(report, width):
            print(printable(line))
    return report.exit_code


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of at least 0")
    return value


def add_doctor_command(sub: argparse._SubParsersAction) -> None:
    """Add ``doctor`` to the CLI."""
    from ..health.doctor import CHECKS, Thresholds

    parser = sub.add_parser(
        "doctor",
        help="look at the live database and say what is wrong, with what to do "
        "(exit 0 healthy, 1 warnings, 2 problems)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--check",
        action="append",
        choices=list(CHECKS),
        metavar="NAME",
        help=f"run only this check (repeatable): {', '.join(CHECKS)}",
    )
    for name, default, doc in Thresholds.documented():
        shown = f"{default:g}" if isinstance(default, float) else default
        parser.add_argument(
            _option(name),
            dest=name,
            type=_non_negative,
            metavar="N",
            help=f"{doc} (default {shown})",
        )
    parser.set_defaults(func=run_doctor)


def add_embedded_commands(sub: argparse._SubParsersAction) -> None:
    def run_embedded(args: argparse.Namespace) -> int:
        from ..db import embedded

        if args.action == "url":
            url = embedded.embedded_url()
            if args.json:
                print_json({"url": url})
            else:
                print(url)
        elif args.action == "status":
            info = embedded.status()
            if args.json:
                print_json(info)
                return 0
            state = f"running (pid {info['pid']})" if info["running"] else "not running"
            print(f"data directory  {info['data_dir']}")
            print(f"chosen by       {info['why']}")
            print(f"server          {state}")
            if info["url"]:
                print(f"url             {info['url']}")
        else:
            path = embedded.data_dir()
            stopped = embedded.stop()
            if args.json:
                print_json({"stopped": stopped, "data_dir": str(path)})
            else:
                print(f"stopped ({path})" if stopped else f"not running ({path})")
        return 0

    parser = sub.add_parser("embedded", help="the local PostgreSQL used without DRAMATIQ_PG_URL")
    parser.add_argument(
        "action",
        choices=["url", "status", "stop"],
        help="url: print its URL, starting it if it is not running; status: which server "
        "(its data directory, and why that one) and whether it runs; stop: stop it",
    )
    _json_flag(parser)
    # It starts or stops the server itself: nothing to reach first.
    parser.set_defaults(func=run_embedded, needs_database=False)


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
        return fail(f"the {entry.name} commands need the {extras} extra: {install}")

    parser = sub.add_parser(entry.name, help=f"{entry.name} commands (needs the {extras} extra)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    # It says what to install: nothing to reach first.
    parser.set_defaults(func=missing, needs_database=False)


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments print one line (no usage block), JSON with ``--json``, and exit 2."""

    def error(self, message: str):
        if _json_errors.get():
            self.exit(2, json.dumps({"error": f"{self.prog}: {message}"}) + "\n")
        self.exit(2, f"{self.prog}: error: {message}\n")


def _everywhere(parser: argparse.ArgumentParser) -> None:
    """Let every command (and group of commands) take the :data:`EVERYWHERE` options where
    it is named: ``jobs list --url URL`` as well as ``--url URL jobs list``. Their
    defaults are suppressed there, so that a value given before the command stands."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for sub in {id(p): p for p in action.choices.values()}.values():
            given = {option for a in sub._actions for option in a.option_strings}
            for option, _ in EVERYWHERE:
                if option not in given:
                    sub.add_argument(option, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            _everywhere(sub)


def build_parser() -> argparse.ArgumentParser:
    from .control import add_control_commands
    from .jobs import add_operator_commands
    from .workflows import add_workflow_commands

    parser = OneLineErrorParser(
        prog="dramatiq-pg-broker", description="Operate the dramatiq-pg-broker database."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    for option, help_text in EVERYWHERE:
        parser.add_argument(option, help=help_text)
    sub = parser.add_subparsers(dest="command", required=True)
    add_migration_commands(sub)
    add_embedded_commands(sub)
    add_operator_commands(sub)
    add_control_commands(sub)
    add_workflow_commands(sub)
    add_doctor_command(sub)
    add_entry_point_commands(sub)
    _everywhere(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # A command says itself why it cannot reach the database (one line, exit 2): the
    # outage lines a worker logs while it retries would only repeat it. Restored after the
    # command: a program (or a test) calling main() keeps its own logging as it was.
    outage_log = logging.getLogger("dramatiq_pg_broker.outage")
    level = outage_log.level
    outage_log.setLevel(logging.ERROR)
    argv = list(sys.argv[1:] if argv is None else argv)
    token = _json_errors.set("--json" in argv)
    try:
        args = build_parser().parse_args(argv)
        #: The command line as given, to repeat it in advice (see settings_from).
        args.argv = argv
        _json_errors.set(bool(getattr(args, "json", False)))
        return _run(args)
    finally:
        _json_errors.reset(token)
        outage_log.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "needs_database", True):
            reach_database(args)
        return args.func(args)
    except BrokenPipeError:
        # The reader went away (`... | head`): not an error of ours. Python's own advice:
        # point stdout at devnull so that the interpreter's final flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except PgBrokerError as e:
        return fail(str(e))
    except BrokerConnectionError as e:
        # The database went away while the command ran (the pool gave up waiting).
        cause = e.__cause__ or e
        return fail(f"lost the database: {one_line_error(cause)}")
    except psycopg.OperationalError as e:
        return fail(f"cannot connect to the database: {one_line_error(e)}")
    except psycopg.ProgrammingError as e:
        if "connection" not in str(e).lower():
            raise
        # libpq's message quotes part of the string, which may be the password.
        return fail(
            "the database URL is not a connection string libpq can parse: check "
            "--url or DRAMATIQ_PG_URL"
        )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
