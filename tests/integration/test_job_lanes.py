"""The hot table's lanes (migrations 0028, 0029): each send lands in the lane of its
period, the lane due is emptied into the long lane and TRUNCATEd whatever snapshot another
session holds, and left to vacuum while no snapshot is as old as its rows, a statement
that meets the emptying finds its row in the long lane afterwards (at READ COMMITTED and
as the first statement of a REPEATABLE READ transaction), a long transaction on a lane or
too many rows left in it leave the lane alone, and a worker's consumers empty lanes on
their own."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_broker.jobs import NewJob
from dramatiq_pg_broker.jobs.rows import Attempt

from ..helpers import wait_for
from .harness import repeatable_read_store


def _job(queue: str, **fields) -> NewJob:
    return NewJob(
        id=str(uuid.uuid4()),
        queue_name=queue,
        actor_name="a",
        message={"args": [], "kwargs": {}, "options": {}},
        priority=0,
        max_attempts=21,
        **fields,
    )


@pytest.fixture
def db(pg_url, schema):
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        yield conn


def _due_lane(db) -> int:
    """The lane empty_job_lane() takes in this period, far enough from the period's end
    (at least 4 s) for a test to set it up and empty it within the same period, and made
    due again (job_lanes forgets that it was emptied, and where each lane's period began:
    a lane without that mark is left to vacuum, 0029): a test that empties it passes
    ``always``."""
    left = db.execute("SELECT 10 - extract(epoch FROM clock_timestamp())::numeric % 10").fetchone()[
        0
    ]
    if left < 4:
        time.sleep(float(left) + 0.05)
    db.execute("UPDATE job_lanes SET emptied_in = 0, opened_in = 0, opened_xid = NULL")
    return db.execute("SELECT ((job_period(clock_timestamp()) + 1) % 3)::int").fetchone()[0]


def _lane_of(db, job_id: str) -> list[int]:
    return [r[0] for r in db.execute("SELECT lane FROM jobs WHERE id = %s", (job_id,))]


def _row_columns(conn) -> sql.Composed:
    """The columns of jobs but its lane, in order (a connection whose search_path is the
    schema): what a copy from one lane to another names, as the emptying does."""
    columns = [
        r[0]
        for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'jobs'::regclass"
            " AND attnum > 0 AND NOT attisdropped AND attname <> 'lane' ORDER BY attnum"
        )
    ]
    return sql.SQL(", ").join(map(sql.Identifier, columns))


def _put_in_lane(db, job_id: str, lane: int) -> None:
    db.execute("UPDATE jobs SET lane = %s WHERE id = %s", (lane, job_id))


def test_a_send_lands_in_the_lane_of_its_period(store, db):
    job = _job("lanes-send")
    before = db.execute("SELECT job_lane(clock_timestamp())").fetchone()[0]
    store.enqueue(job)
    after = db.execute("SELECT job_lane(clock_timestamp())").fetchone()[0]
    assert _lane_of(db, job.id)[0] in {before, after}
    assert before in (0, 1, 2)


def test_the_due_lane_is_emptied_into_the_long_lane_with_every_column(store, db):
    queued, running = _job("lanes-empty"), _job("lanes-empty", delay_ms=3_600_000)
    store.enqueue(queued)
    store.enqueue(running)
    lane = _due_lane(db)
    _put_in_lane(db, queued.id, lane)
    _put_in_lane(db, running.id, lane)
    claimed = store.claim("lanes-empty", 5, "owner-lanes", 30)
    assert [j.id for j in claimed] == [queued.id]
    rows_before = {
        r[0]: r
        for r in db.execute("SELECT * FROM jobs WHERE id = ANY(%s)", ([queued.id, running.id],))
    }

    turn = store.empty_lane(always=True)

    assert (turn.lane, turn.outcome, turn.moved) == (lane, "emptied", 2)
    assert _lane_of(db, queued.id) == [3] and _lane_of(db, running.id) == [3]
    part = f"jobs_lane_{lane}"
    assert (
        db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(part))).fetchone()[0]
        == 0
    )
    rows_after = {
        r[0]: r
        for r in db.execute("SELECT * FROM jobs WHERE id = ANY(%s)", ([queued.id, running.id],))
    }
    # Every column but the lane (the last) is as it was.
    assert {k: v[:-1] for k, v in rows_after.items()} == {k: v[:-1] for k, v in rows_before.items()}
    # The claimed attempt's owner finishes it in the long lane.
    assert store.complete([Attempt(queued.id, "owner-lanes", 1)]) == {queued.id}
    # What it cost the hot path is kept: the wait for the lane's lock and how long it held it.
    waited, held = db.execute(
        "SELECT lock_wait_ms, held_ms FROM job_lanes WHERE lane = %s", (lane,)
    ).fetchone()
    assert 0 <= waited < 1000 and 0 <= held < 1000
    # And the next call in the same period has nothing to do.
    assert store.empty_lane().outcome == "not due"


def test_a_held_snapshot_does_not_keep_a_lane_s_dead_rows(store, db, pg_url, schema):
    lane = _due_lane(db)
    with psycopg.connect(pg_url) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class").fetchone()
        # The lane's period begins after the snapshot was taken (its mark, as a worker's
        # call in that period would set it): VACUUM can remove none of its dead rows.
        (after_it,) = db.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())").fetchone()
        _mark_due_lane(db, lane, str(after_it))
        ids = []
        for _ in range(50):
            job = _job("lanes-held")
            store.enqueue(job)
            _put_in_lane(db, job.id, lane)
            ids.append(job.id)
        claimed = store.claim("lanes-held", 50, "owner-held", 30)
        assert store.complete([Attempt(j.id, "owner-held", 1) for j in claimed]) == set(ids)
        part = sql.Identifier(f"jobs_lane_{lane}")
        db.execute(sql.SQL("VACUUM {}").format(part))
        # VACUUM removes nothing while the snapshot is held: the lane keeps its pages.
        assert (
            db.execute("SELECT pg_relation_size(%s)", (f"{schema}.jobs_lane_{lane}",)).fetchone()[0]
            > 0
        )

        turn = store.empty_lane()

        assert (turn.lane, turn.outcome, turn.moved) == (lane, "emptied", 0)
        assert (
            db.execute("SELECT pg_relation_size(%s)", (f"{schema}.jobs_lane_{lane}",)).fetchone()[0]
            == 0
        )
        holder.execute("ROLLBACK")


def _older_than_every_session(db) -> str:
    """A transaction id older than any session's snapshot (a billion ids back, or the
    first one there is): a lane marked with it began before every snapshot now held."""
    (xmax,) = db.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()
    return str(max(3, xmax - 1_000_000_000))


def _emptied_periods_ago(db, lane: int, periods: int) -> None:
    db.execute(
        "UPDATE job_lanes SET emptied_in = job_period(clock_timestamp()) - %s WHERE lane = %s",
        (periods, lane),
    )


@pytest.mark.parametrize(
    "left,emptied_ago,outcome",
    [(1, 3, "not held"), (1, 30, "emptied"), (6, 3, "emptied"), (0, 300, "not held")],
)
def test_rows_left_in_a_lane_not_held_move_once_many_or_old(store, db, left, emptied_ago, outcome):
    """While nothing holds the horizon, the rows that outlive their lane (delayed, retried,
    a backlog) would pile up in it and leave it too full to be emptied on the day a
    snapshot is held: they move once they are a quarter of max_moved (here 6 of 24), or
    once the lane has gone 30 periods without an emptying."""
    lane = _due_lane(db)
    db.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(f"jobs_lane_{lane}")))
    for _ in range(left):
        job = _job("lanes-left")
        store.enqueue(job)
        _put_in_lane(db, job.id, lane)
    _mark_due_lane(db, lane, _older_than_every_session(db))
    _emptied_periods_ago(db, lane, emptied_ago)

    turn = store.empty_lane(max_moved=24)

    assert (turn.lane, turn.outcome, turn.moved) == (
        lane,
        outcome,
        left if outcome == "emptied" else 0,
    )


def _mark_due_lane(db, lane: int, xid: str) -> None:
    """Say that the due lane's inserts ended at transaction id ``xid``: the period after its
    own (the previous one) began there, as a worker's call in that period would have
    marked it (0029)."""
    db.execute(
        "UPDATE job_lanes SET opened_in = job_period(clock_timestamp()) - 1,"
        " opened_xid = %s::xid8 WHERE lane = %s",
        (xid, (lane + 1) % 3),
    )


def test_a_lane_is_left_to_vacuum_while_no_snapshot_is_as_old_as_its_rows(store, db):
    """No snapshot taken before the lane's period began (the mark here is the oldest
    transaction id there is, older than any session's): VACUUM can remove its dead rows,
    and the lane is not TRUNCATEd (every session would replan its statements on jobs)."""
    job = _job("lanes-not-held")
    store.enqueue(job)
    lane = _due_lane(db)
    _put_in_lane(db, job.id, lane)
    _mark_due_lane(db, lane, _older_than_every_session(db))
    _emptied_periods_ago(db, lane, 3)  # in its last turn: its one row may stay

    turn = store.empty_lane()

    assert (turn.lane, turn.outcome, turn.moved) == (lane, "not held", 0)
    assert turn.next_due_seconds > 1, "the next look is in the next period"
    assert _lane_of(db, job.id) == [lane]
    emptied_in, why, period = db.execute(
        "SELECT emptied_in, left_because, job_period(clock_timestamp()) FROM job_lanes"
        " WHERE lane = %s",
        (lane,),
    ).fetchone()
    assert (emptied_in, why) == (period - 3, "no snapshot as old as its rows: vacuum keeps it")
    # An operator's (or a test's) call empties it all the same.
    assert store.empty_lane(always=True).outcome == "emptied"
    assert _lane_of(db, job.id) == [3]


def test_a_snapshot_older_than_the_lane_s_rows_gets_it_emptied(store, db, pg_url):
    job = _job("lanes-held-mark")
    store.enqueue(job)
    lane = _due_lane(db)
    db.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(f"jobs_lane_{lane}")))
    _put_in_lane(db, job.id, lane)
    with psycopg.connect(pg_url) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class").fetchone()  # the snapshot is taken
        (after_it,) = db.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())").fetchone()
        _mark_due_lane(db, lane, str(after_it))

        turn = store.empty_lane()

        assert (turn.lane, turn.outcome, turn.moved) == (lane, "emptied", 1)
        assert _lane_of(db, job.id) == [3]
        holder.execute("ROLLBACK")


def test_an_emptying_whose_session_dies_before_its_commit_moves_nothing(store, db, pg_url):
    """The copy and the TRUNCATE are one transaction: a worker process killed while its
    emptying runs (here its server session terminated after the function returned and
    before the commit) leaves every row in its lane, and the next emptying moves them."""
    jobs = [_job("lanes-killed") for _ in range(3)]
    for job in jobs:
        store.enqueue(job)
    lane = _due_lane(db)
    for job in jobs:
        _put_in_lane(db, job.id, lane)
    with psycopg.connect(pg_url) as emptier:
        emptier.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(store.schema)))
        emptier.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        assert emptier.execute(
            "SELECT outcome, moved FROM empty_job_lane(100, '20ms', true)"
        ).fetchone() == ("emptied", 3)
        pid = emptier.info.backend_pid
        assert db.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        wait_for(
            lambda: (
                not db.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
            ),
            10,
            "the terminated session to end",
        )
        with pytest.raises(psycopg.OperationalError):
            emptier.execute("COMMIT")
    assert all(_lane_of(db, job.id) == [lane] for job in jobs)
    assert db.execute("SELECT emptied_in FROM job_lanes WHERE lane = %s", (lane,)).fetchone() == (
        0,
    )
    assert store.empty_lane(always=True).moved == 3
    assert all(_lane_of(db, job.id) == [3] for job in jobs)


def test_two_processes_at_once_empty_the_lane_once(store, db, pg_url):
    """Two workers' calls at the same moment: the one that holds the schema's advisory
    lock (here, in a transaction still open) empties the lane; the other is told 'busy'
    and writes nothing, and once the first commits the lane is 'not due'."""
    job = _job("lanes-twice")
    store.enqueue(job)
    lane = _due_lane(db)
    _put_in_lane(db, job.id, lane)
    with psycopg.connect(pg_url) as first:
        first.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(store.schema)))
        first.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        assert first.execute(
            "SELECT outcome, moved FROM empty_job_lane(100, '20ms', true)"
        ).fetchone() == ("emptied", 1)
        second = store.empty_lane(always=True)
        assert (second.lane, second.outcome, second.moved) == (lane, "busy", 0)
        first.execute("COMMIT")
    assert _lane_of(db, job.id) == [3]
    assert store.empty_lane(always=True).outcome == "not due"


def test_each_call_marks_where_the_current_period_s_lane_begins(store, db):
    _due_lane(db)
    before = db.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())").fetchone()[0]
    store.empty_lane()
    period, current = db.execute(
        "SELECT job_period(clock_timestamp()), job_lane(clock_timestamp())"
    ).fetchone()
    opened_in, opened_xid = db.execute(
        "SELECT opened_in, opened_xid FROM job_lanes WHERE lane = %s", (current,)
    ).fetchone()
    assert opened_in == period and int(str(opened_xid)) >= int(str(before))
    # Once a period: a second call leaves the mark as it is.
    store.empty_lane()
    assert db.execute(
        "SELECT opened_xid FROM job_lanes WHERE lane = %s", (current,)
    ).fetchone() == (opened_xid,)


@pytest.mark.parametrize(
    "isolation,lock_first",
    [("read committed", False), ("repeatable read", True), ("serializable", True)],
)
def test_a_statement_that_meets_the_emptying_finds_its_row_in_the_long_lane(
    store, db, pg_url, isolation, lock_first
):
    """What the design rests on: at READ COMMITTED a statement that waits for the
    emptying's lock takes its snapshot after the wait. At REPEATABLE READ and SERIALIZABLE
    the first statement takes the transaction's snapshot before it waits, so a LOCK (which
    takes none) goes first, as a complete_in() block's does (lock_lanes_for_completion),
    and the broker's own sessions are READ COMMITTED whatever the database's default. The
    emptying is done by hand here, so that the statement surely waits for it."""
    job = _job("lanes-meet")
    store.enqueue(job)
    lane = _due_lane(db)
    _put_in_lane(db, job.id, lane)
    (claimed,) = store.claim("lanes-meet", 1, "owner-meet", 30)
    part = sql.Identifier(f"jobs_lane_{lane}")
    result: dict = {}

    def renew():
        with psycopg.connect(pg_url) as worker:
            worker.execute(f"BEGIN ISOLATION LEVEL {isolation.upper()}")
            if lock_first:
                worker.execute(store.queries["lock_lanes_for_completion"])
            result["rows"] = worker.execute(
                sql.SQL(
                    "UPDATE {}.jobs SET locked_until = now() + interval '60 seconds'"
                    " WHERE id = %s AND locked_by = %s RETURNING lane"
                ).format(sql.Identifier(store.schema)),
                (job.id, "owner-meet"),
            ).fetchall()
            worker.execute("COMMIT")

    with psycopg.connect(pg_url) as emptier:
        emptier.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(store.schema)))
        emptier.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(part))
        thread = threading.Thread(target=renew)
        thread.start()
        wait_for(
            lambda: db.execute(
                "SELECT 1 FROM pg_locks WHERE NOT granted AND relation = %s::regclass",
                (f"{store.schema}.jobs_lane_{lane}",),
            ).fetchone(),
            10,
            "the renewal to wait for the lane's lock",
        )
        cols = _row_columns(emptier)
        emptier.execute(
            sql.SQL("INSERT INTO jobs ({}, lane) SELECT {}, 3 FROM {}").format(cols, cols, part)
        )
        emptier.execute(sql.SQL("TRUNCATE {}").format(part))
        emptier.commit()
        thread.join(10)

    assert result["rows"] == [(3,)], f"the renewal at {isolation} updated {result['rows']}"
    assert claimed.id == job.id


def test_a_long_transaction_on_the_lane_leaves_it_for_the_period(store, db, pg_url):
    job = _job("lanes-long-tx")
    store.enqueue(job)
    lane = _due_lane(db)
    _put_in_lane(db, job.id, lane)
    with psycopg.connect(pg_url) as app:
        app.execute(
            sql.SQL("SELECT 1 FROM {}.jobs WHERE id = %s FOR UPDATE").format(
                sql.Identifier(store.schema)
            ),
            (job.id,),
        )
        # The emptying leaves alone a lane that a transaction has held for over a second.
        wait_for(
            lambda: db.execute(
                "SELECT clock_timestamp() - xact_start > interval '1.1 seconds'"
                " FROM pg_stat_activity WHERE pid = %s",
                (app.info.backend_pid,),
            ).fetchone()[0],
            5,
            "the application's transaction to be a second old",
        )
        started = time.monotonic()
        turn = store.empty_lane(always=True)
        assert (turn.lane, turn.outcome) == (lane, "busy")
        assert time.monotonic() - started < 1.0
        assert db.execute("SELECT left_because FROM job_lanes WHERE lane = %s", (lane,)).fetchone()[
            0
        ] == ("held by a long transaction")
        assert _lane_of(db, job.id) == [lane]
        app.rollback()
    assert store.empty_lane(always=True).outcome == "emptied"
    assert _lane_of(db, job.id) == [3]


def test_a_lane_with_more_rows_left_than_the_limit_is_left_to_vacuum(store, db):
    ids = []
    for _ in range(4):
        job = _job("lanes-full")
        store.enqueue(job)
        ids.append(job.id)
    lane = _due_lane(db)
    for job_id in ids:
        _put_in_lane(db, job_id, lane)

    turn = store.empty_lane(max_moved=3, always=True)

    assert (turn.lane, turn.outcome, turn.moved) == (lane, "full", 0)
    assert {_lane_of(db, i)[0] for i in ids} == {lane}
    assert store.empty_lane(max_moved=4, always=True).outcome == "emptied"
    assert {_lane_of(db, i)[0] for i in ids} == {3}


def test_a_resend_of_an_id_in_another_lane_stores_nothing(store, db):
    job = _job("lanes-resend")
    store.enqueue(job)
    _put_in_lane(db, job.id, 3)
    store.enqueue(job)
    assert _lane_of(db, job.id) == [3]


def test_a_bulk_copy_of_an_id_stored_in_another_lane_stores_it_once(store, db):
    first = _job("lanes-bulk")
    store.enqueue(first)
    _put_in_lane(db, first.id, 3)
    others = [_job("lanes-bulk") for _ in range(3)]
    store.enqueue_many([first, *others])
    assert _lane_of(db, first.id) == [3]
    assert all(len(_lane_of(db, j.id)) == 1 for j in others)


@pytest.mark.slow
def test_a_worker_s_consumers_empty_the_lanes_while_a_snapshot_is_held(broker, db, pg_url):
    """The keeper's first call marks the current period's lane, which is where the lane
    due in the next period stopped taking inserts; a snapshot taken before that mark holds
    the horizon, so that lane is emptied in the next period (within about 11 s). The first
    call empties none: no lane's end was marked."""
    # Emptied in their last turns (the rows other tests left in them may stay), with no
    # mark of a period.
    db.execute(
        "UPDATE job_lanes SET emptied_in = job_period(clock_timestamp()) - 3,"
        " emptied_at = NULL, opened_in = 0"
    )
    broker.declare_queue("lanes-worker")
    with psycopg.connect(pg_url) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class").fetchone()  # the snapshot is taken
        consumer = broker.consume("lanes-worker")
        try:
            wait_for(
                lambda: broker.lanes.last is not None,
                10,
                "the lane keeper's first call",
            )
            assert broker.lanes.last.outcome == "not held", broker.lanes.last
            wait_for(
                lambda: db.execute(
                    "SELECT count(*) FROM job_lanes WHERE emptied_at IS NOT NULL"
                ).fetchone()[0],
                35,
                "a lane emptied by the worker process's lane keeper",
            )
            assert broker.lanes.started
        finally:
            consumer.close()
            broker.lanes.stop()
        holder.execute("ROLLBACK")


