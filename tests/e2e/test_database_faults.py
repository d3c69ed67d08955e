"""Database faults under load: a PostgreSQL server of the test's own is stopped for 10 s,
stopped for 45 s, and crashed (``pg_ctl stop -m immediate``) while two real worker
processes drain jobs whose actor allows no retry.

Every job must end ``succeeded`` (an outage the workers survive fails nothing), none may
run twice except those whose claim or outcome the crash lost, and draining must resume
within 2 s of the server's return.

The server is a fresh cluster (``initdb`` in a temporary directory, on a port of its own),
so stopping it disturbs nothing else; without PostgreSQL's server binaries the test is
skipped. It drains 1,500 jobs per fault (4,500 in all) rather than 5,000, to keep the
suite's wall time reasonable on a small machine.
"""

from __future__ import annotations

import collections
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.migrate import migrate

from .worker_actors import create_executions_table, declare
from .workers import WorkerProcess, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

#: Ports this test may use for its own server.
PORTS = range(55431, 55440)
JOBS_PER_FAULT = 1500
SCHEMA = "faults"
#: Leases far shorter than the 45 s outage, so that every lease runs out while it lasts.
WORKER_SETTINGS = {
    "DRAMATIQ_PG_LEASE_SECONDS": "5",
    "DRAMATIQ_PG_REAPER_INTERVAL": "0.5",
    "DRAMATIQ_PG_POLL_INTERVAL": "0.5",
    "DRAMATIQ_PG_BACKOFF_BASE_MS": "100",
}


def _bindir() -> Path | None:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    try:
        from dramatiq_pg_broker.embedded import import_pgserver

        import_pgserver()  # with its lock file where the embedded server keeps it
        from pgserver._commands import POSTGRES_BIN_PATH

        candidates.append(str(POSTGRES_BIN_PATH))
    except ImportError:  # pragma: no cover - pgserver is a dev dependency
        pass
    for candidate in candidates:
        if (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    return None


def _free_port() -> int | None:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    return None


class Cluster:
    """A throwaway PostgreSQL cluster: initdb, start, stop, crash."""

    def __init__(self, bindir: Path, port: int) -> None:
        self.bindir = bindir
        self.port = port
        self.root = Path(tempfile.mkdtemp(prefix="dramatiq-pg-faults-"))
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
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.prefix, str(self.bindir / tool), *args],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
            "-c fsync=off -c max_connections=100"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def cluster():
    bindir = _bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) to start a cluster with")
    port = _free_port()
    if port is None:
        pytest.skip(f"no free port in {PORTS.start}-{PORTS.stop - 1} for a test cluster")
    server = Cluster(bindir, port)
    try:
        server.start()
        yield server
    finally:
        server.remove()


def _query(url: str, statement: str, params=()) -> list[tuple]:
    with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
        return conn.execute(statement, params).fetchall()


def test_outages_and_a_crash_fail_nothing_and_draining_resumes_at_once(cluster, tmp_path):
    url = cluster.url
    migrate(url, SCHEMA)
    with psycopg.connect(url, autocommit=True) as conn:
        create_executions_table(conn, SCHEMA)
    broker = PostgresBroker(url=url, schema=SCHEMA)
    steady = declare(broker)["steady"]

    def succeeded() -> int:
        return _query(url, f"SELECT count(*) FROM {SCHEMA}.jobs WHERE status = 'succeeded'")[0][0]

    workers = [
        WorkerProcess(url, SCHEMA, tmp_path / f"worker{n}.log", threads=4, **WORKER_SETTINGS)
        for n in range(2)
    ]
    sent: list[str] = []
    resumed_after: dict[str, float] = {}
    crash_window: set[str] = set()
    try:
        for fault, outage in (("stop", 10.0), ("stop", 45.0), ("crash", 1.0)):
            name = f"{fault} {outage:.0f}s"
            before = len(sent)
            # 50 ms each, 8 at a time: draining takes several seconds, so the fault lands
            # in the middle of it.
            sent += [steady.send(0.05).message_id for _ in range(JOBS_PER_FAULT)]
            wait_for(
                lambda before=before: succeeded() >= before + JOBS_PER_FAULT // 5,
                120,
                f"draining to be under way before the {name} fault",
                on_timeout=workers[0].log_tail,
            )
            if fault == "crash":
                (crash_at,) = _query(url, "SELECT clock_timestamp()")[0]
            cluster.stop("immediate" if fault == "crash" else "fast")
            stopped_at = time.monotonic()
            time.sleep(outage)
            cluster.start()
            back = time.monotonic()
            (boot,) = _query(url, "SELECT pg_postmaster_start_time()")[0]
            if fault == "crash":
                # Jobs that started in the moments before the crash: their claim or their
                # outcome may be lost with it, so they may run again.
                crash_window = {
                    r[0]
                    for r in _query(
                        url,
                        f"""SELECT DISTINCT job_id::text FROM {SCHEMA}.executions
                            WHERE phase = 'start' AND at >= %s - interval '5 seconds'
                              AND at < %s""",
                        (crash_at, boot),
                    )
                }
            wait_for(
                lambda boot=boot: (
                    _query(
                        url,
                        f"SELECT count(*) FROM {SCHEMA}.executions WHERE at > %s",
                        (boot,),
                    )[0][0]
                    > 0
                ),
                30,
                f"draining to resume after the {name} fault",
                on_timeout=workers[0].log_tail,
            )
            resumed_after[name] = time.monotonic() - back
            assert time.monotonic() - stopped_at >= outage
        wait_for(
            lambda: succeeded() == len(sent),
            180,
            "every job to succeed",
            on_timeout=lambda: (
                str(_query(url, f"SELECT status, count(*) FROM {SCHEMA}.jobs GROUP BY status"))
                + "\n"
                + workers[0].log_tail()
            ),
        )
    finally:
        for worker in workers:
            worker.kill_group()
        broker.close()

    statuses = dict(_query(url, f"SELECT status, count(*) FROM {SCHEMA}.jobs GROUP BY status"))
    assert statuses == {"succeeded": len(sent)}, statuses
    starts = collections.Counter(
        r[0]
        for r in _query(url, f"SELECT job_id::text FROM {SCHEMA}.executions WHERE phase = 'start'")
    )
    assert set(starts) == set(sent), "a job never ran"
    twice = {job_id for job_id, n in starts.items() if n > 1}
    assert twice <= crash_window, (
        f"{len(twice - crash_window)} job(s) ran twice that the crash did not touch"
    )
    print(f"draining resumed after: { {k: round(v, 2) for k, v in resumed_after.items()} }")
    print(f"ran twice: {len(twice)} (started in the 5 s before the crash: {len(crash_window)})")
    slow = {name: round(s, 2) for name, s in resumed_after.items() if s > 2.0}
    assert not slow, f"draining resumed more than 2 s after the server's return: {slow}"
