"""``dramatiq-pg-broker doctor`` against real PostgreSQL: each condition it reports is made
for real (a held snapshot, an idle transaction holding a job row, a dead worker's expired
lease, a queue nobody consumes, rows in a DEFAULT partition, a missing partition, a
replication slot, autovacuum off, a schema behind the code), and the test checks what it
prints and its exit status; a healthy database exits 0."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import uuid

import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker.config import Settings
from dramatiq_pg_broker.health.doctor import CHECKS, Thresholds, examine
from dramatiq_pg_broker.history.retention import prune_with_settings
from dramatiq_pg_broker.jobs import JobStore, NewJob

from ..helpers import server_up_for, wait_for
from .harness import declared_queue

pytestmark = pytest.mark.timeout(120)

#: The jobs table's dead rows, summed over its lanes (0028).
DEAD_ROWS = (
    "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables"
    " WHERE relid IN (SELECT relid FROM pg_partition_tree(to_regclass(%s)) WHERE isleaf)"
)


def enqueue(store: JobStore, queue: str) -> str:
    job_id = str(uuid.uuid4())
    store.enqueue(
        NewJob(job_id, queue, "tests.a", message={"args": [], "kwargs": {}}, max_attempts=21)
    )
    return job_id


def register_worker(conn, schema: str, queues: list[str], *, live: bool = True) -> str:
    """A worker process's registry row: live (its lease ahead) or stale (expired)."""
    worker_id = f"host:{uuid.uuid4().int % 100000}:{uuid.uuid4().hex[:8]}"
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.workers (id, host, pid, queues, expires_at, connections) "
            "VALUES (%s, 'host', 1, %s, now() + %s * interval '1 second', 11)"
        ).format(sql.Identifier(schema)),
        (worker_id, queues, 60 if live else -60),
    )
    return worker_id


@pytest.fixture(autouse=True)
def clean(conn, schema):
    """Every test starts and leaves the module's schema without jobs or workers."""
    tables = sql.SQL("TRUNCATE {0}.jobs, {0}.workers CASCADE").format(sql.Identifier(schema))
    conn.execute(tables)
    yield
    conn.execute(tables)


@pytest.fixture
def session(pg_url):
    """Open other sessions (``session(application_name)``), closed afterwards."""
    opened = []

    def open_session(application: str = "report") -> psycopg.Connection:
        c = psycopg.connect(pg_url, autocommit=True, application_name=application)
        opened.append(c)
        return c

    yield open_session
    for c in opened:
        c.close()


@pytest.fixture(scope="module")
def autovacuum_on(pg_url) -> bool:
    """Whether the server runs autovacuum: a CI server may be configured without it, and
    then the hot table's finding is that problem, whatever else a test makes."""
    with psycopg.connect(pg_url, autocommit=True) as c:
        return c.execute("SHOW autovacuum").fetchone()[0] == "on"


@pytest.fixture
def run(run, autovacuum_on):
    """The command line; on a server without autovacuum, ``doctor`` with no ``--check``
    runs every check but the hot table's (a test about another condition is not to fail
    on the server's configuration; the hot table's own tests name their check)."""
    if autovacuum_on:
        return run

    def without_hot_table(*args: str):
        if args[:1] == ("doctor",) and "--check" not in args:
            others = [name for name in CHECKS if name != "hot_table"]
            args = (*args, *(a for name in others for a in ("--check", name)))
        return run(*args)

    return without_hot_table


def doctor_json(run, *args: str) -> tuple[int, dict]:
    code, out, err = run("doctor", "--json", *args)
    assert err == "", err
    return code, {f["check"]: f for f in json.loads(out)["findings"]}


def test_a_healthy_database_exits_0(run, autovacuum_on):
    code, out, _ = run("doctor")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[-1].startswith("ok: ")
    checks = ("schema", "snapshot", "hot_table", "connections", "replication_slots")
    for check in checks if autovacuum_on else [c for c in checks if c != "hot_table"]:
        assert any(line.split()[:2] == ["OK", check] for line in lines), (check, out)
    if not autovacuum_on:
        code, report = doctor_json(run, "--check", "hot_table")
        assert code == 2 and report["hot_table"]["title"].startswith(
            "autovacuum is off on this server"
        ), report
    code, report = doctor_json(run)
    assert code == 0 and all(f["level"] == "ok" for f in report.values()), report


