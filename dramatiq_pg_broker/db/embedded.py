"""A local PostgreSQL for the demo and the tests when no database URL is configured.

With ``DRAMATIQ_PG_URL`` unset, :func:`embedded_url` starts (or reuses) a PostgreSQL server
from the ``pgserver`` package and returns its URL. The server is left running for the next
process to reuse; ``dramatiq-pg-broker embedded stop`` stops it. A deployment always names
its own server: nothing here runs when a URL is set.

The server belongs to the project whose virtual environment runs it: its data directory is
``.pgdata/data`` beside the environment (``<checkout>/.pgdata/`` for a checkout's
``.venv``), so two checkouts have two servers and ``make stop`` in one never stops the
other's. ``DRAMATIQ_PG_EMBEDDED_DIR`` names another data directory; outside a project's
virtual environment the server is per user (see :func:`data_dir`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import threading
import warnings
from pathlib import Path

from ..errors import ConfigurationError

# pgserver narrates every command at INFO; only its warnings matter to a user.
logging.getLogger("pgserver").setLevel(logging.WARNING)

# pgserver's platformdirs warns (on import) when XDG_RUNTIME_DIR is unset, as in containers
# and CI, and falls back to a temporary folder, which is fine here.
warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")

logger = logging.getLogger("dramatiq_pg_broker.embedded")

_lock = threading.Lock()
_url: str | None = None

#: The longest Unix socket path that works everywhere (Linux allows 107 bytes, macOS 103).
_SOCKET_PATH_MAX = 100


#: Files or folders that make the folder holding a virtual environment a project's (a
#: checkout, a Django project): its server is then that project's.
PROJECT_MARKERS = ("pyproject.toml", "setup.cfg", "setup.py", "manage.py", ".git")
#: The folder, in a project, that holds the embedded server's data and lock (git-ignored).
PROJECT_FOLDER = ".pgdata"

#: The embedded server's WAL, kept small. It serves a checkout's tests, demo and
#: benchmarks, which write a lot (each test module's database is a copy of a migrated one,
#: written to the WAL): with PostgreSQL's default ``max_wal_size`` of 1 GB the checkout's
#: ``.pgdata`` held a gigabyte of WAL segments, recycled for reuse, after a test run. A
#: checkpoint comes after at most ``max_wal_size`` of WAL, and no more than that is kept;
#: ``wal_keep_size`` stays 0 (no standby). Set on every start (:func:`keep_wal_small`).
WAL_SETTINGS = {"max_wal_size": "128MB", "min_wal_size": "32MB", "wal_keep_size": "0"}


def project_dir() -> Path | None:
    """The project this Python belongs to: the folder holding the running virtual
    environment, when that folder is a project's (see :data:`PROJECT_MARKERS`); None
    outside a virtual environment, or for one kept apart from its project
    (``~/.virtualenvs/app``)."""
    if sys.prefix == sys.base_prefix:
        return None
    parent = Path(sys.prefix).absolute().parent
    if any((parent / marker).exists() for marker in PROJECT_MARKERS):
        return parent
    return None


def data_dir() -> Path:
    """The embedded server's data directory: ``DRAMATIQ_PG_EMBEDDED_DIR`` when set, else
    ``.pgdata/data`` in the project of the running virtual environment (see
    :func:`project_dir`), else a per-user one
    (``~/.local/share/dramatiq-pg-broker/pgdata``)."""
    return where()[0]


def where() -> tuple[Path, str]:
    """The data directory, and why it is that one (what ``embedded status`` says)."""
    configured = os.environ.get("DRAMATIQ_PG_EMBEDDED_DIR")
    if configured:
        return Path(configured), "DRAMATIQ_PG_EMBEDDED_DIR"
    project = project_dir()
    if project is not None:
        return project / PROJECT_FOLDER / "data", f"the project of the virtualenv {sys.prefix}"
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base) / "dramatiq-pg-broker" / "pgdata", "per user (no project virtualenv)"


def embedded_url() -> str:
    """Start or reuse the embedded server and return a URL to its ``postgres`` database.

    Raises:
      ConfigurationError: ``pgserver`` is not installed.
    """
    global _url
    with _lock:
        if _url is None:
            try:
                pgserver = import_pgserver()
            except ImportError:
                raise ConfigurationError(
                    "no database configured: set DRAMATIQ_PG_URL (the command line also "
                    "takes --url, the broker url=), or install the embedded extra "
                    "(pip install 'dramatiq-pg-broker[embedded]') for a local server"
                ) from None
            path = data_dir()
            path.mkdir(parents=True, exist_ok=True)
            with _starting(path):
                if not (path / "postmaster.pid").exists():
                    logger.warning(
                        "starting the embedded PostgreSQL in %s; it keeps running after this "
                        "process (dramatiq-pg-broker embedded stop stops it)",
                        path,
                    )
                # cleanup_mode=None: keep the server running after this process exits so
                # that workers, the API and the demo share it.
                server = pgserver.get_server(path, cleanup_mode=None)
                keep_wal_small(server.get_uri())
                _url = server.get_uri()
        return _url


def keep_wal_small(url: str) -> None:
    """Give the embedded server :data:`WAL_SETTINGS` (``ALTER SYSTEM``, then a reload: they
    need no restart), unless it has them already: one query per process otherwise."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True) as conn:
        current = dict(
            conn.execute(
                "SELECT name, current_setting(name) FROM unnest(%s::text[]) AS name",
                (list(WAL_SETTINGS),),
            ).fetchall()
        )
        changed = {name: value for name, value in WAL_SETTINGS.items() if current[name] != value}
        for name, value in changed.items():
            conn.execute(
                sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value))
            )
        if changed:
            conn.execute("SELECT pg_reload_conf()")


