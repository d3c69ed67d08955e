"""Where a message's time goes: ``python -m benchmarks.profile``.

Starts a private PostgreSQL cluster of its own (``initdb`` into a temporary directory, on
port 55441 or the next free one) with ``pg_stat_statements`` preloaded and I/O timing on,
settings no shared server is asked to change, and measures two things on it:

- send: ``--count`` ``actor.send()`` from one thread of a client process;
- drain: ``--count`` queued messages drained by one worker process x 8 threads.

For each it prints a table per message: wall time, statements (each one round trip: the
broker runs every statement in autocommit), server execution time
(``pg_stat_statements.total_exec_time``), WAL writes and flushes (``pg_stat_wal``, with
``track_wal_io_timing``), lock waits (``pg_locks`` sampled every 50 ms) and the client
process's CPU time; then the statements themselves, and, when ``py-spy`` is installed
(``pip install py-spy``; not a dependency of the project), the functions in which the
client process held the GIL (``py-spy record --gil``: the Python it ran, not its waits).
``--json`` writes everything to a file.

The cluster's other settings are PostgreSQL's defaults (``synchronous_commit = on``), so
the WAL flush of every durable commit is in the numbers. The cluster is stopped and
deleted at the end.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psycopg

from . import pgdata
from .harness import ROOT, VARIANTS, Harness

SCHEMA = "bench"
PORTS = range(55441, 55450)
CLUSTER_SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.track_planning": "on",
    "track_io_timing": "on",
    "track_wal_io_timing": "on",
    "track_functions": "pl",
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",
}


def _bindir() -> Path:
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if not candidates:
        raise SystemExit("PostgreSQL's server binaries (initdb, pg_ctl) are not installed")
    return Path(candidates[-1]).parent


class Cluster:
    """A throwaway PostgreSQL cluster in a temporary directory, owned by an unprivileged
    user when run as root (PostgreSQL refuses to run as root)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.dir = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
        self.data = self.dir / "data"
        self.bindir = _bindir()
        self.user = None
        if os.geteuid() == 0:
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def start(self) -> Cluster:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        options = " ".join(f"-c {k}={v!r}" if v == "" else f"-c {k}={v}"
                           for k, v in CLUSTER_SETTINGS.items())  # fmt: skip
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w",
                  "-o", f"-p {self.port} {options}", "start")  # fmt: skip
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        return self

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


# -- reading the server's counters -----------------------------------------------------------

_NOT_OURS = ("pg_stat", "pg_locks", "pg_settings", "pg_stat_statements", "pg_backend_pid")


def reset(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")
        conn.execute("SELECT pg_stat_reset()")
        conn.execute("SELECT pg_stat_reset_shared('wal')")


def nested(url: str) -> dict:
    """The statements run inside others (a trigger's, a function's: not round trips) and
    the PL/pgSQL functions' times (``track_functions = pl``): where a statement's own time
    goes."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, total_exec_time, rows FROM pg_stat_statements "
            "WHERE NOT toplevel AND dbid = (SELECT oid FROM pg_database "
            "WHERE datname = current_database()) "
            "ORDER BY total_exec_time DESC LIMIT 15"
        ).fetchall()
        functions = conn.execute(
            "SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions "
            "ORDER BY total_time DESC"
        ).fetchall()
    return {
        "nested": [
            {"query": " ".join(q.split())[:90], "calls": c, "total_ms": t, "rows": r}
            for q, c, t, r in rows
        ],
        "functions": [
            {"name": f, "calls": c, "total_ms": t, "self_ms": s} for f, c, t, s in functions
        ],
    }


class Activity(threading.Thread):
    """Samples, every 20 ms until stopped, what each of the worker's backends is doing
    (``pg_stat_activity`` by application name): idle (the worker's side: Python, the
    network), running a statement (its first words), or waiting (for what)."""

    def __init__(self, url: str, app: str) -> None:
        super().__init__(daemon=True, name="bench-activity")
        self.url = url
        self.app = app
        self.states: collections.Counter[str] = collections.Counter()
        self._halt = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._halt.is_set():
                for state, wait_type, wait, query in conn.execute(
                    "SELECT state, wait_event_type, wait_event, query FROM pg_stat_activity "
                    "WHERE application_name = %s",
                    (self.app,),
                ):
                    if state != "active":
                        key = state
                    else:
                        words = " ".join(query.split())
                        what = words[:60]
                        key = f"{wait_type}:{wait} " if wait_type else ""
                        key += what
                    self.states[key] += 1
                self._halt.wait(0.02)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def shares(self, limit: int = 12) -> list[tuple[str, float]]:
        total = sum(self.states.values())
        return [(k, n / total) for k, n in self.states.most_common(limit)] if total else []


def counters(url: str) -> dict:
    """Top-level statements of the broker (not the profiler's own: a statement's nested
    ones, such as foreign-key checks, are inside its time) and the WAL counters."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, total_exec_time, rows, total_plan_time, plans "
            "FROM pg_stat_statements "
            "WHERE toplevel AND dbid = (SELECT oid FROM pg_database "
            "WHERE datname = current_database()) "
            "ORDER BY total_exec_time DESC"
        ).fetchall()
        wal = conn.execute(
            "SELECT wal_records, wal_bytes, wal_write, wal_sync, wal_write_time, wal_sync_time, "
            "wal_fpi FROM pg_stat_wal"
        ).fetchone()
    statements = [
        {
            "query": " ".join(q.split())[:90],
            "calls": c,
            "total_ms": t,
            "rows": r,
            "plan_ms": plan_ms,
            "plans": plans,
        }
        for q, c, t, r, plan_ms, plans in rows
        if not any(word in q for word in _NOT_OURS)
    ]
    keys = (
        "wal_records", "wal_bytes", "wal_write", "wal_sync", "wal_write_ms", "wal_sync_ms",
        "wal_fpi",
    )  # fmt: skip
    return {"statements": statements, "wal": dict(zip(keys, (float(v) for v in wal)))}