def test_a_held_snapshot_names_its_holder_and_what_it_costs_the_hot_table(
    run, store, conn, session, schema, pg_url, autovacuum_on
):
    queue = declared_queue(store)
    holder = session("nightly-report")
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute(sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(schema)))
    pid = holder.info.backend_pid
    # Rows that die while the snapshot is held: VACUUM may not remove them. (Deleted by a
    # session that ends, which reports its counts as it ends.)
    ids = [enqueue(store, queue) for _ in range(200)]
    with psycopg.connect(pg_url, autocommit=True) as deleter:
        deleter.execute(
            sql.SQL("DELETE FROM {}.jobs WHERE id = ANY(%s)").format(sql.Identifier(schema)),
            (ids,),
        )
    dead = sql.SQL(DEAD_ROWS)
    jobs = f"{schema}.jobs"
    wait_for(lambda: conn.execute(dead, (jobs,)).fetchone()[0] >= 200, 10, "the deletes' counts")
    conn.execute(sql.SQL("VACUUM {}.jobs").format(sql.Identifier(schema)))
    time.sleep(1.1)

    code, out, _ = run("doctor", "--snapshot-warning-seconds", "1")
    assert code == 1, out
    line = next(line for line in out.splitlines() if line.startswith("WARNING  snapshot"))
    assert f"pid {pid} (nightly-report," in line and "idle in transaction" in line
    assert "SELECT count(*) FROM" in line
    assert f"pg_terminate_backend({pid})" in out
    code, report = doctor_json(
        run,
        *("--snapshot-warning-seconds", "0.5", "--snapshot-problem-seconds", "1"),
        *("--check", "snapshot", "--check", "hot_table"),
    )
    assert code == 2 and report["snapshot"]["level"] == "problem"
    assert report["snapshot"]["figures"]["horizon_age_seconds"] >= 1
    cost = report["snapshot"]["details"][0]
    assert f"vacuum can remove no row version of {schema}.jobs that died since" in cost
    dead = report["hot_table"]["figures"]["dead_tuples"]
    assert dead >= 200, f"VACUUM removed the rows that died under the snapshot: {dead} left"

    # Released: the next vacuum removes them, and the finding is ok again.
    holder.execute("ROLLBACK")
    conn.execute(sql.SQL("VACUUM {}.jobs").format(sql.Identifier(schema)))
    code, report = doctor_json(run, "--check", "snapshot", "--check", "hot_table")
    assert report["snapshot"]["level"] == "ok"
    assert report["hot_table"]["figures"]["dead_tuples"] < 200
    assert code == (0 if autovacuum_on else 2)


def test_an_idle_transaction_holding_a_job_row_is_named_with_the_job(run, store, session, schema):
    queue = declared_queue(store)
    job = enqueue(store, queue)
    holder = session("billing-app")
    holder.execute("BEGIN")
    holder.execute(
        sql.SQL("SELECT id FROM {}.jobs WHERE id = %s FOR UPDATE").format(sql.Identifier(schema)),
        (job,),
    )
    pid = holder.info.backend_pid
    time.sleep(0.6)
    code, out, _ = run("doctor", "--idle-transaction-warning-seconds", "0.5")
    assert code == 1, out
    line = next(line for line in out.splitlines() if "idle_transactions" in line)
    assert line.startswith("WARNING") and f"pid {pid} (billing-app," in line
    assert f"holding job {job}" in line and "FOR UPDATE" in line

    # An operator's cancel of that job now waits for it: a problem.
    cancelled = threading.Thread(target=store.cancel, args=(job,), kwargs={"by": "test"})
    cancelled.start()
    try:
        wait_for(
            lambda: (
                "1 session(s) wait for it"
                in run("doctor", "--idle-transaction-warning-seconds", "0.5")[1]
            ),
            10,
            "the cancel to wait for the idle transaction",
        )
        code, report = doctor_json(run, "--idle-transaction-warning-seconds", "0.5")
        assert code == 2 and report["idle_transactions"]["level"] == "problem"
    finally:
        holder.execute("ROLLBACK")
        cancelled.join(10)


