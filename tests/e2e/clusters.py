"""Throwaway PostgreSQL clusters for the tests that stop, crash or fail over a server.

Each cluster is a fresh ``initdb`` in a temporary directory, on a port of its own, so
stopping or killing it disturbs nothing else (never the shared server the other tests
use). The server binaries come from ``/usr/lib/postgresql/*/bin`` (newest first) or from
the ``pgserver`` package; without them the tests that need a cluster are skipped.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest


def _ephemeral_ports() -> range:
    """The ports the kernel hands out as the local end of outgoing connections (Linux's
    ``ip_local_port_range``; the IANA range elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(49152, 65536)


def _cluster_ports(count: int = 200) -> range:
    """``count`` ports for the test clusters, outside the ephemeral range: a stopped
    cluster's port inside it can be taken, while the server is down, as the local end of
    any outgoing connection on the machine (the tests open thousands), and the server
    could not start on it again (a worker that knows the old port would wait for ever)."""
    ephemeral = _ephemeral_ports()
    below = range(max(1024, ephemeral.start - 1200), max(1024, ephemeral.start - 1200) + count)
    if below.stop <= ephemeral.start:
        return below
    above = range(ephemeral.stop, min(65536, ephemeral.stop + count))
    if len(above) >= count // 2:
        return above
    # The kernel hands out nearly every port: inside its range, a restart that finds its
    # port taken fails saying so (Cluster.start).
    return range(55431, 55431 + count)


#: Ports the test clusters may use, tried in a random order so that two test runs on one
#: machine seldom reach for the same one.
PORTS = _cluster_ports()

#: How many times a restart tries its port again (half a second apart) when something else
#: holds it.
RESTART_TRIES = 20


def server_binaries(*tools: str) -> Path | None:
    """The first directory of PostgreSQL server binaries holding ``initdb``, ``pg_ctl`` and
    every one of ``tools``; None if there is none."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    try:
        from dramatiq_pg_broker.db.embedded import import_pgserver

        import_pgserver()  # with its lock file where the embedded server keeps it
        # pgserver names the folder of the binaries it ships only in this module of its own.
        from pgserver._commands import POSTGRES_BIN_PATH

        candidates.append(str(POSTGRES_BIN_PATH))
    except ImportError:  # pragma: no cover - pgserver is a dev dependency
        pass
    for candidate in candidates:
        if all((Path(candidate) / tool).exists() for tool in ("initdb", "pg_ctl", *tools)):
            return Path(candidate)
    return None


#: Where the test processes of a machine reserve the ports of their clusters: one lock
#: file per port, locked (``flock``) by the process whose cluster has that port, and
#: removed by it when it gives the port back; the folder goes with its last file, so a
#: green run leaves nothing here.
RESERVATIONS = Path(tempfile.gettempdir()) / "dramatiq-pg-test-ports"

#: This process's reservations: port -> its locked file.
_reserved: dict[int, object] = {}


def _reserve(port: int) -> bool:
    """Take ``port`` for a cluster of this process, for as long as the cluster lives
    (:func:`release`); False when another process holds it. A cluster that is stopped
    keeps its port this way: without it, a test beside this one took the port of a
    cluster stopped for an outage, the cluster came back on another port, and the worker
    under test waited for the old one until the test timed out."""
    if port in _reserved:
        return False
    import fcntl

    path = RESERVATIONS / f"{port}.lock"
    for _ in range(5):
        RESERVATIONS.mkdir(exist_ok=True)
        try:
            handle = open(path, "a")  # noqa: SIM115 - held until release
        except FileNotFoundError:  # the folder went with another process's last file
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return False
        # The holder before removes the file while it holds its lock (release): a lock
        # taken since on the file it removed is on no file another process can open.
        try:
            current = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            _reserved[port] = handle
            return True
        handle.close()
    return False


def release(port: int) -> None:
    """Give back a port taken by :func:`free_ports`: its lock file is removed, and the
    folder with its last one (a process that ends without this releases its locks, but
    leaves their files for the next process that takes those ports)."""
    handle = _reserved.pop(port, None)
    if handle is None:
        return
    with contextlib.suppress(FileNotFoundError):
        (RESERVATIONS / f"{port}.lock").unlink()  # while the lock is held: see _reserve
    handle.close()
    with contextlib.suppress(OSError):  # another process's file in it: not the last
        RESERVATIONS.rmdir()


@atexit.register
def _release_all() -> None:
    for port in list(_reserved):
        release(port)


def free_ports(count: int, ports: Iterable[int] = PORTS) -> list[int] | None:
    """``count`` ports of ``ports`` that nothing listens on yet and no other cluster of a
    test process holds, reserved for this process (:func:`release` gives them back), or
    None if there are fewer.

    A port that only has connections in TIME_WAIT (those of a server killed a moment ago)
    is free: PostgreSQL binds its port with SO_REUSEADDR, and so does this check.
    """
    found: list[int] = []
    for port in random.sample(list(ports), len(ports)):
        if not _reserve(port):
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                release(port)
                continue
        found.append(port)
        if len(found) == count:
            return found
    for port in found:
        release(port)
    return None


class Cluster:
    """A throwaway PostgreSQL cluster: initdb (or a base backup of another cluster), start,
    stop, kill, promote.

    Parameters:
      bindir(Path): the server binaries.
      port(int): the port it listens on (127.0.0.1 only; no Unix socket).
      settings(dict): server settings given on the command line at each start (so that a
        base backup taken from this cluster does not inherit them).
      init(bool): run initdb; False leaves the data directory for the caller to fill.
    """

    def __init__(
        self,
        bindir: Path,
        port: int,
        *,
        settings: dict[str, str] | None = None,
        init: bool = True,
    ) -> None:
        self.bindir = bindir
        self.port = port
        self.settings = dict(settings or {})
        self.root = Path(tempfile.mkdtemp(prefix="dramatiq-pg-cluster-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            # PostgreSQL refuses to run as root.
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root and no 'postgres' user to run the server as")
            if shutil.which("runuser") is None:
                pytest.skip("running as root and no runuser to run the server as postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self.prefix = ["runuser", "-u", "postgres", "--"]
        if init:
            self.run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        #: Whether the server was started once: a restart must keep its port.
        self.started = False

    @classmethod
    def standby_of(cls, primary: Cluster, port: int) -> Cluster:
        """A streaming standby of ``primary`` (running): ``pg_basebackup -R`` writes its
        ``primary_conninfo`` and ``standby.signal``. Not started yet."""
        standby = cls(primary.bindir, port, settings=None, init=False)
        standby.run(
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(primary.port),
            "-U",
            "postgres",
            "-D",
            str(standby.data),
            "-R",
            "-X",
            "stream",
            "--no-sync",
            "-c",
            "fast",
        )
        return standby

    def run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.prefix, str(self.bindir / tool), *args],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        """Start the server. At its first start, a port taken between :func:`free_ports`
        and the start (by a test run beside this one) moves it to another free port
        (``port`` and ``url`` change). A restart keeps its port, since its clients know
        it: a port taken meanwhile is tried again for a few seconds, then the start
        fails saying so. Any other failure raises with the end of the server's log."""
        tries = RESTART_TRIES if self.started else 5
        for _ in range(tries):
            seen = self.log.stat().st_size if self.log.exists() else 0
            try:
                self._pg_ctl_start()
                self.started = True
                return
            except subprocess.CalledProcessError as e:
                said = self._log_since(seen)
                if "could not bind" not in said:
                    raise RuntimeError(f"the test cluster did not start:\n{said[-2000:]}") from e
            if self.started:
                time.sleep(0.5)
                continue
            ports = free_ports(1)  # not this cluster's own port: it holds it
            if ports is None:
                raise RuntimeError(f"the test cluster did not start:\n{said[-2000:]}")
            release(self.port)
            self.port = ports[0]
            self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        if self.started:
            raise RuntimeError(
                f"the test cluster could not start again on its port {self.port}: something "
                f"else took it while the server was down\n{said[-2000:]}"
            )
        raise RuntimeError("the test cluster found no free port in five tries")

    def _pg_ctl_start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
            "-c fsync=off -c max_connections=100"
        )
        for name, value in self.settings.items():
            options += f" -c {name}={value}"
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def _log_since(self, offset: int) -> str:
        """What the server wrote to its log after ``offset`` bytes."""
        with open(self.log, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def stop(self, mode: str = "fast") -> None:
        self.run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def kill(self) -> None:
        """SIGKILL the postmaster and every one of its processes at once: the nearest thing
        to losing the host. No process of the server says goodbye (no error message to
        the clients, no last WAL record to a standby), unlike ``pg_ctl stop -m immediate``,
        whose backends still tell their clients that the server shuts down."""
        postmaster = psutil.Process(self.postmaster_pid())
        processes = [postmaster, *postmaster.children(recursive=True)]
        for process in processes:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(processes, timeout=10)

    def promote(self) -> None:
        """End a standby's recovery: it becomes a primary (waits until it is)."""
        self.run("pg_ctl", "-D", str(self.data), "-w", "promote")

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def remove(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)
        release(self.port)


def cluster_factory():
    """For a fixture: yields ``new(**kwargs)`` that makes (and by default starts) a
    :class:`Cluster` on a free port; every cluster is removed afterwards. ``new`` takes the
    :class:`Cluster` arguments but ``bindir`` and ``port``, plus ``start`` (default True)
    and ``standby_of`` (a running cluster to make a streaming standby of)."""
    clusters: list[Cluster] = []

    def new(*, start: bool = True, standby_of: Cluster | None = None, **kwargs) -> Cluster:
        bindir = server_binaries(*(("pg_basebackup",) if standby_of is not None else ()))
        if bindir is None:
            pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl...) to start a cluster")
        ports = free_ports(1)  # never a port of this process's clusters: they hold theirs
        if ports is None:
            pytest.skip(f"no free port in {PORTS.start}-{PORTS.stop - 1} for a test cluster")
        try:
            if standby_of is not None:
                cluster = Cluster.standby_of(standby_of, ports[0])
            else:
                cluster = Cluster(bindir, ports[0], **kwargs)
        except BaseException:  # a skip included
            release(ports[0])
            raise
        clusters.append(cluster)
        if start:
            cluster.start()
        return cluster

    try:
        yield new
    finally:
        for cluster in clusters:
            cluster.remove()
