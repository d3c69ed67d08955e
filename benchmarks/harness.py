"""Running the workloads: worker and client processes, flushing, measuring.

Every worker is a real ``python -m dramatiq benchmarks.actors --processes 1 --threads 8``
process group started by the harness and always stopped by it (SIGTERM, then SIGKILL of the
group after a grace period), whatever happens in between.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import pgdata
from .actors import QUEUE, RABBITMQ_URL, REDIS_NAMESPACE, REDIS_URL

ROOT = Path(__file__).resolve().parent.parent
WORKER_THREADS = 8
#: Where the benchmark's own PgBouncer listens (the first free one).
PGBOUNCER_PORTS = range(6430, 6440)
#: A worker log line that counts as an error.
ERROR_RE = re.compile(r"\b(ERROR|CRITICAL|Traceback)\b|Lost job|deadlock detected")


class BenchError(RuntimeError):
    """A workload could not be measured (a timeout, a process that died)."""


@dataclass(frozen=True)
class Variant:
    """A broker configuration taking part in the run.

    ``python``, ``code`` and ``schema`` are set for an earlier release of this broker
    (``--against``, :mod:`.release`): its processes run that release's interpreter, in a
    folder that holds only this checkout's ``benchmarks`` package (so that the release's
    own ``dramatiq_pg_broker`` is the one imported), on a schema migrated by that release."""

    name: str
    label: str
    kind: str  # postgres | redis | rabbitmq
    env: dict[str, str] = field(default_factory=dict)
    python: str | None = None
    code: str | None = None
    schema: str | None = None

    @property
    def events(self) -> bool:
        return self.env.get("DRAMATIQ_PG_EVENTS", "1") != "0"


VARIANTS = {
    "postgres": Variant(
        "postgres", "postgres (this broker)", "postgres", {"DRAMATIQ_PG_EVENTS": "1"}
    ),
    "postgres-noevents": Variant(
        "postgres-noevents", "postgres, events off", "postgres", {"DRAMATIQ_PG_EVENTS": "0"}
    ),
    "postgres-nondurable": Variant(
        "postgres-nondurable",
        "postgres, durable=False",
        "postgres",
        {"DRAMATIQ_PG_EVENTS": "1", "DRAMATIQ_PG_DURABLE_SENDS": "false"},
    ),
    # The notify workload's comparisons (benchmarks/notify.py).
    "postgres-notify-statement": Variant(
        "postgres-notify-statement",
        "postgres, NOTIFY in every send's statement",
        "postgres",
        {"DRAMATIQ_PG_EVENTS": "1", "DRAMATIQ_PG_NOTIFY_SENDS": "statement"},
    ),
    "postgres-notify-off": Variant(
        "postgres-notify-off",
        "postgres, no NOTIFY",
        "postgres",
        {"DRAMATIQ_PG_EVENTS": "1", "DRAMATIQ_PG_NOTIFY_SENDS": "off"},
    ),
    "redis": Variant("redis", "redis (dramatiq)", "redis"),
    "rabbitmq": Variant("rabbitmq", "rabbitmq (dramatiq)", "rabbitmq"),
}


def reachable(kind: str) -> bool:
    """Whether the local Redis or RabbitMQ answers (PostgreSQL is always required)."""
    try:
        if kind == "redis":
            import redis

            return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping())
        if kind == "rabbitmq":
            import pika

            params = pika.URLParameters(RABBITMQ_URL)
            params.socket_timeout = 2
            params.blocked_connection_timeout = 2
            pika.BlockingConnection(params).close()
            return True
    except Exception:
        return False
    return True


class Harness:
    """Runs the workloads against one PostgreSQL server (``url``), named ``server`` in the
    results (``embedded`` or ``tcp``); Redis and RabbitMQ are the same for every server."""

    def __init__(
        self, url: str, schema: str, out_dir: Path, verbose: bool = False, server: str = "tcp"
    ) -> None:
        self.url = url
        self.schema = schema
        self.out_dir = out_dir
        self.verbose = verbose
        self.server = server
        self.log_dir = out_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        #: Whether this server's WAL can be read back (``pg_walinspect``, :mod:`.cost`).
        self.walinspect = True

    # -- environment ---------------------------------------------------------------------

    def env(
        self, variant: Variant, schema: str | None = None, *, url: str | None = None, **extra: str
    ) -> dict[str, str]:
        env = dict(os.environ)
        env.update(variant.env)
        env.update(
            BENCH_BROKER=variant.kind,
            DRAMATIQ_PG_URL=url or self.url,
            DRAMATIQ_PG_SCHEMA=schema or variant.schema or self.schema,
            # An earlier release's processes see its code folder alone: an inherited
            # PYTHONPATH may name this checkout, whose package would win.
            PYTHONPATH=variant.code
            or os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        )
        env.update(extra)
        return env

    def log(self, text: str) -> None:
        if self.verbose:
            print(f"    {text}", flush=True)

    # -- flushing ------------------------------------------------------------------------

    def flush(self, variant: Variant, schema: str | None = None) -> None:
        """Empty the broker's benchmark queue (and delay queue) completely."""
        if variant.kind == "postgres":
            pgdata.empty(self.url, schema or variant.schema or self.schema)
        elif variant.kind == "redis":
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            keys = list(client.scan_iter(match=f"{REDIS_NAMESPACE}:*", count=1000))
            for start in range(0, len(keys), 1000):
                client.delete(*keys[start : start + 1000])
            client.close()
        elif variant.kind == "rabbitmq":
            import pika

            conn = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
            try:
                channel = conn.channel()
                for name in (QUEUE, f"{QUEUE}.DQ", f"{QUEUE}.XQ"):
                    channel.queue_delete(name)
            finally:
                conn.close()

    # -- client steps --------------------------------------------------------------------

    def client(
        self, variant: Variant, step: str, timeout: float, state: str | None = None, **options
    ) -> dict:
        """Run one ``benchmarks.client`` step in its own process; returns its JSON."""
        args = [variant.python or sys.executable, "-m", "benchmarks.client", step]
        for key, value in options.items():
            args += [f"--{key}", str(value)]
        env = self.env(variant, **({"BENCH_STATE_DIR": state} if state else {}))
        try:
            done = subprocess.run(
                args, cwd=variant.code or ROOT, env=env, capture_output=True, text=True,
                timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:
            raise BenchError(f"client step {step} timed out after {timeout:.0f}s") from e
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-3:]
            raise BenchError(f"client step {step} failed: {' | '.join(tail)}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    # -- workers -------------------------------------------------------------------------

    def log_path(self, variant: Variant, tag: str) -> Path:
        server = f"-{self.server}" if variant.kind == "postgres" else ""
        return self.log_dir / f"worker-{variant.name}{server}-{tag}.log"

    @contextlib.contextmanager
    def worker(
        self,
        variant: Variant,
        tag: str,
        *,
        schema: str | None = None,
        expect: int = 0,
        processes: int = 1,
        threads: int = WORKER_THREADS,
        url: str | None = None,
        extra_env: dict[str, str] | None = None,
        **extra: str,
    ) -> Iterator[tuple[subprocess.Popen, str]]:
        """A running worker process group and its state directory; stopped on exit."""
        state = tempfile.mkdtemp(prefix="bench-state-")
        env = self.env(
            variant, schema, url=url, BENCH_STATE_DIR=state, BENCH_EXPECT=str(expect), **extra
        )
        env.update(extra_env or {})
        log_path = self.log_path(variant, tag)
        args = [
            variant.python or sys.executable, "-m", "dramatiq", "benchmarks.actors",
            "--processes", str(processes), "--threads", str(threads),
        ]  # fmt: skip
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                args, cwd=variant.code or ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        try:
            yield proc, state
        finally:
            self._stop(proc)
            shutil.rmtree(state, ignore_errors=True)

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        # The group holds the worker's children too; make sure none survives.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    @staticmethod
    def wait_ready(proc: subprocess.Popen, state: str, timeout: float = 60) -> int:
        """Wait for the worker process to boot; returns its pid."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = glob.glob(os.path.join(state, "ready-*.json"))
            if found:
                with open(found[0]) as f:
                    return int(json.load(f)["pid"])
            if proc.poll() is not None:
                raise BenchError(f"worker exited with code {proc.returncode} before booting")
            time.sleep(0.05)
        raise BenchError(f"worker did not boot within {timeout:.0f}s")

    @staticmethod
    def wait_all_ready(proc: subprocess.Popen, state: str, count: int, timeout: float) -> None:
        """Wait for ``count`` worker processes of one ``dramatiq`` command to boot."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(glob.glob(os.path.join(state, "ready-*.json"))) >= count:
                return
            if proc.poll() is not None:
                raise BenchError(f"worker exited with code {proc.returncode} before booting")
            time.sleep(0.05)
        raise BenchError(f"{count} worker processes did not boot within {timeout:.0f}s")

    @staticmethod
    def wait_file(proc: subprocess.Popen, path: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(path):
                with open(path) as f:
                    return json.load(f)
            if proc.poll() is not None:
                raise BenchError(f"worker exited with code {proc.returncode}")
            time.sleep(0.02)
        raise BenchError(f"no result within {timeout:.0f}s")

    # -- workloads -----------------------------------------------------------------------

    def enqueue(self, variant: Variant, count: int) -> dict:
        self.flush(variant)
        try:
            result = self.client(variant, "enqueue", timeout=count / 100 + 60, count=count,
                                 warmup=200)  # fmt: skip
        finally:
            self.flush(variant)
        return {"rate": result["rate"]}

    def enqueue_threads(self, variant: Variant, count: int, threads: int = 8) -> dict:
        """``count`` sends from ``threads`` threads of one process at once."""
        self.flush(variant)
        try:
            result = self.client(variant, "enqueue-threads", timeout=count / 100 + 60,
                                 count=count, threads=threads, warmup=200)  # fmt: skip
        finally:
            self.flush(variant)
        return {"rate": result["rate"]}

    def bulk(self, variant: Variant, count: int) -> dict:
        """One ``broker.enqueue_many()`` of ``count`` messages (this broker only)."""
        self.flush(variant)
        try:
            result = self.client(variant, "bulk", timeout=count / 500 + 120, count=count,
                                 warmup=1000)  # fmt: skip
        finally:
            self.flush(variant)
        return {"rate": result["rate"]}

    def raw_copy(self, count: int) -> dict:
        return {"rate": pgdata.raw_copy_rate(self.url, self.schema, count)}

    def latency_floor(self, count: int, gap: float) -> dict:
        """PostgreSQL's own floor of the latency workload (:mod:`.floor`), on this server."""
        from . import floor

        return floor.latency(self.url, self.schema, count, gap)

    def raw_insert(self, count: int, *, autocommit: bool = False) -> dict:
        rate = pgdata.raw_insert_rate(self.url, self.schema, count, autocommit=autocommit)
        return {"rate": rate}

    def fill(self, variant: Variant, count: int, *, delay_s: float = -1.0) -> None:
        """Put ``count`` messages on the queue (delayed by ``delay_s`` when positive)."""
        if variant.kind == "postgres":
            pgdata.load(self.url, variant.schema or self.schema, count, delay_s=delay_s,
                        events=variant.events)  # fmt: skip
        elif delay_s > 0:
            self.client(variant, "delayed", timeout=count / 100 + 60, count=count)
        else:
            self.client(variant, "send", timeout=count / 100 + 60, count=count)

    def drain(self, variant: Variant, count: int, *, schema: str | None = None,
              prepared: bool = False, tag: str = "drain",
              extra_env: dict[str, str] | None = None) -> dict:  # fmt: skip
        """Time one worker processing ``count`` queued messages. ``prepared``: the queue
        was filled by the caller (the backlog workload). ``extra_env``: more variables for
        the worker."""
        if not prepared:
            self.flush(variant)
            self.fill(variant, count)
        try:
            with self.worker(variant, tag, schema=schema, expect=count, extra_env=extra_env) as (
                proc,
                state,
            ):
                self.wait_ready(proc, state)
                result = self.wait_file(proc, os.path.join(state, "drain.json"),
                                        timeout=count / 100 + 60)  # fmt: skip
        finally:
            if not prepared:
                self.flush(variant)
        seconds = result["done"] - result["first_start"]
        return {"rate": count / seconds, "seconds": seconds}

    def latency(self, variant: Variant, count: int, gap: float) -> dict:
        self.flush(variant)
        try:
            with self.worker(variant, "latency") as (proc, state):
                self.wait_ready(proc, state)
                time.sleep(1.0)  # let every consumer settle into its idle wait
                self.client(variant, "latency", timeout=count * gap + 60, state=state, count=count,
                            gap=gap)  # fmt: skip
                path = os.path.join(state, "latency.txt")
                deadline = time.monotonic() + 30
                samples: list[float] = []
                while time.monotonic() < deadline:
                    if os.path.exists(path):
                        with open(path) as f:
                            samples = [float(line) for line in f if line.strip()]
                        if len(samples) >= count:
                            break
                    time.sleep(0.05)
                if len(samples) < count:
                    raise BenchError(f"only {len(samples)} of {count} latency samples arrived")
        finally:
            self.flush(variant)
        samples.sort()
        return {"p50_ms": percentile(samples, 50) * 1000, "p99_ms": percentile(samples, 99) * 1000}

    def life(self, variant: Variant, count: int) -> dict:
        """A job's whole life, at the server (this broker only, :mod:`.cost`): WAL bytes
        and server CPU per job of ``count`` jobs sent one at a time from one thread
        (``actor.send()`` in a client process, no worker running: the send phase), then
        drained by one worker process x 8 threads (from before its start to the last
        outcome written: the drain phase). The WAL is read back before the tables are
        emptied (emptying them renames their files)."""
        from . import cost

        self.flush(variant)
        phases: list[cost.Phase] = []
        try:
            meter = cost.Meter(self.url).start()
            self.client(variant, "send", timeout=count / 50 + 60, count=count)
            phases.append(sent := meter.stop())
            if self.walinspect:
                cost.inspect(self.url, sent)
            meter = cost.Meter(self.url).start()
            with self.worker(variant, "life", expect=count) as (proc, state):
                self.wait_ready(proc, state)
                self.wait_file(proc, os.path.join(state, "drain.json"), timeout=count / 50 + 60)
                phases.append(drained := meter.stop())
            if self.walinspect:
                cost.inspect(self.url, drained)
        finally:
            for phase in phases:
                phase.release()
            self.flush(variant)
        return {**cost.figures(count, sent, drained), "notes": cost.notes(sent, drained)}

    def workflow_life(self, variant: Variant, workflows: int, width: int, plain: bool) -> dict:
        """The whole life of the jobs of ``workflows`` workflows of three steps (one job, a
        ``width``-wide group, one job), or (``plain``) of as many plain jobs: sent from
        one client thread (a workflow at a time, each one transaction; a plain job at a
        time), then drained by one worker process x 8 threads. Per job: the microseconds
        of the send and of the drain (the worker's first start to its last outcome
        written), and the WAL of both phases (:mod:`.cost`)."""
        from . import cost

        count = workflows * (width + 2)
        self.flush(variant)
        self._empty_workflows(variant)
        phases: list[cost.Phase] = []
        try:
            meter = cost.Meter(self.url).start()
            if plain:
                sent_out = self.client(variant, "send", timeout=count / 50 + 60, count=count)
            else:
                sent_out = self.client(
                    variant, "workflows", timeout=count / 50 + 60, count=workflows, width=width
                )
            phases.append(sent := meter.stop())
            if self.walinspect:
                cost.inspect(self.url, sent)
            meter = cost.Meter(self.url).start()
            with self.worker(variant, "workflow", expect=count) as (proc, state):
                self.wait_ready(proc, state)
                done = self.wait_file(proc, os.path.join(state, "drain.json"), count / 20 + 60)
                phases.append(drained := meter.stop())
            if self.walinspect:
                cost.inspect(self.url, drained)
        finally:
            for phase in phases:
                phase.release()
            self.flush(variant)
            self._empty_workflows(variant)
        drain_s = done["done"] - done["first_start"]
        figures = cost.figures(count, sent, drained)
        return {
            "job_us": (sent_out["seconds"] + drain_s) / count * 1e6,
            "send_us": sent_out["seconds"] / count * 1e6,
            "drain_us": drain_s / count * 1e6,
            "wal_raw_b": figures["wal_raw_b"],
            "wal_send_raw_b": figures["wal_send_raw_b"],
            "wal_drain_raw_b": figures["wal_drain_raw_b"],
            **{k: figures[k] for k in ("wal_b", "wal_nofpi_b", "cpu_us") if k in figures},
        }

    def _empty_workflows(self, variant: Variant) -> None:
        import psycopg
        from psycopg import sql

        schema = variant.schema or self.schema
        with psycopg.connect(self.url, autocommit=True) as conn:
            if conn.execute("SELECT to_regclass(%s)", (f"{schema}.workflows",)).fetchone()[0]:
                conn.execute(
                    sql.SQL("TRUNCATE {} CASCADE").format(sql.Identifier(schema, "workflows"))
                )

    def life_floor(self, count: int) -> dict:
        """The floor of a job's whole life on this server (:func:`.floor.life`)."""
        from . import floor

        return floor.life(self.url, self.schema, count, inspect=self.walinspect)

    def memory(self, variant: Variant, delayed: int, settle: float) -> dict:
        """Worker RSS after ``settle`` seconds: idle, then with ``delayed`` delayed messages."""
        import psutil

        out = {}
        for label, count in (("idle_mb", 0), ("delayed_mb", delayed)):
            self.flush(variant)
            try:
                if count:
                    self.fill(variant, count, delay_s=3600)
                with self.worker(variant, f"memory-{label}") as (proc, state):
                    pid = self.wait_ready(proc, state)
                    time.sleep(settle)
                    if proc.poll() is not None:
                        raise BenchError("worker died while settling")
                    out[label] = psutil.Process(pid).memory_info().rss / 2**20
            finally:
                self.flush(variant)
        out["growth"] = out["delayed_mb"] / out["idle_mb"] - 1
        return out


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), math.ceil(pct / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


# -- many processes, a pooler, an idle worker (this broker only) ---------------------------


#: Seconds between loading a group drain's messages and their becoming runnable: the load
#: and its VACUUM, plus a poll interval, plus a margin.
GROUP_START_DELAY = 4.0


def group_drain(
    harness: Harness,
    variant: Variant,
    count: int,
    processes: int,
    threads: int = 2,
    pool_size: int | None = None,
) -> dict:
    """Time ``processes`` worker processes x ``threads`` draining ``count`` queued messages,
    directly or, with ``pool_size``, through a PgBouncer in transaction mode started for
    this step (``pool_size`` server connections; the workers in ``listen=False`` mode
    without prepared statements, as the deployment guide says).

    The messages are loaded once every process has booted, runnable
    :data:`GROUP_START_DELAY` seconds later, so that the processes start together. The
    clock is the server's: from the first claim (``min(started_at)``) to the last
    outcome written (``max(finished_at)``). While the workers run, a sampler reads
    ``pg_locks`` (lock waits of the workers' backends) and ``pg_stat_activity`` (their
    server-side connections). Deadlocks: the ``pg_stat_database`` delta of the database
    (any session of it, so on a shared server other work counts too) and the worker logs'
    ``deadlock detected`` lines.
    """
    from . import pgbouncer

    url = harness.url
    tag = f"{'pgbouncer' if pool_size else 'direct'}-{processes}p"
    if pool_size is None:
        free = pgdata.free_connections(url)
        need = processes * pgdata.CONNECTIONS_PER_PROCESS
        if need + pgdata.CONNECTIONS_LEFT > free:
            raise BenchError(
                f"skipped: {processes} processes open ~{need} connections and the server has "
                f"{free} free; not run, to leave {pgdata.CONNECTIONS_LEFT} to other sessions"
            )
    elif pgbouncer.binary() is None:
        raise BenchError("skipped: pgbouncer is not installed (apt-get install pgbouncer)")
    harness.flush(variant)
    pooler = None
    sampler = None
    log_path = harness.log_path(variant, tag)
    try:
        if pool_size:
            pooler = pgbouncer.PgBouncer(
                url, pool_size=pool_size, port=pgbouncer.free_port(PGBOUNCER_PORTS)
            ).start()
            app = pooler.tag
            extra = {"DRAMATIQ_PG_LISTEN": "false", "DRAMATIQ_PG_PREPARED_STATEMENTS": "false"}
        else:
            # libpq's PGAPPNAME marks the workers' own connections for the sampler (through
            # the pooler, the server connections carry the pooler's name instead).
            app = f"dramatiq-bench-{os.getpid()}-{tag}"
            extra = {"PGAPPNAME": app}
        deadlocks_before = pgdata.deadlocks(url)
        sampler = pgdata.Sampler(url, harness.schema, app, pooler=pooler)
        worker_url = pooler.url if pooler else None
        with harness.worker(
            variant, tag, processes=processes, threads=threads, url=worker_url, **extra
        ) as (proc, state):
            harness.wait_all_ready(proc, state, processes, timeout=60 + 10 * processes)
            # The messages go in once every process has booted, runnable a few seconds
            # later: each idle consumer polls at least once meanwhile (every poll interval,
            # through the pooler too) and learns when they become due, so all processes
            # start together, and no process's boot runs inside the timed drain.
            harness.fill(variant, count, delay_s=GROUP_START_DELAY)
            sampler.start()
            deadline = time.monotonic() + count / 50 + 120
            while sampler.unfinished != 0:
                if proc.poll() is not None:
                    raise BenchError(f"worker exited with code {proc.returncode}")
                if sampler.error:
                    raise BenchError(f"sampling failed: {sampler.error}")
                if time.monotonic() > deadline:
                    raise BenchError(f"{sampler.unfinished} of {count} jobs left at the timeout")
                time.sleep(0.05)
            sampler.stop()
        if pooler is not None:
            pooler.stop()
        outcome = pgdata.drain_outcome(url, harness.schema)
        # A backend reports its counters when it exits: wait for the workers' to be gone.
        deadlocks = pgdata.deadlocks(url, settle_app=app) - deadlocks_before
    finally:
        if sampler is not None:
            sampler.stop()
        if pooler is not None:
            pooler.stop()
            pooler.cleanup()
        harness.flush(variant)
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    error_lines = [line for line in log.splitlines() if ERROR_RE.search(line)]
    if error_lines:
        harness.log(f"{len(error_lines)} error line(s) in {log_path}: {error_lines[0][:200]}")
    seconds = outcome["seconds"] or float("nan")
    result = {
        "rate": outcome["succeeded"] / seconds,
        "seconds": seconds,
        "lost": float(count - outcome["succeeded"]),
        "extra_claims": float(max(0, outcome["claims"] - count)) if variant.events else 0.0,
        "deadlocks": float(deadlocks),
        "deadlocks_logged": float(log.count("deadlock detected")),
        "lock_wait_share": sampler.lock_wait_share,
        "max_lock_waiters": float(sampler.max_waiters),
        "max_server_connections": float(sampler.max_connections),
        "log_errors": float(len(error_lines)),
    }
    if pooler is not None:
        result["max_client_connections"] = float(sampler.max_clients)
        result["pool_size"] = float(pool_size)
    return result


def idle_cost(
    harness: Harness, variant: Variant, queues: int, seconds: float, database: str
) -> dict:
    """Statements an idle worker with ``queues`` queues issues per queue per poll interval.

    The worker runs alone, on an empty schema in a database of its own (created for the
    measurement and dropped after), and counts the statements it sends itself
    (``BENCH_COUNT_STATEMENTS``: every psycopg ``execute``, the statements the server's log
    would show), reporting the count five times a second. The start-up statements (schema
    check, LISTENs, the first reaper run, the first claims) are left out: the count is
    taken :data:`IDLE_SETTLE` seconds after the worker booted and again ``seconds`` later,
    and the rate is the difference per poll interval, by the worker's own clock. Every
    statement counts, the reaper's included. The window is counted in whole poll intervals
    (its length rounded to the nearest): the counts are reported five times a second, so
    a window of 20 polls may measure 19.9 s, and 60 statements of 3 queues in it are one
    per queue per interval, not 1.005.
    """
    from dramatiq_pg_broker.config import Settings

    poll = Settings.load().poll_interval
    url = pgdata.create_database(harness.url, database)
    try:
        from dramatiq_pg_broker.migrate import migrate

        migrate(url, harness.schema)
        with harness.worker(variant, "idle", url=url, threads=2, BENCH_QUEUES=str(queues),
                            BENCH_COUNT_STATEMENTS="1") as (proc, state):  # fmt: skip
            pid = harness.wait_ready(proc, state)
            path = os.path.join(state, f"statements-{pid}.json")
            time.sleep(IDLE_SETTLE)
            first = _read_count(path)
            time.sleep(seconds)  # the idle period being measured
            last = _read_count(path)
            if proc.poll() is not None:
                raise BenchError("the idle worker died")
    finally:
        pgdata.drop_database(harness.url, database)
    sent = last["statements"] - first["statements"]
    intervals = max(1, round((last["at"] - first["at"]) / poll))
    return {
        "statements": float(sent),
        "startup_statements": float(first["statements"]),
        "seconds": last["at"] - first["at"],
        "poll_interval_s": poll,
        "per_queue_per_poll": sent / queues / intervals,
    }


#: Seconds an idle worker runs after booting before its statements are counted.
IDLE_SETTLE = 3.0


def _read_count(path: str) -> dict:
    """The statement count a worker last reported (see :func:`idle_cost`)."""
    for _ in range(50):
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            time.sleep(0.1)
    raise BenchError("the idle worker did not report its statement count")