@contextlib.contextmanager
def _starting(path: Path):
    """Hold ``<data directory>.lock`` while one process starts or finds the server.

    Several processes reach for the server at once (the demo's workers and API, the test
    run's parallel workers): pgserver serializes its own initdb and start, but not all of
    what comes before (as root, creating the user the server runs as), and only one of
    them should say that it starts the server. Without ``fcntl`` (Windows) there is no lock
    and pgserver's own is all there is.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path.parent / f"{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def import_pgserver():
    """Import pgserver with its lock file beside the data directory (every import of
    pgserver in this package and its tests goes through here).

    pgserver keeps an inter-process lock in the user's runtime folder, which is
    ``/tmp/runtime-<uid>`` where ``XDG_RUNTIME_DIR`` is unset (containers, CI): a folder left
    in the system's temporary folder by every first start. When the data directory is short
    enough to hold the server's socket itself (pgserver's first choice), the runtime folder
    serves only that lock, so it is moved next to the data directory, for the import only:
    pgserver reads the variable once, at import. Otherwise pgserver may need the runtime
    folder for the socket, and it is left where pgserver puts it.
    """
    if importlib.util.find_spec("pgserver") is None:
        raise ImportError("pgserver is not installed")
    if "pgserver" in sys.modules or os.environ.get("XDG_RUNTIME_DIR"):
        import pgserver

        return pgserver
    path = data_dir()
    if len(str(path / ".s.PGSQL.5432").encode()) > _SOCKET_PATH_MAX:
        import pgserver

        return pgserver
    runtime = path.parent / "run"
    runtime.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    try:
        import pgserver
    finally:
        del os.environ["XDG_RUNTIME_DIR"]
    return pgserver


def status() -> dict:
    """Where the embedded server of this project is and whether it runs, without starting
    it: ``data_dir``, ``why`` (see :func:`where`), ``running``, and when it runs its
    ``pid`` and ``url``."""
    path, why = where()
    info: dict = {"data_dir": str(path), "why": why, "running": False, "pid": None, "url": None}
    if not (path / "postmaster.pid").exists():
        return info
    try:
        import_pgserver()  # first, so that pgserver's lock stays beside the data directory
        from pgserver.utils import PostmasterInfo

        postmaster = PostmasterInfo.read_from_pgdata(path)
    except Exception:  # a torn pid file, or pgserver missing: report what is known
        return info
    if postmaster is not None and postmaster.is_running():
        info.update(running=True, pid=postmaster.pid, url=postmaster.get_uri())
    return info


def stop() -> bool:
    """Stop the embedded server if it runs. Returns whether one was running."""
    global _url
    path = data_dir()
    if not (path / "postmaster.pid").exists():
        return False
    pgserver = import_pgserver()

    with _lock:
        pgserver.get_server(path, cleanup_mode="stop").cleanup()
        _url = None
    return True