def test_a_dead_worker_s_expired_lease_with_no_live_worker_is_a_problem(
    run, store, conn, schema, pg_url
):
    # A lease that ran out counts as expired once the server has been up a whole lease
    # (the reaper's rule): the run may have started the server just now.
    server_up_for(pg_url, Settings().lease_seconds)
    queue = declared_queue(store)
    job = enqueue(store, queue)
    # A worker claims it with a short lease, then dies: its registry row goes stale.
    worker = register_worker(conn, schema, [queue])
    store.claim(queue, 1, f"{worker}:MainThread:x", 0.1)
    conn.execute(
        sql.SQL("UPDATE {}.workers SET expires_at = now() - interval '1 second'").format(
            sql.Identifier(schema)
        )
    )
    time.sleep(0.3)
    code, out, _ = run("doctor", "--expired-lease-grace-seconds", "0.1")
    assert code == 2, out
    line = next(line for line in out.splitlines() if "expired_leases" in line)
    assert line.startswith("PROBLEM") and "no worker is alive to take them back" in line
    assert job in line and queue in line
    assert "Start a worker" in out

    # A live worker that does not reap them: a warning.
    register_worker(conn, schema, [queue])
    code, report = doctor_json(run, "--expired-lease-grace-seconds", "0.1")
    assert report["expired_leases"]["level"] == "warning"
    assert "none of the 1 live worker(s) took them back" in report["expired_leases"]["title"]


def test_a_queue_with_work_and_no_worker_is_a_warning(run, store, conn, schema):
    queue = declared_queue(store)
    enqueue(store, queue)
    code, out, _ = run("doctor", "--unattended-warning-seconds", "0")
    line = next(line for line in out.splitlines() if "unattended_queues" in line)
    assert code == 1 and line.startswith("WARNING"), out
    assert f"queue {queue}: 1 runnable job(s) wait" in line
    assert "no live worker process consumes this queue" in line
    # Consumed by a live worker: ok.
    register_worker(conn, schema, [queue])
    code, report = doctor_json(run, "--unattended-warning-seconds", "0")
    assert report["unattended_queues"]["level"] == "ok", report


def test_rows_in_a_default_partition_are_a_warning(run, conn, schema):
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.job_events (job_id, type, created_at) "
            "VALUES (%s, 'created', '2001-02-03')"
        ).format(sql.Identifier(schema)),
        (str(uuid.uuid4()),),
    )
    try:
        code, out, _ = run("doctor")
        line = next(line for line in out.splitlines() if "default_partitions" in line)
        assert code == 1 and line.startswith("WARNING"), out
        assert "job_events_default 1" in line
        assert "dramatiq-pg-broker prune" in out
    finally:
        conn.execute(sql.SQL("DELETE FROM {}.job_events_default").format(sql.Identifier(schema)))


def test_missing_partitions_are_a_warning_ahead_and_a_problem_today(
    run, conn, schema, pg_url, store
):
    today = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()[0]
    parent = "jobs_history_succeeded"
    try:
        tomorrow = f"{parent}_{today + dt.timedelta(days=1):%Y%m%d}"
        conn.execute(
            sql.SQL("DROP TABLE {}.{}").format(sql.Identifier(schema), sql.Identifier(tomorrow))
        )
        code, report = doctor_json(run)
        assert code == 1 and report["partitions"]["level"] == "warning", report["partitions"]
        assert "only 0 day(s) ahead" in report["partitions"]["title"]

        todays = f"{parent}_{today:%Y%m%d}"
        conn.execute(
            sql.SQL("DROP TABLE {}.{}").format(sql.Identifier(schema), sql.Identifier(todays))
        )
        code, out, _ = run("doctor")
        line = next(line for line in out.splitlines() if line.split()[1:2] == ["partitions"])
        assert code == 2 and line.startswith("PROBLEM"), out
        assert "today's partitions of history are missing" in line
    finally:
        # Maintenance makes them again.
        prune_with_settings(store.pool, store_settings(pg_url, schema))
    code, report = doctor_json(run)
    assert report["partitions"]["level"] == "ok", report["partitions"]


