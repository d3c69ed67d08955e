"""Hot work apart from history (migration 0012): outcomes move rows into jobs_history in
their own statement, manual retries move them back, ids and idempotency keys keep their
meaning across both tables on every send path, and the send's probe of history prunes old
partitions even in the generic plans psycopg prepares."""

from __future__ import annotations

import datetime as dt
import uuid

import dramatiq
import pytest
from psycopg import sql

from dramatiq_pg_broker.errors import JobAlreadyFinished
from dramatiq_pg_broker.history import probe as history_probe
from dramatiq_pg_broker.jobs import Attempt
from dramatiq_pg_broker.retention import create_partitions

from ..rows import tables_of


def finish(broker, queue: str, job_id: str, outcome: str, now: dt.datetime | None = None) -> None:
    """Claim the job (by the server's clock) and end it with ``outcome``, at ``now`` if given."""
    if outcome == "cancelled":
        broker.store.cancel(job_id)
        return
    claimed = [c for c in broker.store.claim(queue, 100, "w", 60) if c.id == job_id]
    attempt = Attempt(job_id, "w", claimed[0].attempts)
    if outcome == "succeeded":
        assert broker.store.complete([attempt], now=now) == {job_id}
    else:
        assert broker.store.fail([attempt], ["boom"], now=now) == {job_id}


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "cancelled"])
def test_an_outcome_moves_the_row_to_history_with_its_event(
    broker, task, queue, conn, schema, outcome
):
    message = task.send(1)
    assert tables_of(conn, schema, message.message_id) == [("jobs", "queued")]
    finish(broker, queue, message.message_id, outcome)
    assert tables_of(conn, schema, message.message_id) == [("history", outcome)]
    job = broker.store.get(message.message_id)
    assert job["status"] == outcome and job["finished_at"] is not None
    assert job["locked_by"] is None and not job["started"]
    types = [e["type"] for e in broker.store.events_of(message.message_id)]
    assert types[-1] == outcome and types[0] == "created"


def test_a_batch_of_acks_moves_every_row_in_one_statement(broker, task, queue, conn, schema):
    ids = [task.send(n).message_id for n in range(20)]
    claimed = broker.store.claim(queue, 20, "w", 60)
    attempts = [Attempt(c.id, "w", c.attempts) for c in claimed]
    # A stale attempt (wrong owner) is not moved: the guard still holds.
    stale = Attempt(ids[0], "someone-else", 1)
    done = broker.store.complete([stale, *attempts[1:]])
    assert done == set(ids[1:])
    assert tables_of(conn, schema, ids[0]) == [("jobs", "running")]
    for job_id in ids[1:]:
        assert tables_of(conn, schema, job_id) == [("history", "succeeded")]


def test_a_manual_retry_moves_the_job_back_and_it_can_finish_again(
    broker, task, queue, conn, schema
):
    message = task.send(1)
    finish(broker, queue, message.message_id, "failed")
    retried = broker.store.retry_failed(message.message_id, by="ops")
    assert retried["status"] == "queued"
    assert tables_of(conn, schema, message.message_id) == [("jobs", "queued")]
    job = broker.store.get(message.message_id)
    assert (job["attempts"], job["failures"], job["finished_at"]) == (0, 0, None)
    assert job["last_error"] == "boom"
    finish(broker, queue, message.message_id, "succeeded")
    assert tables_of(conn, schema, message.message_id) == [("history", "succeeded")]
    types = [e["type"] for e in broker.store.events_of(message.message_id)]
    assert types == ["created", "claimed", "failed", "manual_retry", "claimed", "succeeded"]


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
@pytest.mark.parametrize("path", ["single", "group", "bulk", "copy"])
def test_an_id_in_history_is_refused_on_every_send_path(
    broker, task, queue, conn, schema, path, outcome
):
    done = task.send(0)
    finish(broker, queue, done.message_id, outcome)
    others = [task.message(n) for n in range(1, 250 if path == "copy" else 3)]
    if path == "single":
        with pytest.raises(JobAlreadyFinished, match=f"already {outcome}"):
            broker.enqueue(done.copy())
    elif path == "group":
        with pytest.raises(JobAlreadyFinished):
            with broker.batch():
                broker.enqueue(done.copy())
    else:
        with pytest.raises(JobAlreadyFinished, match=f"message {len(others)} of the batch"):
            broker.enqueue_many([*others, done.copy()])
    assert tables_of(conn, schema, done.message_id) == [("history", outcome)]