def test_the_broker_s_sessions_are_read_committed_on_a_repeatable_read_database(pg_url, schema):
    with repeatable_read_store(pg_url, schema) as rr:
        with rr.pool.connection() as conn:
            assert (
                conn.execute("SHOW default_transaction_isolation").fetchone()[0] == "read committed"
            )


def test_the_emptying_refuses_a_snapshot_level_and_the_store_begins_read_committed(
    store, db, pg_url, schema
):
    """At REPEATABLE READ the function's snapshot would predate its lock: it refuses. The
    store's call begins its transaction READ COMMITTED on a database whose default is
    REPEATABLE READ."""
    with psycopg.connect(pg_url) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(psycopg.errors.InvalidTransactionState, match="READ COMMITTED"):
            conn.execute(
                sql.SQL("SELECT * FROM {}.empty_job_lane(10, '20ms')").format(
                    sql.Identifier(schema)
                )
            )
    _due_lane(db)
    with repeatable_read_store(pg_url, schema) as rr:
        assert rr.empty_lane(always=True).outcome == "emptied"


def _copy_to_long_lane(db, job_id: str) -> None:
    """A second row of ``job_id`` in the long lane (what two sends of one id on either
    side of a period's boundary can leave)."""
    cols = _row_columns(db)
    db.execute(
        sql.SQL("INSERT INTO jobs ({}, lane) SELECT {}, 3 FROM jobs WHERE id = %s").format(
            cols, cols
        ),
        (job_id,),
    )


