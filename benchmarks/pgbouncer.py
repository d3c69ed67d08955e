"""A real PgBouncer in transaction mode in front of one PostgreSQL database, run as a child
process with a generated configuration (used by the benchmark and by the e2e test).

Clients connect to :attr:`PgBouncer.url`; PgBouncer logs in to the server as the user and
password of the server URL (``auth_type = any``: the client's user name is ignored), with at
most ``pool_size`` server connections. Every server connection carries the
``application_name`` :attr:`PgBouncer.tag`, so the server side can be counted in
``pg_stat_activity`` (:meth:`PgBouncer.server_connections`).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict


def binary() -> str | None:
    """The ``pgbouncer`` executable (Debian installs it in /usr/sbin), or None."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/bin")


def free_port(candidates: range | None = None) -> int:
    """A TCP port nothing listens on: the first free one of ``candidates``, else one the
    OS picks."""
    for port in candidates or ():
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quote(value: str) -> str:
    # PgBouncer's connect strings take libpq's key=value syntax.
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class PgBouncer:
    """A PgBouncer child process. Use as a context manager, or ``start()`` and ``stop()``.

    Parameters:
      server_url(str): the PostgreSQL database to pool (host, port, user, password, dbname).
      pool_size(int): the most server connections (``default_pool_size``; no reserve pool).
      port(int): where PgBouncer listens on 127.0.0.1; 0 picks a free port.
      max_client_conn(int): the most client connections.
    """

    def __init__(
        self,
        server_url: str,
        *,
        pool_size: int = 4,
        port: int = 0,
        max_client_conn: int = 500,
    ) -> None:
        self.server_url = server_url
        self.pool_size = pool_size
        self.port = port or free_port()
        self.max_client_conn = max_client_conn
        self.tag = f"pgbouncer-{uuid.uuid4().hex[:10]}"
        info = conninfo_to_dict(server_url)
        self.dbname = info.get("dbname") or info.get("user") or "postgres"
        self.user = info.get("user") or pwd.getpwuid(os.getuid()).pw_name
        self._server = {
            "host": info.get("host") or "127.0.0.1",
            "port": info.get("port") or "5432",
            "dbname": self.dbname,
            "user": self.user,
            "application_name": self.tag,
        }
        if info.get("password"):
            self._server["password"] = info["password"]
        self._dir: str | None = None
        self._log = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """What clients connect to."""
        user, dbname = quote(self.user, safe=""), quote(self.dbname, safe="")
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    @property
    def log_path(self) -> Path | None:
        return Path(self._dir, "pgbouncer.log") if self._dir else None

    def config(self) -> str:
        server = " ".join(f"{k}={_quote(str(v))}" for k, v in self._server.items())
        return "\n".join(
            [
                "[databases]",
                f"{self.dbname} = {server}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {self.port}",
                "unix_socket_dir =",
                "auth_type = any",
                f"admin_users = {self.user}",
                "pool_mode = transaction",
                f"default_pool_size = {self.pool_size}",
                "min_pool_size = 0",
                "reserve_pool_size = 0",
                f"max_client_conn = {self.max_client_conn}",
                f"max_db_connections = {self.pool_size}",
                # Clients wait for a server connection rather than fail while the pool is
                # busy; a generous limit, since a shared machine can be slow.
                "query_wait_timeout = 120",
                "ignore_startup_parameters = extra_float_digits,options",
                "",
            ]
        )

    def start(self, timeout: float = 20.0) -> PgBouncer:
        exe = binary()
        if exe is None:
            raise FileNotFoundError(
                "pgbouncer is not installed (Debian: apt-get install pgbouncer)"
            )
        self._dir = tempfile.mkdtemp(prefix="pgbouncer-")
        os.chmod(self._dir, 0o755)
        ini = Path(self._dir, "pgbouncer.ini")
        ini.write_text(self.config())
        os.chmod(ini, 0o644)
        args = [exe]
        if os.geteuid() == 0:
            # PgBouncer refuses to run as root; it drops to this user after reading its files.
            args += ["-u", _unprivileged_user(self._server["host"])]
        args.append(str(ini))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited at start:\n{self.log_tail()}")
            try:
                with psycopg.connect(self.url, autocommit=True, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not answer within {timeout:.0f}s") from None
                time.sleep(0.1)

    def server_connections(self, conn: psycopg.Connection) -> int:
        """Server-side connections PgBouncer holds now, counted by the server: its backends
        that carry the ``application_name`` PgBouncer logs in with, or whose process id
        PgBouncer's ``SHOW SERVERS`` gives (in transaction mode a client's own
        ``application_name`` is set on the server connection it is lent, so a busy pool may
        carry none of the tag at a given moment)."""
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s OR pid = ANY(%s)",
            (self.tag, self._server_pids()),
        ).fetchone()[0]

    def _server_pids(self) -> list[int]:
        """The server process ids of PgBouncer's connections to the pooled database, from
        its ``SHOW SERVERS`` (none when the console does not answer)."""
        admin = self.url.rsplit("/", 1)[0] + "/pgbouncer"
        try:
            with psycopg.connect(admin, autocommit=True, cursor_factory=psycopg.ClientCursor) as c:
                cur = c.execute("SHOW SERVERS")
                names = [d.name for d in cur.description]
                database, pid = names.index("database"), names.index("remote_pid")
                return [int(r[pid]) for r in cur.fetchall() if r[database] == self.dbname]
        except (psycopg.Error, ValueError):
            return []

    def client_connections(self) -> int:
        """Client connections to the pooled database now, from PgBouncer's ``SHOW CLIENTS``."""
        admin = self.url.rsplit("/", 1)[0] + "/pgbouncer"
        with psycopg.connect(admin, autocommit=True, cursor_factory=psycopg.ClientCursor) as c:
            cur = c.execute("SHOW CLIENTS")
            column = [d.name for d in cur.description].index("database")
            return sum(1 for row in cur.fetchall() if row[column] == self.dbname)

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no pgbouncer log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def errors(self) -> list[str]:
        """The log lines PgBouncer marked as errors or warnings."""
        if self.log_path is None or not self.log_path.exists():
            return []
        return [
            line
            for line in self.log_path.read_text(errors="replace").splitlines()
            if " ERROR " in line or " WARNING " in line or " FATAL " in line
        ]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # SIGTERM: an immediate shutdown (SIGINT would wait for clients to leave).
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def cleanup(self) -> None:
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()


def _unprivileged_user(host: str) -> str:
    if host.startswith("/"):
        # A Unix socket: its directory's owner (the server's own user) can reach it.
        with contextlib.suppress(OSError, KeyError):
            owner = os.stat(host).st_uid
            if owner != 0:
                return pwd.getpwuid(owner).pw_name
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("pgbouncer refuses to run as root and no unprivileged user was found")