@pytest.mark.parametrize("path", ["single", "bulk", "copy"])
def test_a_keyed_send_finds_its_finished_job_in_history(broker, queue, conn, schema, path):
    @dramatiq.actor(broker=broker, queue_name=queue, actor_name=f"keyed_{path}")
    def keyed(n):
        pass

    key = f"order-{uuid.uuid4()}"
    first = keyed.send_with_options(args=(1,), idempotency_key=key)
    finish(broker, queue, first.message_id, "succeeded")
    again = keyed.message_with_options(args=(2,), idempotency_key=key)
    if path == "single":
        [result] = [broker.enqueue(again)]
    else:
        count = 300 if path == "copy" else 3
        sent = broker.enqueue_many([*(keyed.message(n) for n in range(count)), again])
        result = sent[-1]
    assert result.message_id == first.message_id and list(result.args) == [1]
    rows = conn.execute(
        sql.SQL("SELECT count(*) FROM {}.all_jobs WHERE idempotency_key = %s").format(
            sql.Identifier(schema)
        ),
        (key,),
    ).fetchone()[0]
    assert rows == 1


def test_the_send_probe_prunes_old_partitions_in_a_generic_plan(broker, conn, schema):
    """The probe of history by id reads the partitions from the message's timestamp on:
    with psycopg's prepared statements the plan is generic, and the older days are
    removed at execution ("Subplans Removed"), not scanned."""
    (now,) = conn.execute("SELECT now()").fetchone()
    create_partitions(conn, schema, now - dt.timedelta(days=20), 20)
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute(
        sql.SQL(
            "PREPARE history_probe (uuid, bigint) AS SELECT 1 FROM {}.jobs_history AS h "
            "WHERE h.id = $1 AND h.finished_at >= coalesce('epoch'::timestamptz "
            "+ ($2 - {slack}) * interval '1 millisecond', '-infinity')"
        ).format(sql.Identifier(schema), slack=sql.Literal(history_probe.CLOCK_SLACK_MS))
    )
    sent_at = int(now.timestamp() * 1000)
    plan = "\n".join(
        r[0]
        for r in conn.execute(
            f"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) "
            f"EXECUTE history_probe('{uuid.uuid4()}', {sent_at})"
        )
    )
    conn.execute("DEALLOCATE history_probe")
    conn.execute("RESET plan_cache_mode")
    removed = [line for line in plan.splitlines() if "Subplans Removed" in line]
    assert removed and int(removed[0].split(":")[1]) >= 3 * 19, plan
    yesterday = (now - dt.timedelta(days=2)).astimezone(dt.timezone.utc).strftime("%Y%m%d")
    assert f"_{yesterday}" not in plan, plan


def test_the_queue_counts_read_dead_letters_from_history(broker, task, queue):
    for n in range(3):
        message = task.send(n)
        finish(broker, queue, message.message_id, "failed" if n else "succeeded")
    task.send(9)
    counts = broker.store.queue_counts()[queue]
    assert (counts.ready, counts.failed) == (1, 2)
    since = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    assert broker.store.count_failed_since(queue, since) == 2


def test_flush_deletes_the_unfinished_jobs_and_their_events_and_keeps_history(
    broker, task, queue, conn, schema
):
    kept = task.send(0)
    finish(broker, queue, kept.message_id, "succeeded")
    dropped = [task.send(n).message_id for n in range(1, 4)]
    assert broker.store.flush(queue) == 3
    (events,) = conn.execute(
        sql.SQL("SELECT count(*) FROM {}.job_events WHERE job_id = ANY(%s::uuid[])").format(
            sql.Identifier(schema)
        ),
        (dropped,),
    ).fetchone()
    assert events == 0
    assert tables_of(conn, schema, kept.message_id) == [("history", "succeeded")]


def test_a_keyed_send_racing_with_the_first_jobs_move_to_history_gets_that_job(
    broker, queue, conn, schema, pg_url
):
    """The periodic scheduler's case: several processes send one tick's key while the
    first tick's job finishes. A probe of history alone would miss a move committed after
    the send's statement began, and the send would insert a second job once the moving
    transaction let go of the row; the key held in job_keys for the job's whole life
    answers at once instead."""
    import threading

    import psycopg

    @dramatiq.actor(broker=broker, queue_name=queue, actor_name="race_keyed")
    def keyed(n):
        pass

    key = f"tick-{uuid.uuid4()}"
    first = keyed.send_with_options(args=(1,), idempotency_key=key)
    [claimed] = [c for c in broker.store.claim(queue, 10, "w", 60) if c.id == first.message_id]
    results = []
    with psycopg.connect(pg_url) as mover:
        # The ack's statement, its transaction still open: the row is being moved.
        broker.store.complete([Attempt(claimed.id, "w", claimed.attempts)], conn=mover)
        sender = threading.Thread(
            target=lambda: results.append(
                keyed.send_with_options(args=(2,), idempotency_key=key).message_id
            )
        )
        sender.start()
        sender.join(1.0)
        mover.commit()
    sender.join(20)
    assert results == [first.message_id]
    rows = conn.execute(
        sql.SQL("SELECT id::text, status FROM {}.all_jobs WHERE idempotency_key = %s").format(
            sql.Identifier(schema)
        ),
        (key,),
    ).fetchall()
    assert rows == [(first.message_id, "succeeded")]