def test_an_id_in_two_lanes_leaves_the_lane_to_vacuum(store, db):
    job = _job("lanes-dup")
    store.enqueue(job)
    lane = _due_lane(db)
    _put_in_lane(db, job.id, lane)
    _copy_to_long_lane(db, job.id)

    try:
        turn = store.empty_lane(always=True)
    finally:
        db.execute("DELETE FROM jobs WHERE id = %s", (job.id,))  # the module's lanes go on

    assert (turn.lane, turn.outcome) == (lane, "duplicate")
    assert db.execute("SELECT left_because FROM job_lanes WHERE lane = %s", (lane,)).fetchone()[
        0
    ] == ("an id in it is also in the long lane")


def test_a_send_in_a_repeatable_read_transaction_of_an_id_sent_since_into_another_lane_is_refused(
    store, db, pg_url
):
    """The primary key is (id, lane): a transaction whose snapshot predates another send of
    the same id, now in another lane, would store it twice. The send reads jobs again on a
    connection of its own and refuses, as it does for an id finished since."""
    job = _job("lanes-rr-send")
    with psycopg.connect(pg_url) as app:
        app.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        app.execute("SELECT 1").fetchone()
        app.execute("SELECT count(*) FROM pg_class").fetchone()  # the snapshot is taken
        store.enqueue(job)
        _put_in_lane(db, job.id, 3)
        with pytest.raises(psycopg.errors.SerializationFailure, match="sent or finished after"):
            store.enqueue(job, conn=app)
    assert _lane_of(db, job.id) == [3]