def store_settings(pg_url: str, schema: str):
    from dramatiq_pg_broker.config import Settings

    return Settings(url=pg_url, schema=schema)


def test_a_replication_slot_keeping_wal_is_reported(run, conn):
    name = f"doctor_{uuid.uuid4().hex[:8]}"
    conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (name,))
    try:
        code, out, _ = run("doctor")
        line = next(line for line in out.splitlines() if "replication_slots" in line)
        assert code == 1 and line.startswith("WARNING"), out
        assert f"slot {name!r} (physical, inactive) keeps" in line
        assert "pg_drop_replication_slot" in out
        code, report = doctor_json(run, "--slot-wal-problem-bytes", "1")
        assert code == 2 and report["replication_slots"]["level"] == "problem"
        assert report["replication_slots"]["figures"]["retained_bytes"][name] > 0
    finally:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))


def test_autovacuum_off_on_the_hot_table_is_a_problem(run, conn, schema, autovacuum_on):
    # On its long lane (0028), the one lane only vacuum keeps small.
    jobs = sql.SQL("{}.jobs_lane_long").format(sql.Identifier(schema))
    conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(jobs))
    try:
        code, report = doctor_json(run, "--check", "hot_table")
        assert code == 2 and report["hot_table"]["level"] == "problem"
        # (A server without autovacuum at all says that first.)
        off = f"autovacuum is off for {schema}.jobs" if autovacuum_on else "autovacuum is off"
        assert report["hot_table"]["title"].startswith(off), report["hot_table"]
    finally:
        conn.execute(sql.SQL("ALTER TABLE {} RESET (autovacuum_enabled)").format(jobs))


def test_a_schema_behind_the_code_is_a_problem_and_the_rest_still_looks(pg_url, behind, capsys):
    from dramatiq_pg_broker import cli

    code = cli.main(["--url", pg_url, "--schema", behind, "doctor"])
    out = capsys.readouterr().out
    assert code == 2, out
    line = out.splitlines()[0]
    assert line.startswith("PROBLEM  schema") and "run `dramatiq-pg-broker migrate`" in line
    # Checks whose tables the old schema lacks say so; the others ran.
    assert any(line.startswith("SKIPPED") for line in out.splitlines()), out
    assert any(line.split()[:2] == ["OK", "snapshot"] for line in out.splitlines()), out


def test_the_connection_check_adds_up_the_live_workers_budgets(pg_url, schema, conn):
    for _ in range(3):
        register_worker(conn, schema, ["q"])
    register_worker(conn, schema, ["q"], live=False)
    with psycopg.connect(pg_url, autocommit=True) as c:
        report = examine(c, schema, checks=["connections"])
        found = report.finding("connections")
        assert found.figures["workers"] == 3 and found.figures["worker_budgets"] == 33
        assert "the 3 live worker(s) may open up to 33" in found.title
        # Budgets beyond the server's slots: a warning.
        tight = examine(
            c, schema, checks=["connections"], thresholds=Thresholds(connections_warning=1.0)
        )
        assert tight.finding("connections").level == "ok"
        available = found.figures["available"]
        conn.execute(
            sql.SQL("UPDATE {}.workers SET connections = %s").format(sql.Identifier(schema)),
            (available,),
        )
        over = examine(c, schema, checks=["connections"]).finding("connections")
        assert over.level == "warning" and "pool_max_size" in over.advice


def test_bad_thresholds_and_checks_get_one_line(run):
    code, _, err = run("doctor", "--snapshot-warning-seconds", "-1")
    assert code == 2 and "is not a number of at least 0" in err and err.count("\n") == 1
    code, _, err = run("doctor", "--check", "nothing")
    assert code == 2 and "invalid choice" in err


