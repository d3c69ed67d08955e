"""The previous release (built from its commit, in its own virtual environment) creates
real state, this release's ``migrate`` upgrades it, and this release's workers finish it:
nothing lost, stuck or run twice. Then workers and senders of both releases run side by
side on one upgraded schema, as in a rolling deploy, under the compatibility contract of
``docs/guides/upgrading.md``.
"""

from __future__ import annotations

import collections
import importlib.util
import signal
import sys
import time

import pytest
from psycopg import sql

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker.cli import main
from dramatiq_pg_broker.migrate import CONTRACT_FROM, discover, migrate

from . import previous_release
from .previous_release import APPS
from .workers import WorkerProcess, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: The highest migration the previous release ships.
PREVIOUS_LEVEL = CONTRACT_FROM - 1


def _load_actors():
    """``release_apps/upgrade_actors.py``, imported here with this release's package."""
    spec = importlib.util.spec_from_file_location("upgrade_actors", APPS / "upgrade_actors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("upgrade_actors", module)
    spec.loader.exec_module(module)
    return module


actors_module = _load_actors()


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    started = time.monotonic()
    release = previous_release.build(tmp_path_factory.mktemp("previous-release"))
    print(
        f"previous release {release.version} built and installed in "
        f"{time.monotonic() - started:.1f}s"
    )
    assert release.version == previous_release.PREVIOUS_VERSION
    assert release.workdir in release.package.parents, (
        f"the previous release's interpreter imports {release.package}, not its own copy"
    )
    return release


def jobs(conn, schema: str) -> dict[str, dict]:
    """Every job row, by id: the columns the previous release knows too. From migration
    0012 on, finished jobs live in history: the view of both tables is read then."""
    (upgraded,) = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".all_jobs',)
    ).fetchone()
    rows = conn.execute(
        sql.SQL(
            """SELECT id::text, actor_name, queue_name, status, attempts, max_attempts,
                      failures, interruptions, started, idempotency_key, available_at,
                      locked_by, last_error, message
               FROM {}.{}"""
        ).format(sql.Identifier(schema), sql.Identifier("all_jobs" if upgraded else "jobs"))
    ).fetchall()
    names = (
        "actor queue status attempts max_attempts failures interruptions started key "
        "available_at locked_by last_error message"
    ).split()
    return {row[0]: dict(zip(names, row[1:])) for row in rows}


def event_count(conn, schema: str) -> int:
    query = sql.SQL("SELECT count(*) FROM {}.job_events").format(sql.Identifier(schema))
    return conn.execute(query).fetchone()[0]


def runs(conn, schema: str) -> list[tuple]:
    """(job id, actor, attempt, release, phase, at) of every recorded run, in order."""
    return conn.execute(
        sql.SQL(
            "SELECT job_id::text, actor, attempt, release, phase, at FROM {}.upgrade_runs "
            "ORDER BY id"
        ).format(sql.Identifier(schema))
    ).fetchall()


#: What must never appear in a worker's log: constraint violations, SQL errors of a schema
#: the code does not know, failing maintenance, consumers restarted on errors.
PROBLEMS = (
    "CheckViolation",
    "violates",
    "UndefinedColumn",
    "UndefinedTable",
    "Lease maintenance failed",
    "Consumer encountered",
    "Unexpected failure",
    "CRITICAL",
)


def problems(worker: WorkerProcess) -> list[str]:
    lines = worker.log_path.read_text(errors="replace").splitlines()
    return [line for line in lines if any(p in line for p in PROBLEMS)]