# -- py-spy ----------------------------------------------------------------------------------


def py_spy() -> str | None:
    return shutil.which("py-spy") or (
        str(Path(sys.executable).parent / "py-spy")
        if (Path(sys.executable).parent / "py-spy").exists()
        else None
    )


def top_functions(
    raw_path: Path, limit: int = 12, within: str | None = None
) -> list[tuple[str, float]]:
    """The leaf functions of py-spy's raw samples, as shares of all samples (of those whose
    stack passes through a function named ``within``, when given)."""
    if not raw_path.exists():
        return []
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw_path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        if within and not any(f.startswith(within + " ") for f in frames):
            continue
        leaf = frames[-1]
        leaves[leaf] += int(count)
        total += int(count)
    return [(name, n / total) for name, n in leaves.most_common(limit)] if total else []


# -- the two measurements --------------------------------------------------------------------


def profile_send(harness: Harness, count: int, out_dir: Path) -> dict:
    variant = VARIANTS["postgres"]
    pgdata.empty(harness.url, SCHEMA)
    reset(harness.url)
    raw = out_dir / "send.pyspy.txt"
    args = [sys.executable, "-m", "benchmarks.client", "enqueue", "--count", str(count)]
    spy = py_spy()
    if spy:
        args = [
            spy,
            "record",
            "--format",
            "raw",
            "--rate",
            "200",
            "--gil",
            "-o",
            str(raw),
            "--",
            *args,
        ]
    done = subprocess.run(
        args, cwd=ROOT, env=harness.env(variant), capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise SystemExit(f"the send client failed:\n{done.stderr[-2000:]}")
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    stats = counters(harness.url)
    return {
        "messages": count,
        "seconds": result["seconds"],
        "cpu_s": result.get("cpu_s"),
        "lock_wait_share": None,
        **stats,
        # Only the timed sends, not the interpreter's start-up and imports.
        "py_spy": top_functions(raw, within="_send_many") if spy else None,
    }


def profile_drain(harness: Harness, count: int, out_dir: Path) -> dict:
    import psutil

    variant = VARIANTS["postgres"]
    pgdata.empty(harness.url, SCHEMA)
    pgdata.load(harness.url, SCHEMA, count, events=True)
    app = f"bench-profile-{os.getpid()}"
    sampler = pgdata.Sampler(harness.url, SCHEMA, app)
    raw = out_dir / "drain.pyspy.txt"
    spy = py_spy()
    spy_proc = None
    reset(harness.url)
    with harness.worker(variant, "profile", expect=count, PGAPPNAME=app) as (proc, state):
        pid = harness.wait_ready(proc, state)
        worker = psutil.Process(pid)
        cpu0 = sum(worker.cpu_times()[:2])
        if spy:
            spy_proc = subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
                 "--gil", "--nonblocking", "-o", str(raw)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        sampler.start()
        result = harness.wait_file(proc, os.path.join(state, "drain.json"),
                                   timeout=count / 50 + 120)  # fmt: skip
        cpu = sum(worker.cpu_times()[:2]) - cpu0
        sampler.stop()
        if spy_proc is not None:
            spy_proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy_proc.wait(30)
    stats = counters(harness.url)
    return {
        "messages": count,
        "seconds": result["done"] - result["first_start"],
        "cpu_s": cpu,
        "lock_wait_share": sampler.lock_wait_share,
        **stats,
        "py_spy": top_functions(raw) if spy else None,
    }


def profile_workflow_drain(
    harness: Harness, workflows: int, width: int, out_dir: Path, *, plain: bool = False
) -> dict:
    """The drain of ``workflows`` workflows of a step, a ``width``-wide group and a step
    (results piped, as the ``workflow`` workload runs them), or (``plain``) of as many
    plain jobs: sent first, then drained by one worker process x 8 threads while the
    server's counters, the worker's backends and the worker's Python are sampled."""
    import psutil

    variant = VARIANTS["postgres"]
    count = workflows * (width + 2)
    pgdata.empty(harness.url, SCHEMA)
    harness._empty_workflows(variant)
    if plain:
        harness.client(variant, "send", timeout=count / 50 + 60, count=count)
    else:
        harness.client(variant, "workflows", timeout=count / 50 + 60, count=workflows, width=width)
    app = f"bench-profile-{os.getpid()}"
    sampler = pgdata.Sampler(harness.url, SCHEMA, app)
    activity = Activity(harness.url, app)
    tag = "plain" if plain else "workflow"
    raw = out_dir / f"{tag}.pyspy.txt"
    spy = py_spy()
    spy_proc = None
    from . import cost

    reset(harness.url)
    meter = cost.Meter(harness.url).start()
    with harness.worker(variant, "workflow", expect=count, PGAPPNAME=app) as (proc, state):
        pid = harness.wait_ready(proc, state)
        worker = psutil.Process(pid)
        cpu0 = sum(worker.cpu_times()[:2])
        if spy:
            spy_proc = subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
                 "--gil", "--nonblocking", "-o", str(raw)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        sampler.start()
        activity.start()
        result = harness.wait_file(proc, os.path.join(state, "drain.json"),
                                   timeout=count / 20 + 120)  # fmt: skip
        cpu = sum(worker.cpu_times()[:2]) - cpu0
        phase = meter.stop()
        sampler.stop()
        activity.stop()
        if spy_proc is not None:
            spy_proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy_proc.wait(30)
    stats = counters(harness.url)
    inner = nested(harness.url)
    cost.inspect(harness.url, phase)
    pgdata.empty(harness.url, SCHEMA)
    harness._empty_workflows(variant)
    return {
        "messages": count,
        "seconds": result["done"] - result["first_start"],
        "cpu_s": cpu,
        "lock_wait_share": sampler.lock_wait_share,
        **stats,
        **inner,
        "activity": activity.shares(),
        "py_spy": top_functions(raw) if spy else None,
        # The drain's WAL by relation (pg_walinspect), full-page images apart.
        "wal_by_relation": sorted(
            (
                (name, size, size - phase.by_relation_nofpi.get(name, 0))
                for name, size in phase.by_relation.items()
            ),
            key=lambda item: -item[1],
        ),
        "wal_inspect_error": phase.inspect_error,
    }


def per_message_table(name: str, r: dict) -> str:
    n = r["messages"]
    calls = sum(s["calls"] for s in r["statements"])
    exec_ms = sum(s["total_ms"] for s in r["statements"])
    plan_ms = sum(s.get("plan_ms", 0) for s in r["statements"])
    plans = sum(s.get("plans", 0) for s in r["statements"])
    wal = r["wal"]
    us = 1000.0  # ms -> µs
    rows = [
        ("wall time (1 / rate)", f"{r['seconds'] / n * 1e6:,.0f} µs",
         f"{n / r['seconds']:,.0f} msg/s"),
        ("statements = round trips", f"{calls / n:.2f}", f"{calls:,} in all"),
        ("server execution (pg_stat_statements)", f"{exec_ms / n * us:,.0f} µs",
         "sum of total_exec_time"),
        ("server planning (pg_stat_statements)", f"{plan_ms / n * us:,.0f} µs",
         f"sum of total_plan_time; {plans / max(1, calls):.2f} plans per statement"),
        ("WAL flushes (pg_stat_wal.wal_sync)", f"{wal['wal_sync'] / n:.2f}",
         f"{wal['wal_sync_ms'] / n * us:,.0f} µs flushing a message"),
        ("WAL writes", f"{wal['wal_write'] / n:.2f}", f"{wal['wal_write_ms'] / n * us:,.0f} µs"),
        ("WAL bytes", f"{wal['wal_bytes'] / n:,.0f} B", f"{wal['wal_records'] / n:.1f} records"),
        ("WAL full-page images", f"{wal['wal_fpi'] / n:.3f}", "after each checkpoint"),
        ("lock waits (share of 50 ms samples)",
         "" if r["lock_wait_share"] is None else f"{r['lock_wait_share'] * 100:.0f} %", ""),
        ("client process CPU (Python and libpq)",
         "" if r["cpu_s"] is None else f"{r['cpu_s'] / n * 1e6:,.0f} µs", ""),
    ]  # fmt: skip
    lines = [f"### {name}: per message ({n:,} messages)", "",
             "| per message | value | note |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "| statement | calls per message | mean µs | rows per call | plans per call "
              "| mean planning µs |", "|---|---|---|---|---|---|"]  # fmt: skip
    for s in r["statements"][:8]:
        per_call = max(1, s["calls"])
        lines.append(
            f"| `{s['query'][:70]}` | {s['calls'] / n:.3f} | "
            f"{s['total_ms'] / per_call * us:,.0f} | {s['rows'] / per_call:.1f} | "
            f"{s.get('plans', 0) / per_call:.2f} | "
            f"{s.get('plan_ms', 0) / max(1, s.get('plans', 0)) * us:,.0f} |"
        )
    if r.get("nested"):
        lines += ["", "| statement inside another (a trigger's) | calls per message | mean µs |",
                  "|---|---|---|"]  # fmt: skip
        for s in r["nested"][:10]:
            per_call = max(1, s["calls"])
            lines.append(f"| `{s['query'][:70]}` | {s['calls'] / n:.3f} | "
                         f"{s['total_ms'] / per_call * us:,.0f} |")  # fmt: skip
    if r.get("functions"):
        lines += ["", "| function | calls per message | µs per message (self) |", "|---|---|---|"]
        for f in r["functions"]:
            lines.append(
                f"| `{f['name']}` | {f['calls'] / n:.3f} | "
                f"{f['total_ms'] / n * us:,.0f} ({f['self_ms'] / n * us:,.0f}) |"
            )
    if r.get("wal_by_relation"):
        lines += ["", "| the drain's WAL by relation | B per message | full-page images |",
                  "|---|---|---|"]  # fmt: skip
        for name, size, image in r["wal_by_relation"][:12]:
            lines.append(f"| `{name}` | {size / n:,.0f} | {image / n:,.0f} |")
    elif r.get("wal_inspect_error"):
        lines += ["", f"WAL by relation: {r['wal_inspect_error']}"]
    if r.get("activity"):
        lines += ["", "| the worker's backends, sampled every 20 ms | share |", "|---|---|"]
        lines += [f"| `{k[:90]}` | {share * 100:.0f} % |" for k, share in r["activity"]]
    if r.get("py_spy"):
        lines += ["", "| client function holding the GIL (py-spy --gil) | share |", "|---|---|"]
        lines += [f"| `{f[:80]}` | {share * 100:.0f} % |" for f, share in r["py_spy"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    p.add_argument("--count", type=int, default=5000, help="messages per measurement")
    p.add_argument(
        "--what",
        default="send,drain",
        help="comma-separated: send, drain, workflow (the drain of --workflows workflows of "
        "a step, a --width-wide group and a step), workflow-plain (as many plain jobs)",
    )
    p.add_argument("--workflows", type=int, default=20, help="workflows of --what workflow")
    p.add_argument("--width", type=int, default=100, help="their group's width")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a server setting of the private cluster (max_wal_size=128MB: the embedded "
        "server's); again for more",
    )
    args = p.parse_args(argv)
    from .pgbouncer import free_port

    for setting in args.setting:
        name, _, value = setting.partition("=")
        CLUSTER_SETTINGS[name.strip()] = value.strip()
    cluster = Cluster(free_port(PORTS)).start()
    out_dir = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    try:
        pgdata.reset_schema(cluster.url, SCHEMA)
        harness = Harness(cluster.url, SCHEMA, out_dir, server="private")
        results = {}
        for what in [w.strip() for w in args.what.split(",") if w.strip()]:
            if what in ("workflow", "workflow-plain"):
                results[what] = profile_workflow_drain(
                    harness, args.workflows, args.width, out_dir, plain=what != "workflow"
                )
            else:
                fn = {"send": profile_send, "drain": profile_drain}[what]
                results[what] = fn(harness, args.count, out_dir)
            print(per_message_table(what, results[what]), "\n", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        cluster.stop()
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