def test_dead_rows_past_the_warning_name_autovacuum_s_naptime(
    run, store, conn, schema, pg_url, autovacuum_on
):
    """More dead rows than live ones, past the warning, and no snapshot to blame: the
    advice is autovacuum's pace (its naptime, as this server has it)."""
    if not autovacuum_on:
        pytest.skip("this server runs without autovacuum: the hot table's finding says so")
    queue = declared_queue(store)
    ids = [enqueue(store, queue) for _ in range(50)]
    with psycopg.connect(pg_url, autocommit=True) as deleter:
        deleter.execute(
            sql.SQL("DELETE FROM {}.jobs WHERE id = ANY(%s)").format(sql.Identifier(schema)),
            (ids,),
        )
    dead = DEAD_ROWS
    wait_for(
        lambda: conn.execute(dead, (f"{schema}.jobs",)).fetchone()[0] >= 50,
        10,
        "the deletes' counts",
    )
    code, report = doctor_json(run, "--check", "hot_table", "--dead-tuples-warning", "10")
    finding = report["hot_table"]
    assert code == 1 and finding["level"] == "warning", finding
    assert "autovacuum_naptime" in finding["advice"] and finding["figures"]["dead_tuples"] >= 50
    assert finding["figures"]["autovacuum_naptime_seconds"] > 0


def test_a_workflow_step_ended_by_an_earlier_release_is_a_warning_until_retried(
    run, broker, queue, conn, schema
):
    """A worker of a release before migration 0025 moves a step's job to history without
    its workflow_node (its statement names the columns it knows): the workflow would wait
    for ever. The check names it; an abort and a retry run it on from that step."""
    import dramatiq

    from dramatiq_pg_broker import workflow
    from dramatiq_pg_broker.jobs import Attempt

    @dramatiq.actor(broker=broker, queue_name=queue, actor_name=f"wf_{queue}", max_retries=0)
    def step(*args):
        return None

    code, report = doctor_json(run, "--check", "workflows")
    assert code == 0 and report["workflows"]["level"] == "ok", report
    flow = workflow(step.message(1), step.message(2)).run(broker=broker)
    first = flow.show()["nodes"][0]["job_id"]
    (claimed,) = broker.store.claim(queue, 10, "old-worker", 30)
    assert claimed.id == first
    # What the earlier release's move leaves: the job's history row without the column.
    conn.execute(
        sql.SQL("UPDATE {}.jobs SET workflow_node = NULL WHERE id = %s").format(
            sql.Identifier(schema)
        ),
        (first,),
    )
    broker.store.complete([Attempt(claimed.id, "old-worker", claimed.attempts)])
    assert flow.status() == "running"
    assert [n["status"] for n in flow.show()["nodes"]] == ["running", "pending"]

    code, out, _ = run("doctor", "--check", "workflows")
    line = next(line for line in out.splitlines() if " workflows " in f" {line} ")
    assert code == 1 and line.startswith("WARNING"), out
    assert "1 step(s) of 1 running workflow(s) ended without moving their workflow on" in line
    assert f"workflow {flow.id}: job {first} succeeded" in out
    assert "dramatiq-pg-broker workflows abort ID" in out
    code, report = doctor_json(run, "--check", "workflows")
    assert report["workflows"]["figures"] == {"stalled_steps": 1, "workflows": 1}

    # The advice works: the stalled step gets a job again, the check is ok.
    assert run("workflows", "abort", flow.id)[0] == 0
    assert run("workflows", "retry", flow.id)[0] == 0
    again = flow.show()["nodes"][0]
    assert again["job_id"] != first and again["status"] == "running", again
    code, report = doctor_json(run, "--check", "workflows")
    assert code == 0 and report["workflows"]["level"] == "ok", report


def test_the_longest_held_of_snapshots_that_hold_the_same_horizon_decides(run, session, schema):
    """An open transaction that wrote holds the horizon at its transaction id, and every
    snapshot taken since has that id as its xmin: they all hold the horizon as far back.
    The one held the longest is the one to name, and its age decides the level (not
    whichever of the tied sessions the server lists first)."""
    others = [session(f"short-{n}") for n in range(6)]
    writer = session("forgotten-writer")
    writer.execute("BEGIN")
    writer.execute("SELECT txid_current()")  # the transaction has an id: the horizon's
    pid = writer.info.backend_pid
    time.sleep(1.1)
    for other in others:
        other.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        other.execute("SELECT 1")
    code, report = doctor_json(
        run,
        "--check",
        "snapshot",
        "--snapshot-warning-seconds",
        "1",
        "--snapshot-problem-seconds",
        "1000",
    )
    finding = report["snapshot"]
    assert finding["title"].startswith(f"pid {pid} (forgotten-writer,"), finding
    assert (code, finding["level"]) == (1, "warning"), finding


