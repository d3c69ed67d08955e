"""Periodic schedules against real PostgreSQL, with an injected clock: ticks, one job per
tick across schedulers (processes), the missed-tick policies, and the maintenance tick
that exactly one process runs."""

from __future__ import annotations

import datetime as dt

import dramatiq
import pytest

from dramatiq_pg_broker import PostgresBroker, Schedule, periodic
from dramatiq_pg_broker.errors import ConfigurationError
from dramatiq_pg_broker.history.periodic import RETENTION_SCHEDULE, list_schedules
from dramatiq_pg_broker.history.schedules import INTERVAL_ORIGIN

UTC = dt.timezone.utc
T0 = dt.datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


@pytest.fixture
def make_broker(pg_url, schema):
    brokers = []

    def make(**options):
        broker = PostgresBroker(url=pg_url, schema=schema, **options)
        brokers.append(broker)
        return broker

    with PostgresBroker(url=pg_url, schema=schema).pool.connection() as conn:
        conn.execute(
            f"TRUNCATE {schema}.jobs, {schema}.jobs_history, {schema}.job_keys, "
            f"{schema}.schedules CASCADE"
        )
    yield make
    for broker in brokers:
        broker.close()


def declare(broker, queue="periodic", **schedule):
    @periodic(**schedule)
    @dramatiq.actor(broker=broker, queue_name=queue, actor_name="tick")
    def tick():
        pass

    return tick


def tick_jobs(broker) -> list[dict]:
    """The unfinished jobs of the schedule, with the message as readers see it (all_jobs
    parses the stored bytes, migration 0018)."""
    with broker.pool.connection() as conn:
        cur = conn.execute(
            f"SELECT id, idempotency_key, message -> 'options' -> 'periodic' AS periodic "
            f"FROM {broker.settings.schema}.all_jobs "
            "WHERE actor_name = 'tick' AND status IN ('queued', 'running') ORDER BY 2"
        )
        return [dict(zip([d.name for d in cur.description], r)) for r in cur.fetchall()]