def test_a_key_whose_job_was_deleted_by_hand_is_taken_by_the_next_send(broker, queue, conn, schema):
    @dramatiq.actor(broker=broker, queue_name=queue, actor_name="stale_keyed")
    def keyed(n):
        pass

    key = f"k-{uuid.uuid4()}"
    first = keyed.send_with_options(args=(1,), idempotency_key=key)
    conn.execute(
        sql.SQL("DELETE FROM {}.jobs WHERE id = %s").format(sql.Identifier(schema)),
        (first.message_id,),
    )
    again = keyed.send_with_options(args=(2,), idempotency_key=key)
    assert again.message_id != first.message_id and list(again.args) == [2]
    assert tables_of(conn, schema, again.message_id) == [("jobs", "queued")]


def history_locks(conn, schema: str) -> set[str]:
    """The partitions of history this session holds a lock on (in its transaction)."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_locks AS l JOIN pg_class AS c ON c.oid = l.relation "
        "JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE l.pid = pg_backend_pid() "
        "AND n.nspname = %s AND c.relkind = 'r' AND c.relname LIKE 'jobs_history_%%'",
        (schema,),
    ).fetchall()
    return {r[0] for r in rows}


@pytest.fixture
def noon(monkeypatch):
    """This process's clock at noon (UTC) of the server's day, and its ms timestamp: the
    send probes that day's partitions only, whatever the real time. A job that must be
    found finishes at noon too (``finish(..., now=at_noon(stamp))``): by the real clock it
    could finish before the message's fake stamp, where no probe looks."""

    def at(conn) -> int:
        (today,) = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()
        stamp = dt.datetime.combine(today, dt.time(12), dt.timezone.utc).timestamp()
        monkeypatch.setattr(history_probe.time, "time", lambda: stamp)
        return int(stamp * 1000), f"{today:%Y%m%d}"

    return at


def at_noon(stamp: int) -> dt.datetime:
    """A minute after the message stamped ``stamp`` (ms) was built."""
    return dt.datetime.fromtimestamp(stamp / 1000 + 60, dt.timezone.utc)


def test_a_send_locks_only_the_partitions_of_its_day(broker, task, conn, schema, noon):
    """A generic plan of the probe written against the parent locks every partition of
    history at each execution (dozens with a month of retention); the send names its
    day's three instead."""
    (now,) = conn.execute("SELECT now()").fetchone()
    create_partitions(conn, schema, now - dt.timedelta(days=30), 30)
    stamp, day = noon(conn)
    for n in range(7):  # past psycopg's prepare threshold: the plan is generic
        with conn.transaction(), broker.transaction(conn):
            broker.enqueue(task.message(n).copy(message_timestamp=stamp))
            locked = history_locks(conn, schema)
    assert locked == {f"jobs_history_{s}_{day}" for s in ("succeeded", "failed", "cancelled")}
    # Without a timestamp to bound it, the probe reads the parent: every partition.
    with conn.transaction(), broker.transaction(conn):
        broker.enqueue(task.message(9).copy(message_timestamp=None))
        assert len(history_locks(conn, schema)) > 3 * 30


def test_a_finished_id_is_found_in_its_days_partition(broker, task, queue, conn, schema, noon):
    stamp, _ = noon(conn)
    done = task.message(0).copy(message_timestamp=stamp)
    broker.enqueue(done)
    finish(broker, queue, done.message_id, "failed", now=at_noon(stamp))
    for send in (broker.enqueue, lambda m: broker.enqueue_many([m])):
        with pytest.raises(JobAlreadyFinished, match="already failed"):
            send(done.copy())
    assert tables_of(conn, schema, done.message_id) == [("history", "failed")]


def test_a_partition_dropped_by_hand_sends_through_the_parent(
    broker, task, queue, conn, schema, noon
):
    stamp, day = noon(conn)
    first = task.message(0).copy(message_timestamp=stamp)
    broker.enqueue(first)  # the day's partitions are known (and the statement prepared)
    conn.execute(
        sql.SQL("DROP TABLE {}").format(sql.Identifier(schema, f"jobs_history_failed_{day}"))
    )
    second = task.message(1).copy(message_timestamp=stamp)
    broker.enqueue(second)
    assert tables_of(conn, schema, second.message_id) == [("jobs", "queued")]
    # The failed job now lands in the DEFAULT partition, where the parent's probe finds it.
    finish(broker, queue, first.message_id, "failed", now=at_noon(stamp))
    with pytest.raises(JobAlreadyFinished):
        broker.enqueue(first.copy())
