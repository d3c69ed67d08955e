"""The demo: ``make demo`` (``python -m demo_actors.run``).

Starts everything a newcomer needs to see the broker work, on one machine:

1. the database: ``DRAMATIQ_PG_URL`` if set, else a local PostgreSQL from ``pgserver``;
2. the migrations;
3. a demo admin account for the API (``demo@example.com`` / ``demo-password``);
4. ``dramatiq demo_actors --processes 2 --threads 4`` (the workers);
5. the admin API under gunicorn (http://127.0.0.1:8000/api/docs by default);
6. a mix of demo jobs, whose progress it prints until each reaches its end state.

Ctrl-C stops the workers (gracefully) and the API. ``--exit-when-done`` stops everything
once the jobs have finished and exits non-zero if any job ended in the wrong state.

The demo shortens the lease (5 s), the reaper interval (1 s), the retry backoff and the
bound on interruptions (2) so that timeouts and retries happen within a minute; a
deployment keeps the defaults.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DEMO_EMAIL = "demo@example.com"
DEMO_PASSWORD = "demo-password"

#: Settings that make the demo's timeouts and retries visible within a minute.
DEMO_ENV = {
    "DRAMATIQ_PG_LEASE_SECONDS": "5",
    "DRAMATIQ_PG_REAPER_INTERVAL": "1",
    "DRAMATIQ_PG_BACKOFF_BASE_MS": "1000",
    "DRAMATIQ_PG_BACKOFF_MAX_MS": "8000",
    # demo.timeout is interrupted (its lease expires) rather than failed: end it after two
    # interruptions instead of the default ten, so it fails within the demo's minute.
    "DRAMATIQ_PG_MAX_INTERRUPTIONS": "2",
}

#: actor name -> the status its demo jobs must end in.
EXPECTED = {
    "demo.success": "succeeded",
    "demo.fail": "failed",
    "demo.slow": "succeeded",
    "demo.timeout": "failed",
    "demo.flaky": "succeeded",
}

REPO = Path(__file__).resolve().parent.parent
#: Where the workers and the API log, each run replacing the last one's (git-ignored).
LOGS = REPO / ".demo-logs"


def shown(path: str) -> str:
    """A path as the user reads it: relative to the working directory when inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free local port")


def send_demo_jobs() -> list[str]:
    import demo_actors as demo

    sent = [demo.success.send(f"hello {i}") for i in range(10)]
    sent += [demo.fail.send("a failure on purpose") for _ in range(2)]
    sent += [demo.slow.send(4.0, 4) for _ in range(2)]
    sent.append(demo.timeout.send(12.0))
    sent += [demo.flaky.send(n) for n in (2, 3, 3)]
    sent.append(demo.success.send_with_options(args=("delayed by 3 s",), delay=3000))
    sent.append(demo.success.send_with_options(args=("low priority",), priority=10))
    first = demo.success.send_with_options(args=("once",), idempotency_key="demo-once")
    again = demo.success.send_with_options(args=("twice?",), idempotency_key="demo-once")
    print(
        f"idempotency: the second send returned job {again.message_id[:8]} (the first one)"
        if again.message_id == first.message_id
        else "idempotency key was ignored!"
    )
    sent.append(first)
    return [m.message_id for m in sent]


def job_rows(url: str, schema: str, ids: list[str]) -> list[tuple]:
    import psycopg
    from psycopg import sql

    with psycopg.connect(url) as conn:
        return conn.execute(
            sql.SQL(
                "SELECT id, actor_name, status, attempts, max_attempts, coalesce(last_error, '') "
                "FROM {}.all_jobs WHERE id = ANY(%s::uuid[]) ORDER BY created_at"
            ).format(sql.Identifier(schema)),
            (ids,),
        ).fetchall()


def summary(rows: list[tuple]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row[2]] = counts.get(row[2], 0) + 1
    order = ("queued", "running", "succeeded", "failed", "cancelled")
    return "  ".join(f"{status}={counts.get(status, 0)}" for status in order)


def schedule_line(url: str, schema: str) -> str:
    """The demo schedule at work: how many jobs its ticks made, the last tick, the next."""
    import psycopg
    from psycopg import sql

    from dramatiq_pg_broker.cli.jobs import relative
    from dramatiq_pg_broker.history.periodic import list_schedules

    with psycopg.connect(url, autocommit=True) as conn:
        rows = [r for r in list_schedules(conn, schema) if r["name"] == "demo.tick"]
        ticks = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.all_jobs WHERE actor_name = %s").format(
                sql.Identifier(schema)
            ),
            ("demo.tick",),
        ).fetchone()[0]
    if not rows:
        return "schedule demo.tick: not registered yet"
    row = rows[0]
    return (
        f"schedule demo.tick ({row['trigger']}): {ticks} job(s), last tick "
        f"{relative(row['last_tick']) or 'never'}, next run {relative(row['next_run'])}"
    )


def print_table(rows: list[tuple]) -> None:
    print(f"\n{'job':<10}{'actor':<14}{'status':<11}{'attempts':<10}last error")
    for job_id, actor, status, attempts, max_attempts, error in rows:
        print(
            f"{str(job_id)[:8]:<10}{actor:<14}{status:<11}{attempts}/{max_attempts:<8}{error[:60]}"
        )