def test_an_upgrade_from_the_previous_release_loses_nothing_and_runs_nothing_twice(
    pg_url, empty_schema, previous, conn, tmp_path, capsys
):
    schema = empty_schema
    created = previous.cli(pg_url, schema, "migrate")
    assert created.returncode == 0, created.stderr
    actors_module.create_runs_table(conn, schema)

    # -- the previous release at work: what its worker runs, then kill -9 mid-job -------
    ran_by_old = previous.send(
        pg_url,
        schema,
        [
            *({"actor": "work", "args": [n]} for n in range(10)),
            {"actor": "doomed"},
            {"actor": "flaky"},
            {"actor": "hang_first", "args": [120]},
            {"actor": "hang_first", "args": [120]},
        ],
    )
    ids = {m["actor"]: [] for m in ran_by_old}
    for m in ran_by_old:
        ids[m["actor"]].append(m["id"])
    old = previous.worker(pg_url, schema, threads=4)

    def reached() -> bool:
        rows = jobs(conn, schema)
        return (
            all(rows[i]["status"] == "succeeded" for i in ids["work"])
            and rows[ids["doomed"][0]]["status"] == "failed"
            and rows[ids["flaky"][0]]["failures"] == 1
            and rows[ids["flaky"][0]]["status"] == "queued"
            and all(
                rows[i]["status"] == "running" and rows[i]["started"] for i in ids["hang_first"]
            )
        )

    def describe() -> str:
        rows = jobs(conn, schema)
        shown = {
            actor: [(rows[i]["status"], rows[i]["failures"], rows[i]["started"]) for i in found]
            for actor, found in ids.items()
        }
        return f"{shown}\n{old.log_tail()}"

    wait_for(reached, 60, "the previous release's worker to reach the state", on_timeout=describe)
    old.kill_group()
    assert not problems(old), problems(old)

    # -- what it leaves waiting: queued, delayed, idempotency keys -----------------------
    left = previous.send(
        pg_url,
        schema,
        [
            *({"actor": "work", "args": [100 + n]} for n in range(10)),
            {"actor": "work", "args": [200], "delay": 8000},
            {"actor": "keyed_a", "args": ["first"], "options": {"idempotency_key": "shared"}},
            {"actor": "keyed_b", "args": ["first"], "options": {"idempotency_key": "shared"}},
            {"actor": "keyed_a", "args": ["again"], "options": {"idempotency_key": "shared"}},
        ],
    )
    queued = [m["id"] for m in left[:10]]
    delayed = left[10]["id"]
    keyed_a, keyed_b = left[11]["id"], left[12]["id"]
    assert left[13]["id"] == keyed_a != keyed_b, "the previous release's keys are per actor"

    before = jobs(conn, schema)
    events_before = event_count(conn, schema)
    (now,) = conn.execute("SELECT now()").fetchone()
    assert before[delayed]["available_at"] > now, "the delayed job became due before the upgrade"
    states = collections.Counter(row["status"] for row in before.values())
    assert states == {"succeeded": 10, "failed": 1, "running": 2, "queued": 14}, states

    # -- the upgrade, as a deploy pipeline runs it ---------------------------------------
    assert main(["--url", pg_url, "--schema", schema, "migrate", "--check"]) == 1
    pending = capsys.readouterr().out
    expected = [m for m in discover() if m.version > PREVIOUS_LEVEL]
    for migration in expected:
        assert migration.filename in pending, pending
    # The previous release's sender sent moments ago (and its killed worker's leases may
    # still be live: they last 2 s here): a breaking migration refuses, saying so.
    assert main(["--url", pg_url, "--schema", schema, "migrate"]) == 2
    refused = capsys.readouterr().err
    assert "0012_partitioned_history.sql is breaking" in refused, refused
    assert "send(s) in the last 30 s" in refused and "--force" in refused, refused
    assert jobs(conn, schema) == before, "a refused migrate changed job rows"
    # Every process of the previous release is stopped (the guide's order): forced.
    started = time.monotonic()
    applied = migrate(pg_url, schema, force=True)
    took = time.monotonic() - started
    print(f"migrate applied {[m.filename for m in applied]} in {took:.2f}s")
    assert [m.version for m in applied] == [m.version for m in expected]
    assert main(["--url", pg_url, "--schema", schema, "migrate", "--check"]) == 0
    assert jobs(conn, schema) == before, "the migration changed job rows"
    assert event_count(conn, schema) == events_before
    # The previous release cannot tell that the database is newer than it (see the guide).
    old_status = previous.cli(pg_url, schema, "status")
    assert (
        old_status.returncode == 0 and f"{PREVIOUS_LEVEL} applied, 0 pending" in old_status.stdout
    )

    # Idempotency keys written by the previous release hold for this one, per actor.
    broker = PostgresBroker(url=pg_url, schema=schema)
    new_actors = actors_module.declare(broker)
    try:
        again_a = new_actors["keyed_a"].send_with_options(args=("new",), idempotency_key="shared")
        again_b = new_actors["keyed_b"].send_with_options(args=("new",), idempotency_key="shared")
    finally:
        broker.close()
    assert (again_a.message_id, again_a.actor_name) == (keyed_a, "keyed_a")
    assert (again_b.message_id, again_b.actor_name) == (keyed_b, "keyed_b")
    assert list(again_a.args) == ["first"], "the first job's message is returned, not a new one"

    # -- this release finishes the work --------------------------------------------------
    new = WorkerProcess(
        pg_url, schema, tmp_path / "new-worker.log", app="upgrade_app", cwd=APPS, threads=4
    )
    try:
        wait_for(
            lambda: (
                not [r for r in jobs(conn, schema).values() if r["status"] in ("queued", "running")]
            ),
            90,
            "this release's worker to finish everything",
            on_timeout=lambda: "\n".join(
                [
                    str(collections.Counter(r["status"] for r in jobs(conn, schema).values())),
                    new.log_tail(),
                ]
            ),
        )
        new.signal(signal.SIGTERM)
        assert new.wait(30) == 0, new.log_tail()
    finally:
        new.kill_group()
    assert not problems(new), problems(new)

    final = jobs(conn, schema)
    assert set(final) == set(before), "jobs appeared or disappeared"
    by_status = collections.Counter(row["status"] for row in final.values())
    assert by_status == {"succeeded": 26, "failed": 1}, by_status

    all_runs = runs(conn, schema)
    starts = collections.Counter(r[0] for r in all_runs if r[4] == "start")
    finishes = collections.Counter(r[0] for r in all_runs if r[4] == "finish")
    releases = collections.defaultdict(set)
    for job_id, _, _, release, _, _ in all_runs:
        releases[job_id].add(release)
    for job_id, row in final.items():
        if row["status"] == "succeeded":
            assert finishes[job_id] == 1, (
                f"{row['actor']} job {job_id} finished {finishes[job_id]} times"
            )
    for job_id in ids["work"]:
        assert starts[job_id] == 1 and releases[job_id] == {"old"}, "a finished job ran again"
    for job_id in [*queued, delayed, keyed_a, keyed_b]:
        assert starts[job_id] == 1 and releases[job_id] == {"new"}, job_id

    doomed = final[ids["doomed"][0]]
    assert (doomed["attempts"], doomed["failures"], starts[ids["doomed"][0]]) == (1, 1, 1)
    flaky = final[ids["flaky"][0]]
    assert (flaky["attempts"], flaky["failures"], flaky["interruptions"]) == (2, 1, 0)
    assert [(r[2], r[3]) for r in all_runs if r[0] == ids["flaky"][0] and r[4] == "start"] == [
        (1, "old"),
        (2, "new"),
    ]
    for job_id in ids["hang_first"]:
        hung = final[job_id]
        assert (hung["attempts"], hung["failures"], hung["interruptions"]) == (2, 0, 1), hung
        assert [(r[2], r[3]) for r in all_runs if r[0] == job_id and r[4] == "start"] == [
            (1, "old"),
            (2, "new"),
        ]
    (delayed_start,) = [r[5] for r in all_runs if r[0] == delayed and r[4] == "start"]
    assert delayed_start >= before[delayed]["available_at"], "the delayed job ran early"