# -- declaring -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one"),
        ({"cron": "* * * * *", "every": 5}, "exactly one"),
        ({"cron": "61 * * * *"}, "bad cron expression"),
        ({"cron": "* * * * *", "timezone": "Mars/Olympus"}, "unknown time zone"),
        ({"every": 5, "missed": "later"}, "'run_once' or 'skip'"),
        ({"every": 0.5}, "at least 1 second"),
    ],
)
def test_a_bad_schedule_is_refused_at_declaration(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        Schedule("tick", **kwargs)


def test_periodic_goes_above_the_actor_and_names_are_unique(make_broker):
    broker = make_broker()
    tick = declare(broker, every=5)
    assert [s.name for s in broker.schedules] == ["tick"]
    with pytest.raises(ConfigurationError, match="above @dramatiq.actor"):
        periodic(every=5)(lambda: None)
    with pytest.raises(ConfigurationError, match="two schedules"):
        periodic(every=7)(tick)
    from dramatiq.brokers.stub import StubBroker

    stub = StubBroker()
    with pytest.raises(ConfigurationError, match="need a PostgresBroker"):
        periodic(every=5)(dramatiq.actor(broker=stub)(lambda: None))


def test_ticks_of_an_interval_and_of_a_cron_in_a_time_zone():
    every = Schedule("tick", every=2)
    ticks, count = every.ticks(at(0), at(7))
    assert ticks == [at(2), at(4), at(6)] and count == 3
    # Midnight in Paris is 23:00 UTC in winter.
    cron = Schedule("tick", cron="0 0 * * *", timezone="Europe/Paris")
    ticks, count = cron.ticks(T0, T0 + dt.timedelta(days=2))
    assert ticks == [
        dt.datetime(2030, 1, 1, 23, tzinfo=UTC),
        dt.datetime(2030, 1, 2, 23, tzinfo=UTC),
    ]
    assert cron.next_run(T0) == dt.datetime(2030, 1, 1, 23, tzinfo=UTC)
    assert every.description == "every 2s" and cron.description == "cron 0 0 * * *"


# -- ticks -----------------------------------------------------------------------------


def test_two_processes_firing_the_same_ticks_make_one_job_per_tick(make_broker):
    schedulers = []
    for _ in range(2):
        broker = make_broker(retention=False)
        declare(broker, every=1)
        scheduler = broker.periodic.new_scheduler()
        scheduler.register(broker.schedules[0], at(0.5))
        schedulers.append(scheduler)
    first, second = schedulers
    assert first.fire(first.schedules[0], at(1.01)) == [at(1)]
    assert second.fire(second.schedules[0], at(1.02)) == [at(1)]
    # A process that fell behind enqueues every tick it missed while alive.
    assert second.fire(second.schedules[0], at(3.5)) == [at(2), at(3)]
    assert first.fire(first.schedules[0], at(3.6)) == [at(2), at(3)]

    jobs = tick_jobs(broker)
    assert [j["periodic"]["tick"] for j in jobs] == [at(s).isoformat() for s in (1, 2, 3)]
    assert all(j["periodic"]["missed"] == 1 for j in jobs)
    with broker.pool.connection() as conn:
        (row,) = [s for s in list_schedules(conn, broker.settings.schema) if s["name"] == "tick"]
    assert row["last_tick"] == at(3)
    assert row["next_run"] == at(4)
    assert row["queue_name"] == "periodic" and row["trigger"] == "every 1s"
    assert str(row["last_job_id"]) == str(jobs[-1]["id"])


def test_catch_up_runs_once_for_the_latest_missed_tick(make_broker):
    broker = make_broker(retention=False)
    declare(broker, every=1)
    before = broker.periodic.new_scheduler()
    before.register(broker.schedules[0], at(0.5))
    before.fire(broker.schedules[0], at(2.1))  # ticks 1 and 2, then every worker stops

    after = broker.periodic.new_scheduler()
    assert after.register(broker.schedules[0], at(7.5)) == at(7)
    after.fire(broker.schedules[0], at(8.2))

    jobs = tick_jobs(broker)
    assert [(j["periodic"]["tick"], j["periodic"]["missed"]) for j in jobs] == [
        (at(1).isoformat(), 1),
        (at(2).isoformat(), 1),
        (at(7).isoformat(), 5),  # stands for ticks 3..7
        (at(8).isoformat(), 1),
    ]


def test_skip_enqueues_nothing_for_missed_ticks(make_broker):
    broker = make_broker(retention=False)
    declare(broker, every=1, missed="skip")
    first = broker.periodic.new_scheduler()
    first.register(broker.schedules[0], at(0.5))
    first.fire(broker.schedules[0], at(1.1))
    again = broker.periodic.new_scheduler()
    assert again.register(broker.schedules[0], at(9.5)) is None
    again.fire(broker.schedules[0], at(10.1))
    assert [j["periodic"]["tick"] for j in tick_jobs(broker)] == [
        at(1).isoformat(),
        at(10).isoformat(),
    ]


def test_a_new_schedule_has_nothing_to_catch_up(make_broker):
    broker = make_broker(retention=False)
    declare(broker, every=1)
    assert broker.periodic.new_scheduler().register(broker.schedules[0], at(100.5)) is None
    assert tick_jobs(broker) == []


def test_an_undeclared_actor_stops_the_scheduler_from_starting(make_broker):
    broker = make_broker(retention=False)
    broker.add_schedule(Schedule("nobody", every=5))
    with pytest.raises(ConfigurationError, match="not declared"):
        broker.periodic.new_scheduler().start()


# -- maintenance -----------------------------------------------------------------------


def test_exactly_one_process_runs_each_retention_tick(make_broker):
    schedulers = [make_broker(retention_interval=60).periodic.new_scheduler() for _ in range(3)]
    for scheduler in schedulers:
        scheduler.upsert(scheduler.retention, at(0), kind="maintenance")
    winners = [s for s in schedulers if s.claim_tick(s.retention, at(61)) is not None]
    assert len(winners) == 1
    assert all(s.claim_tick(s.retention, at(100)) is None for s in schedulers)
    assert schedulers[2].claim_tick(schedulers[2].retention, at(120.5)) == at(120)
    with schedulers[0].pool.connection() as conn:
        rows = list_schedules(conn, schedulers[0].settings.schema)
    (row,) = [r for r in rows if r["name"] == RETENTION_SCHEDULE]
    assert row["kind"] == "maintenance" and row["last_tick"] == at(120)


def test_a_worker_starts_and_stops_the_scheduler(make_broker):
    broker = make_broker(retention_interval=3600)
    declare(broker, every=3600)
    worker = dramatiq.Worker(broker, worker_threads=1)
    worker.start()
    try:
        assert broker.periodic.scheduler is not None and broker.periodic.scheduler.running
        with broker.pool.connection() as conn:
            names = {r["name"] for r in list_schedules(conn, broker.settings.schema)}
        assert names == {"tick", RETENTION_SCHEDULE}
    finally:
        worker.stop()
    assert not broker.periodic.scheduler.running


def test_a_registration_the_database_refused_is_retried_at_the_next_tick(make_broker):
    from dramatiq.errors import ConnectionClosed

    broker = make_broker(retention=False)
    declare(broker, every=1)
    before = broker.periodic.new_scheduler()
    before.register(broker.schedules[0], at(0.5))
    before.fire(broker.schedules[0], at(1.1))  # tick 1, then every worker stops

    booting = broker.periodic.new_scheduler()
    real_upsert = booting.upsert
    calls = {"n": 0}

    def upsert_down_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionClosed(RuntimeError("the database is restarting"))
        return real_upsert(*args, **kwargs)

    booting.upsert = upsert_down_once
    assert not booting.try_register(broker.schedules[0], at(5.5))
    assert tick_jobs(broker)[-1]["periodic"]["tick"] == at(1).isoformat()
    # The next firing registers it with the original boot time: the ticks missed before the
    # boot are caught up (run once), and the ticks since the boot are enqueued one by one.
    assert booting.fire(broker.schedules[0], at(7.2)) == [at(6), at(7)]
    assert [(j["periodic"]["tick"], j["periodic"]["missed"]) for j in tick_jobs(broker)] == [
        (at(1).isoformat(), 1),
        (at(5).isoformat(), 4),
        (at(6).isoformat(), 1),
        (at(7).isoformat(), 1),
    ]


def test_a_tick_between_registration_and_the_scheduler_start_is_not_a_period_late(make_broker):
    import time

    broker = make_broker(retention=False)
    declare(broker, every=3600)
    scheduler = broker.periodic.new_scheduler()
    # Registered "two hours ago": the hourly ticks since then fell before the scheduler's
    # own first fire time, an hour from now; its first firing at start enqueues them.
    scheduler.start(now=dt.datetime.now(UTC) - dt.timedelta(hours=2))
    try:
        deadline = time.monotonic() + 20
        while len(tick_jobs(broker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        ticks = [j["periodic"]["tick"] for j in tick_jobs(broker)]
        assert len(ticks) == 2, f"the ticks since the registration were not enqueued: {ticks}"
    finally:
        scheduler.stop()


def test_the_scheduler_fires_on_the_aligned_ticks(make_broker):
    broker = make_broker(retention=False)
    declare(broker, every=7)
    scheduler = broker.periodic.new_scheduler()
    scheduler.start()
    try:
        schedule = broker.schedules[0]
        next_run_time = scheduler.next_fire_time(schedule.name)
        expected = schedule.next_run(dt.datetime.now(UTC) - dt.timedelta(seconds=7))
        # Its next run is a tick of the schedule (a whole multiple of 7 s since the origin),
        # not the start time plus 7 s.
        assert (next_run_time - INTERVAL_ORIGIN) % dt.timedelta(seconds=7) == dt.timedelta(0)
        assert next_run_time >= expected
    finally:
        scheduler.stop()