def test_a_unique_send_whose_snapshot_predates_an_emptying_does_not_free_the_key(store, db, pg_url):
    """At REPEATABLE READ a snapshot taken before a lane was emptied sees the lane empty
    and not the rows copied out of it: a unique job's key looks abandoned. The send
    refuses (a serialization failure) instead of freeing it and storing a second job."""
    first = _job("lanes-unique", idempotency_key="k-1", idempotency_scope="unique")
    store.enqueue(first)
    lane = _due_lane(db)
    _put_in_lane(db, first.id, lane)
    second = _job("lanes-unique", idempotency_key="k-1", idempotency_scope="unique")
    with psycopg.connect(pg_url) as app:
        app.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        app.execute("SELECT count(*) FROM pg_class").fetchone()  # the snapshot is taken
        assert store.empty_lane(always=True).outcome == "emptied"
        with pytest.raises(psycopg.errors.SerializationFailure, match="cannot see"):
            store.enqueue(second, conn=app)
    assert _lane_of(db, first.id) == [3]
    assert _lane_of(db, second.id) == []


def test_a_claim_of_an_id_stored_in_two_lanes_takes_one_row_at_a_time(store, db):
    # The claim's update finds the picked rows by id, then keeps only the (id, lane) pairs
    # picked: the other row of the id, which no claim picked (nor locked), is left queued.
    job = _job("lanes-claim-dup")
    store.enqueue(job)
    _copy_to_long_lane(db, job.id)
    try:
        first = store.claim("lanes-claim-dup", 1, "worker-1", 60)
        rows = db.execute(
            "SELECT lane, status, locked_by FROM jobs WHERE id = %s ORDER BY status", (job.id,)
        ).fetchall()
        second = store.claim("lanes-claim-dup", 1, "worker-2", 60)
        owners = db.execute(
            "SELECT locked_by FROM jobs WHERE id = %s ORDER BY locked_by", (job.id,)
        ).fetchall()
    finally:
        db.execute("DELETE FROM jobs WHERE id = %s", (job.id,))  # the module's lanes go on
    assert [c.id for c in first] == [job.id] and [c.id for c in second] == [job.id]
    assert [(status, owner) for _, status, owner in rows] == [
        ("queued", None),
        ("running", "worker-1"),
    ]
    assert owners == [("worker-1",), ("worker-2",)]