def test_a_role_that_sees_only_its_own_sessions_still_counts_every_connection(
    pg_url, schema, conn, session
):
    """A role without pg_monitor (or pg_read_all_stats) sees the other roles' sessions in
    pg_stat_activity with their type and state hidden: each still takes a slot."""
    role = f"doctor_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        conn.execute(
            sql.SQL(
                "GRANT USAGE ON SCHEMA {0} TO {1}; GRANT SELECT ON ALL TABLES IN SCHEMA {0} TO {1}"
            ).format(sql.Identifier(schema), sql.Identifier(role))
        )
        for n in range(5):
            session(f"app-{n}")
        url = psycopg.conninfo.make_conninfo(pg_url, user=role)
        # The server's slots are shared with the suite's other processes, whose
        # connections come and go: the role's count is bracketed by two counts of a role
        # that sees every session (the one after alone failed once, two lower).
        with psycopg.connect(url, autocommit=True) as c:
            before = examine(conn, schema, checks=["connections"]).finding("connections")
            blind = examine(c, schema, checks=["connections", "snapshot", "idle_transactions"])
            after = examine(conn, schema, checks=["connections"]).finding("connections")
        for check in ("snapshot", "idle_transactions"):
            details = blind.finding(check).details
            assert any("sees only its own sessions'" in d for d in details), (check, details)
        found = blind.finding("connections")
        assert found.figures["used"] >= 7, found.title  # 5 sessions, conn, the role's own
        most = max(before.figures["used"], after.figures["used"])
        # (A slack of 2 for a session of another process that lived only in between;
        # counting sessions twice would be far more.)
        assert found.figures["used"] <= most + 2, (found.title, before.title, after.title)
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {0}; DROP ROLE {0}").format(sql.Identifier(role)))


def test_expired_leases_count_as_the_workers_reaper_counts_them(
    run, store, conn, schema, pg_url, monkeypatch
):
    """A lease that ran out counts once the server has been up a whole lease: the
    workers' ``lease_seconds`` (DRAMATIQ_PG_LEASE_SECONDS), not a default of the command's.
    With a lease longer than the server has been up, the reaper takes nothing back, and
    a live worker that has not is no cause for a warning."""
    server_up_for(pg_url, Settings().lease_seconds + 1)
    up = conn.execute("SELECT extract(epoch FROM now() - pg_postmaster_start_time())").fetchone()
    lease = float(up[0]) + 3600
    monkeypatch.setenv("DRAMATIQ_PG_LEASE_SECONDS", str(lease))
    queue = declared_queue(store)
    job = enqueue(store, queue)
    worker = register_worker(conn, schema, [queue])
    store.claim(queue, 1, f"{worker}:MainThread:x", 0.1)
    time.sleep(0.3)
    reaped = store.reap(batch=10, backoff_ms=[0], max_interruptions=5, lease_seconds=lease)
    assert job not in reaped.requeued, "the reaper took back a lease the server never saw end"
    code, report = doctor_json(
        run, "--check", "expired_leases", "--expired-lease-grace-seconds", "0.1"
    )
    assert (code, report["expired_leases"]["level"]) == (0, "ok"), report["expired_leases"]


def test_the_hot_table_finding_says_when_each_lane_was_last_emptied(run, store, conn, schema):
    lanes = sql.Identifier(schema, "job_lanes")
    conn.execute(sql.SQL("UPDATE {} SET emptied_in = 0, emptied_at = NULL").format(lanes))
    turn = store.empty_lane(always=True)
    assert turn.outcome == "emptied", turn
    code, report = doctor_json(run, "--check", "hot_table")
    figures = report["hot_table"]["figures"]
    ages = figures["lanes_emptied_seconds_ago"]
    assert len(ages) == 3 and 0 <= ages[turn.lane] < 60, figures
    assert [a for i, a in enumerate(ages) if i != turn.lane] == [None, None], figures
    assert figures["lanes_left_because"] == []