def test_both_releases_side_by_side_keep_the_contract(
    pg_url, empty_schema, previous, conn, tmp_path
):
    """A rolling deploy: the previous release's workers and senders beside this release's,
    on a schema migrated by this release. Each side's reaper recovers the other's jobs,
    and dead letters, retries and idempotency keys mean the same to both."""
    newer = [m for m in discover() if m.version > PREVIOUS_LEVEL]
    breaking = [m.filename for m in newer if m.breaking]
    if breaking:
        pytest.skip(
            f"{', '.join(breaking)} is breaking: processes of the previous release must stop "
            "before it is applied, so the two releases never run side by side (the guide's "
            "deploy order)"
        )
    schema = empty_schema
    assert previous.cli(pg_url, schema, "migrate").returncode == 0
    migrate(pg_url, schema)
    actors_module.create_runs_table(conn, schema)
    broker = PostgresBroker(url=pg_url, schema=schema)
    new_actors = actors_module.declare(broker)
    workers: list[WorkerProcess] = []
    try:
        # -- a new worker dies holding a started job and claims that never started; the
        # previous release's reaper recovers them -------------------------------------------
        victim = WorkerProcess(
            pg_url,
            schema,
            tmp_path / "new-victim.log",
            app="upgrade_app",
            cwd=APPS,
            threads=1,
            dramatiq_queue_prefetch="6",
        )
        workers.append(victim)
        hung = new_actors["hang_first"].send(120).message_id
        unstarted = [new_actors["once"].send().message_id for _ in range(4)]

        def held() -> bool:
            rows = jobs(conn, schema)
            return rows[hung]["started"] and all(
                rows[i]["status"] == "running" and not rows[i]["started"] for i in unstarted
            )

        wait_for(
            held, 60, "the new worker to start one job and hold four", on_timeout=victim.log_tail
        )
        victim.kill_group()

        old = previous.worker(pg_url, schema, threads=2)
        workers.append(old)
        wait_for(
            lambda: all(
                r["status"] == "succeeded"
                for i, r in jobs(conn, schema).items()
                if i in {hung, *unstarted}
            ),
            60,
            "the previous release's worker to recover and finish the killed worker's jobs",
            on_timeout=old.log_tail,
        )
        rows = jobs(conn, schema)
        for job_id in unstarted:
            row = rows[job_id]
            assert (row["attempts"], row["failures"], row["interruptions"]) == (1, 0, 0), (
                f"a max_retries=0 claim that never started was charged by the old reaper: {row}"
            )
        assert (rows[hung]["attempts"], rows[hung]["interruptions"]) == (2, 1)
        assert [(r[2], r[3]) for r in runs(conn, schema) if r[0] == hung and r[4] == "start"] == [
            (1, "new"),
            (2, "old"),
        ]

        # -- both releases' workers and senders at once ------------------------------------
        new = WorkerProcess(
            pg_url, schema, tmp_path / "new-worker.log", app="upgrade_app", cwd=APPS, threads=2
        )
        workers.append(new)
        for worker in (old, new):
            wait_for(
                lambda worker=worker: "ready for action" in worker.log_path.read_text(),
                60,
                "both workers to boot",
                on_timeout=worker.log_tail,
            )
        from_old = previous.send(
            pg_url,
            schema,
            [
                *({"actor": "work", "args": [n, 0.05]} for n in range(30)),
                {"actor": "doomed"},
                {"actor": "doomed"},
                {"actor": "keyed_a", "args": ["old"], "options": {"idempotency_key": "mixed"}},
            ],
        )
        from_new = [new_actors["work"].send(100 + n, 0.05).message_id for n in range(30)]
        from_new += [new_actors["doomed"].send().message_id for _ in range(2)]
        keyed_b = new_actors["keyed_b"].send_with_options(args=("new",), idempotency_key="mixed")
        # Each release's sender gets its own actor's job back for a key both use.
        keyed_a = from_old[-1]["id"]
        assert keyed_a != keyed_b.message_id
        assert (
            new_actors["keyed_a"]
            .send_with_options(args=("again",), idempotency_key="mixed")
            .message_id
            == keyed_a
        )
        (old_b,) = previous.send(
            pg_url,
            schema,
            [{"actor": "keyed_b", "args": ["again"], "options": {"idempotency_key": "mixed"}}],
        )
        assert (old_b["id"], old_b["actor"], old_b["args"]) == (
            keyed_b.message_id,
            "keyed_b",
            ["new"],
        )

        sent = [m["id"] for m in from_old] + from_new + [keyed_b.message_id]
        wait_for(
            lambda: all(jobs(conn, schema)[i]["status"] in ("succeeded", "failed") for i in sent),
            90,
            "both releases' workers to finish every job",
            on_timeout=lambda: old.log_tail() + "\n" + new.log_tail(),
        )
        for worker in (old, new):
            worker.signal(signal.SIGTERM)
        for worker in (old, new):
            assert worker.wait(30) == 0, worker.log_tail()
    finally:
        broker.close()
        for worker in workers:
            worker.kill_group()

    rows = jobs(conn, schema)
    all_runs = runs(conn, schema)
    finishes = collections.Counter(r[0] for r in all_runs if r[4] == "finish")
    ran_by = collections.Counter(r[3] for r in all_runs if r[4] == "finish" and r[0] in sent)
    assert ran_by["old"] and ran_by["new"], f"one release ran every job: {ran_by}"
    for job_id in sent:
        row = rows[job_id]
        if row["actor"] == "doomed":
            assert (row["status"], row["attempts"], row["failures"]) == ("failed", 1, 1), (
                f"a dead letter must count its failure, whichever release wrote it: {row}"
            )
        else:
            assert row["status"] == "succeeded" and finishes[job_id] == 1, (job_id, row)
    for worker in workers:
        assert not problems(worker), (worker.log_path.name, problems(worker))