def test_an_id_in_two_lanes_starts_its_claimed_row_alone_and_ends_with_its_other(store, db):
    # The start (and a lease's renewal, a release) names the attempt's row by (id, lane):
    # the id's other row, queued, was also marked started before, which its checks refuse,
    # and the batch's start failed. The attempt's end takes the other row with it (one
    # message id runs once); history then holds that row too, never run (attempts 0).
    job = _job("lanes-end-dup")
    store.enqueue(job)
    _copy_to_long_lane(db, job.id)
    try:
        (claimed,) = store.claim("lanes-end-dup", 1, "worker-1", 60)
        attempt = Attempt(claimed.id, "worker-1", claimed.attempts)
        assert store.start([attempt], 60) == {job.id}
        assert store.renew_leases([attempt], 60).owned == {job.id}
        started = db.execute(
            "SELECT status, started FROM jobs WHERE id = %s ORDER BY status", (job.id,)
        ).fetchall()
        assert store.complete([attempt]) == {job.id}
        left = db.execute("SELECT status FROM jobs WHERE id = %s", (job.id,)).fetchall()
        finished = db.execute(
            "SELECT status, attempts FROM jobs_history WHERE id = %s ORDER BY attempts",
            (job.id,),
        ).fetchall()
    finally:
        db.execute("DELETE FROM jobs WHERE id = %s", (job.id,))  # the module's lanes go on
    assert started == [("queued", False), ("running", True)]
    assert left == []
    assert finished == [("succeeded", 0), ("succeeded", 1)]