def create_demo_account(env: dict[str, str]) -> bool:
    command = [
        sys.executable, "-m", "dramatiq_pg_broker", "user", "create",
        "--email", DEMO_EMAIL, "--password", DEMO_PASSWORD, "--role", "admin", "--exists-ok",
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        print(f"(could not create the demo account: {result.stderr.strip() or result.stdout})")
    return result.returncode == 0


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the dramatiq-pg-broker demo.")
    parser.add_argument("--port", type=int, default=int(os.environ.get("DEMO_PORT", "8000")))
    parser.add_argument(
        "--exit-when-done",
        action="store_true",
        help="stop once the demo jobs finished (exit 1 on a wrong end state)",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for the demo jobs"
    )
    parser.add_argument(
        "--logs",
        default=str(LOGS),
        help="folder of the workers' and the API's logs (default: .demo-logs in the project)",
    )
    args = parser.parse_args(argv)

    for key, value in DEMO_ENV.items():
        os.environ.setdefault(key, value)
    from dramatiq_pg_broker import Settings
    from dramatiq_pg_broker.db import resolve_url
    from dramatiq_pg_broker.migrate import migrate

    settings = Settings.load()
    where = "DRAMATIQ_PG_URL" if settings.url else "the embedded PostgreSQL (pgserver)"
    print(f"database: {where}")
    url = resolve_url(settings)
    os.environ["DRAMATIQ_PG_URL"] = url
    applied = migrate(url, settings.schema)
    print(f"migrations: {len(applied)} applied to schema {settings.schema!r}")

    env = dict(os.environ)
    # The logs stay in the project (git-ignored), each run replacing the last one's; never
    # in the system's temporary folder, where every run used to leave a folder behind.
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    has_account = create_demo_account(env)
    processes: list[subprocess.Popen] = []
    try:
        worker_log = open(logs / "worker.log", "w")  # noqa: SIM115 - closed with the process
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "demo_actors", "--processes", "2", "--threads", "4"],
            env=env, cwd=REPO, stdout=worker_log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
        print(
            "workers: dramatiq demo_actors --processes 2 --threads 4 "
            f"(log: {shown(worker_log.name)})"
        )

        port = free_port(args.port)
        api_log = open(logs / "api.log", "w")  # noqa: SIM115
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "python:admin_api.gunicorn_conf",
             "--bind", f"127.0.0.1:{port}", "admin_api.wsgi:app"],
            env=env, cwd=REPO, stdout=api_log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
        print(f"admin API: http://127.0.0.1:{port}/api/docs (log: {shown(api_log.name)})")
        print(f"dashboard: http://127.0.0.1:{port}/dashboard")
        if has_account:
            print(f"  log in with {DEMO_EMAIL} / {DEMO_PASSWORD}, e.g.")
            print(
                "  curl -c cookies -H 'Content-Type: application/json' "
                "-H 'X-Requested-With: curl' -d "
                f'\'{{"email": "{DEMO_EMAIL}", "password": "{DEMO_PASSWORD}"}}\' '
                f"http://127.0.0.1:{port}/api/auth/login"
            )

        ids = send_demo_jobs()
        print(f"sent {len(ids)} demo jobs\n")
        deadline = time.monotonic() + args.timeout
        rows = job_rows(url, settings.schema, ids)
        while time.monotonic() < deadline:
            rows = job_rows(url, settings.schema, ids)
            print(f"  {summary(rows)}   {schedule_line(url, settings.schema)}", flush=True)
            finished = [row for row in rows if row[2] in ("succeeded", "failed", "cancelled")]
            if len(finished) == len(set(ids)):
                break
            if any(p.poll() is not None for p in processes):
                print("a demo process exited early; see its log")
                break
            time.sleep(2)
        print_table(rows)
        if rows:
            failed = [r for r in rows if r[2] == "failed"] or rows
            command = os.path.relpath(Path(sys.executable).parent / "dramatiq-pg-broker")
            print(
                f"\n  {command} jobs show {str(failed[0][0])[:8]}   (a job's row and timeline: "
                "the first 8 characters of its id are enough)"
            )
        print(f"\n{schedule_line(url, settings.schema)}")
        print("  (dramatiq-pg-broker schedules lists every schedule; jobs list --actor demo.tick)")
        # Every job sent must be there (unfinished in jobs, finished in history: the view
        # all_jobs reads both) and in its expected end state.
        missing = len(set(ids)) - len(rows)
        wrong = [r for r in rows if EXPECTED.get(r[1]) != r[2]] + [None] * missing
        if wrong:
            print(f"\n{len(wrong)} job(s) did not reach their expected end state")
        else:
            print("\nevery demo job reached its expected end state")
        if args.exit_when_done:
            return 1 if wrong else 0
        print("\nworkers and API keep running; press Ctrl-C to stop")
        while all(p.poll() is None for p in processes):
            time.sleep(1)
        return 0
    except KeyboardInterrupt:
        print("\nstopping...")
        return 0
    finally:
        stop(processes)
        if not settings.url:
            print(
                "the embedded PostgreSQL keeps running for the next demo or test run; "
                "make stop (or dramatiq-pg-broker embedded stop) stops it"
            )


if __name__ == "__main__":
    sys.exit(main())