#: What the jobs table answers a claim and a send of code older than migration 0022.
REFUSED_CLAIM = "refuses the claim of worker"
REFUSED_SEND = "refuses this send"


def test_the_previous_release_cannot_claim_or_send_once_the_schema_is_upgraded(
    pg_url, empty_schema, previous, conn, tmp_path
):
    """Two workers of the previous release left running, idle, across the upgrade (the
    live-work check cannot see a worker that claims nothing: its idle polls write
    nothing), then jobs become due: each of their claims fails whole, naming the worker and
    saying to upgrade, and no job runs on them (before 0022 they ran each job, could not
    record its outcome, and it ran again after the lease: twice, three times). A sender of
    the previous release after the upgrade fails before it writes anything, saying to
    upgrade (before: a keyed send whose key belonged to a finished job made a second job).
    This release's worker then runs every job once."""
    schema = empty_schema
    assert previous.cli(pg_url, schema, "migrate").returncode == 0
    actors_module.create_runs_table(conn, schema)
    (keyed,) = previous.send(
        pg_url,
        schema,
        [{"actor": "keyed_a", "args": ["first"], "options": {"idempotency_key": "done-key"}}],
    )
    later = [
        m["id"]
        for m in previous.send(
            pg_url, schema, [{"actor": "work", "args": [n], "delay": 12_000} for n in range(6)]
        )
    ]
    old_workers = [previous.worker(pg_url, schema, threads=2) for _ in range(2)]
    new = None
    try:
        wait_for(
            lambda: jobs(conn, schema)[keyed["id"]]["status"] == "succeeded",
            60,
            "the previous release's workers to run the keyed job",
            on_timeout=old_workers[0].log_tail,
        )
        # Idle since: what live work the check could see ages out after 30 s; the test
        # moves the traces back instead of waiting.
        conn.execute(
            sql.SQL(
                "UPDATE {}.jobs SET created_at = created_at - interval '1 minute',"
                " started_at = started_at - interval '1 minute'"
            ).format(sql.Identifier(schema))
        )
        applied = migrate(pg_url, schema)
        assert applied[-1].version == discover()[-1].version

        def refused_everywhere() -> bool:
            return all(REFUSED_CLAIM in w.log_path.read_text() for w in old_workers)

        wait_for(
            refused_everywhere,
            60,
            "both workers of the previous release to have their claims refused",
            on_timeout=lambda: "\n".join(w.log_tail() for w in old_workers),
        )
        for worker in old_workers:
            log = worker.log_path.read_text()
            assert "upgrade dramatiq-pg-broker on its host" in log, worker.log_tail()
        rows = jobs(conn, schema)
        assert all((rows[i]["status"], rows[i]["attempts"]) == ("queued", 0) for i in later), [
            (rows[i]["status"], rows[i]["attempts"]) for i in later
        ]

        # A sender of the previous release, after the upgrade: refused, nothing written.
        count = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.all_jobs").format(sql.Identifier(schema))
        ).fetchone()[0]
        for send in (
            {"actor": "keyed_a", "args": ["again"], "options": {"idempotency_key": "done-key"}},
            {"actor": "work", "args": [99]},
        ):
            result = previous.try_send(pg_url, schema, [send])
            assert result.returncode != 0, result.stdout
            assert REFUSED_SEND in result.stderr, result.stderr
            assert "Upgrade dramatiq-pg-broker in the application that sends" in result.stderr
        assert (
            conn.execute(
                sql.SQL("SELECT count(*) FROM {}.all_jobs").format(sql.Identifier(schema))
            ).fetchone()[0]
            == count
        )

        # This release runs every job once.
        new = WorkerProcess(
            pg_url, schema, tmp_path / "new-worker.log", app="upgrade_app", cwd=APPS, threads=2
        )
        wait_for(
            lambda: all(jobs(conn, schema)[i]["status"] == "succeeded" for i in later),
            60,
            "this release's worker to run the jobs",
            on_timeout=lambda: new.log_tail(),
        )
        assert not problems(new), problems(new)
    finally:
        for worker in [*old_workers, *([new] if new else [])]:
            worker.kill_group()
    all_runs = runs(conn, schema)
    for job_id in later:
        started = [(r[2], r[3]) for r in all_runs if r[0] == job_id and r[4] == "start"]
        assert started == [(1, "new")], (job_id, started)
    assert [r[3] for r in all_runs if r[0] == keyed["id"] and r[4] == "start"] == ["old"]