def test_a_complete_in_block_of_an_id_in_two_lanes_locks_its_attempt_s_row(store, db, pg_url):
    # A complete_in() block at REPEATABLE READ reads the attempt's row to learn whether its
    # snapshot sees the pinned version. With the id in two lanes it read whichever row came
    # first: the queued one in a period's lane (scanned before the long lane) said "stale
    # snapshot", and the block refused a success it could write.
    job = _job("lanes-block-dup")
    store.enqueue(job)
    _copy_to_long_lane(db, job.id)
    # The long lane's row is the one claimed: the period lane's waits.
    db.execute(
        "UPDATE jobs SET available_at = now() + interval '1 hour' WHERE id = %s AND lane <> 3",
        (job.id,),
    )
    try:
        (claimed,) = store.claim("lanes-block-dup", 1, "worker-1", 60)
        attempt = Attempt(claimed.id, "worker-1", claimed.attempts)
        pinned, aborted = store.pin_completion(attempt, 60)
        with psycopg.connect(pg_url) as app:
            app.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            store.lock_lanes_for_completion(app)
            seen = store.lock_for_completion(attempt, pinned, app)
            app.execute("ROLLBACK")
        lanes = db.execute(
            "SELECT lane, status FROM jobs WHERE id = %s ORDER BY lane", (job.id,)
        ).fetchall()
    finally:
        db.execute("DELETE FROM jobs WHERE id = %s", (job.id,))  # the module's lanes go on
    assert [status for _, status in lanes] == ["queued", "running"] and lanes[1][0] == 3
    assert not aborted
    assert seen == (True, True)
