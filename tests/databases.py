"""A database of its own for each test module, copied from one migrated once per process.

Migrating a schema takes most of a second of the server's CPU even on a quiet machine
(0012's daily history partitions, with their indexes, are most of it), and several seconds
while the suite runs in parallel; dropping it takes more. Each pytest process (each
pytest-xdist worker, or the one process of a serial run) therefore migrates a *template*
database once, and each test module gets a copy of it (``CREATE DATABASE ... TEMPLATE``:
the template's 12 MB copied block by block). Measured side by side on a busy 2-core
machine, a module's set-up and clean-up took 1.3 s against 6.6 s on PostgreSQL 15; on the
embedded PostgreSQL 16 the copy costs the server about two thirds of the CPU time of a
migration and its drop (most of it copying the system catalogs every database has).

The copy is the migrated database itself, byte for byte: the same schema name inside, so
the functions whose ``search_path`` the migrations fixed still find their tables.

A module's copy stays until its process ends, as a module's schema stayed in the shared
database until its drop: a broker a test left open may still hold a connection to it, or
reconnect, and a database that refused it (dropped, or closed to new connections) would
be an outage told in the process-wide outage log, which a later module's test reads.
The process drops its copies and the template at its end, together, in threads of their
own: each ``DROP DATABASE`` waits for a checkpoint of the whole server (seconds when the
server is busy), and drops running at once share it.

A module's database keeps it apart from the others as its own schema did, and more: its
notifications (``LISTEN``/``NOTIFY`` are per database), its advisory locks (keyed by
database too) and its connections. The schema
name is the process's, one per worker, so two modules running at once never share one.

A role that may not create databases (``CREATEDB``) gets what the suite did before: each
module migrates a schema of its own in the configured database.
"""

from __future__ import annotations

import datetime as dt
import itertools
import threading
import urllib.parse
import uuid

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .helpers import new_schema_name


def database_url(url: str, dbname: str) -> str:
    """``url`` (a URL or a key=value connection string) naming database ``dbname``."""
    if "://" not in url:
        return make_conninfo(url, dbname=dbname)
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + urllib.parse.quote(dbname)))


class Template:
    """A database migrated once, for :meth:`copy` to copy for each module."""

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        #: The broker's schema in the template, and in every copy.
        self.schema = new_schema_name()
        self.name = ""
        #: The server's date when the template was migrated: 0012 made its history
        #: partitions from that day on, so a run that passes midnight migrates another.
        self.day: dt.date | None = None
        self._counter = itertools.count()
        #: The copies made, dropped with the template.
        self._copies: list[str] = []
        self._dropper: Dropper | None = None

    @classmethod
    def create(cls, server_url: str) -> Template | None:
        """Create and migrate a template database on the server of ``server_url``; None
        when its role may not create databases."""
        template = cls(server_url)
        with psycopg.connect(server_url, autocommit=True) as conn:
            try:
                template._make(conn)
            except psycopg.errors.InsufficientPrivilege:
                return None
        return template

    def _make(self, conn: psycopg.Connection) -> None:
        from dramatiq_pg_broker.migrate import migrate

        name = f"{conn.info.dbname[:40]}_tpl_{uuid.uuid4().hex[:8]}"
        conn.execute(sql.SQL("CREATE DATABASE {} {}").format(sql.Identifier(name), _like(conn)))
        try:
            migrate(database_url(self.server_url, name), self.schema)
        except BaseException:
            _drop(self.server_url, name)
            raise
        self.name = name
        self.day = conn.execute("SELECT current_date").fetchone()[0]

    def copy(self) -> str:
        """A new database copied from the template (see :meth:`drop_copy`); its URL."""
        with psycopg.connect(self.server_url, autocommit=True) as conn:
            if conn.execute("SELECT current_date").fetchone()[0] != self.day:
                self._drop_later(self.name)
                self._make(conn)
            name = f"{self.name}_{next(self._counter)}"
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(self.name)
                )
            )
        return database_url(self.server_url, name)

    def drop_copy(self, url: str) -> None:
        """Drop the copy at ``url`` when the process ends (see the module's docstring)."""
        self._copies.append(conninfo_to_dict(url)["dbname"])

    def _drop_later(self, name: str) -> None:
        if self._dropper is None:
            self._dropper = Dropper(self.server_url)
        self._dropper.put(name)

    def drop(self) -> None:
        """Drop the copies and the template, together, and wait for the drops."""
        for name in [*self._copies, self.name]:
            self._drop_later(name)
        self._copies.clear()
        self._dropper.close()


class Dropper:
    """Drops databases in threads of their own: the checkpoint each ``DROP DATABASE``
    waits for is shared by the drops running at once (the end of a process drops its copies
    and the template together). At most :attr:`AT_ONCE` of them hold a connection at a
    time: a process ending with twenty copies once opened twenty connections at once, and
    four processes ending together took most of a 100-connection server from the modules
    still running (``sorry, too many clients already``)."""

    AT_ONCE = 4

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        self._slots = threading.BoundedSemaphore(self.AT_ONCE)
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def put(self, name: str) -> None:
        self.threads = [thread for thread in self.threads if thread.is_alive()]
        thread = threading.Thread(target=self._drop, args=(name,), name=f"drop {name}")
        thread.start()
        self.threads.append(thread)

    def close(self) -> None:
        """Wait for the drops asked for; raise the first that failed."""
        for thread in self.threads:
            thread.join()
        if self.errors:
            raise self.errors[0]

    def _drop(self, name: str) -> None:
        try:
            with self._slots:
                _drop(self.server_url, name)
        except Exception as e:  # told by close(), at the end of the run
            self.errors.append(e)


def _like(conn: psycopg.Connection) -> sql.Composable:
    """The clause giving a new database the encoding and collation of ``conn``'s (the
    configured one, where the tests ran before): template1's when they are the same (as
    ``createdb`` does), else template0 told them."""
    query = (
        "SELECT pg_encoding_to_char(encoding), datcollate, datctype FROM pg_database "
        "WHERE datname = %s"
    )
    ours = conn.execute(query, (conn.info.dbname,)).fetchone()
    if ours == conn.execute(query, ("template1",)).fetchone():
        return sql.SQL("TEMPLATE template1")
    encoding, collate, ctype = ours
    return sql.SQL("TEMPLATE template0 ENCODING {} LC_COLLATE {} LC_CTYPE {}").format(
        sql.Literal(encoding), sql.Literal(collate), sql.Literal(ctype)
    )


def _drop(server_url: str, name: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
