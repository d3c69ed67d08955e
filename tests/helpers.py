"""Helpers every tier of the tests uses: schemas of their own (a later release's among
them), bounded waits, the connections left inside a transaction, and a statement counter."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

#: 0.1.0's last migration, the one before the schema handshake (``CONTRACT_FROM`` - 1):
#: every migration since is pending on a schema migrated up to it (the breaking 0012 among
#: them).
RELEASED = 9


def new_schema_name(prefix: str = "t") -> str:
    """A schema name no other test uses."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def drop_schema(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def migrate_ahead(url: str, schema: str, directory: Path, kind: str) -> str:
    """Migrate ``schema`` with this code's migrations plus one more of ``kind``
    (``compatible``, ``breaking``) that this code does not ship, written into
    ``directory``/migrations: a later release's schema, as this code sees it. Returns the
    added migration's name."""
    from dramatiq_pg_broker.migrate import migrate

    folder, name = migrations_ahead(directory, kind, "CREATE TABLE future_probe (id integer);\n")
    migrate(url, schema, directory=folder)
    return name


def migrations_ahead(
    directory: Path, kind: str, body: str, *, transaction: str | None = None
) -> tuple[Path, str]:
    """This code's migrations copied into ``directory``/migrations, plus one more that this
    code does not ship: of ``kind`` (``compatible``, ``breaking``), with the statements
    ``body`` (and a ``-- transaction:`` line when given). Returns the folder and the added
    migration's name."""
    from dramatiq_pg_broker.db import handshake
    from dramatiq_pg_broker.migrate import migrations_dir

    folder = directory / "migrations"
    shutil.copytree(migrations_dir(), folder)
    version = handshake.this_code().level + 1
    name = f"{version:04d}_future_{kind}"
    header = f"-- compatibility: {kind}\n-- A later release's change, made up by the test.\n"
    if transaction is not None:
        header += f"-- transaction: {transaction}\n"
    (folder / f"{name}.sql").write_text(header + body)
    return folder, name


def idle_in_transaction(conn: psycopg.Connection, application_name: str) -> list[str]:
    """The states of the connections named ``application_name`` that sit inside a
    transaction nobody ended: idle inside the same transaction at two looks half a second
    apart (a worker of the application caught between two statements of a short
    transaction, on a loaded machine, has moved on by the second look). The server reports
    a backend's state before it tells the client a statement is done; but a connection the
    client dropped inside a transaction is ended by its backend only when that backend
    notices the closed socket."""
    query = (
        "SELECT pid, xact_start, state FROM pg_stat_activity WHERE application_name = %s"
        " AND state LIKE 'idle in transaction%%'"
    )
    first = {(pid, began) for pid, began, _ in conn.execute(query, (application_name,))}
    if not first:
        return []
    time.sleep(0.5)
    rows = conn.execute(query, (application_name,)).fetchall()
    return [state for pid, began, state in rows if (pid, began) in first]


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    *,
    on_timeout: Callable[[], str] | None = None,
    interval: float = 0.02,
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``predicate`` until it returns something true, and return that.

    Parameters:
      predicate(callable): the condition; its value is returned once it is true.
      timeout(float): seconds before the test fails, naming ``what``.
      what(str): what was awaited, for the failure message.
      on_timeout(callable): its text (a log's tail) is added to the failure message.
      interval(float): seconds between two looks.
      ignore(tuple): exceptions that mean "not yet" (a server that is not listening).
    """
    deadline = time.monotonic() + timeout
    last = None
    while True:
        with contextlib.suppress(*ignore):
            last = predicate()
            if last:
                return last
        if time.monotonic() > deadline:
            seen = f" (last seen: {last!r})" if last not in (None, False) else ""
            extra = f"\n{on_timeout()}" if on_timeout else ""
            pytest.fail(f"timed out after {timeout}s waiting for {what}{seen}{extra}")
        time.sleep(interval)


def server_up_for(url: str, seconds: float) -> None:
    """Wait until the server at ``url`` has been up for
    ``seconds``: a lease that ran out counts as expired only then (the reaper's guard, in
    ``lease_ran_out``), and a test's server may have started just before the test (the
    embedded one, started by the run)."""
    with psycopg.connect(url, autocommit=True) as conn:
        left = conn.execute(
            "SELECT extract(epoch FROM pg_postmaster_start_time() + make_interval(secs => %s)"
            " - now())",
            (seconds,),
        ).fetchone()[0]
    if left > 0:  # a known time to wait, not a guess: the server's own clock says it
        time.sleep(float(left) + 0.1)


class StatementCounter:
    """Counts ``psycopg.Cursor.execute`` calls while installed (a context manager): all of
    them in ``count``, and per statement text in ``of``. Every statement the package sends
    goes through a cursor's ``execute`` (``Connection.execute`` included), from any thread
    of this process.

    Parameters:
      monkeypatch: the test's ``monkeypatch`` fixture (the patch is undone with it).
    """

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        self.of: dict[str, int] = {}
        self.lock = threading.Lock()
        self.monkeypatch = monkeypatch
        self.original = psycopg.Cursor.execute

    def __enter__(self) -> StatementCounter:
        original, counter = self.original, self

        def execute(cursor, query, *args, **kwargs):
            with counter.lock:
                counter.count += 1
                if isinstance(query, str):
                    counter.of[query] = counter.of.get(query, 0) + 1
            return original(cursor, query, *args, **kwargs)

        self.monkeypatch.setattr(psycopg.Cursor, "execute", execute)
        return self

    def __exit__(self, *exc) -> None:
        self.monkeypatch.setattr(psycopg.Cursor, "execute", self.original)

    def __getitem__(self, query: str) -> int:
        """How many times the statement ``query`` ran while the counter was installed."""
        with self.lock:
            return self.of.get(query, 0)
