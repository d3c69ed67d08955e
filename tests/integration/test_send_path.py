"""The send side: message fidelity, re-enqueueing an id, scoped idempotency keys, bad
options refused at send(), and join's fail-fast clock."""

from __future__ import annotations

import datetime as dt
import json
import math
import time
import types
import uuid

import dramatiq
import pytest
from dramatiq.middleware import CurrentMessage

from dramatiq_pg_broker import PostgresBroker
from dramatiq_pg_broker import broker as broker_module
from dramatiq_pg_broker.broker import JobFailed
from dramatiq_pg_broker.errors import InvalidMessage, JobAlreadyFinished
from dramatiq_pg_broker.jobs import Attempt

from ..helpers import wait_for


@pytest.fixture
def encoder():
    previous = dramatiq.get_encoder()
    yield dramatiq.set_encoder
    dramatiq.set_encoder(previous)


def count_rows(broker, conn, queue) -> int:
    return conn.execute(
        f'SELECT count(*) FROM "{broker.settings.schema}".jobs WHERE queue_name = %s', (queue,)
    ).fetchone()[0]


# -- message fidelity ----------------------------------------------------------------------


def test_the_actor_receives_exactly_what_the_json_encoder_round_trips(broker, queue):
    received = []

    @dramatiq.actor(broker=broker, queue_name=queue)
    def task(*args, **kwargs):
        received.append((args, kwargs))

    args = (1e20, -0.0, 0.1, 2**70, "\u0000", float("nan"), float("inf"), float("-inf"))
    kwargs = {"zebra": 1, "apple": {"b": 2, "a": 1}, "text": "a\u0000b\ud800"}
    message = task.send(*args, **kwargs)
    row = broker.store.get(message.message_id)
    assert bytes(row["message_bytes"]) == message.encode(), "the stored bytes are the encoder's"

    broker.start_worker()
    broker.join(queue, timeout=20_000)
    [(got_args, got_kwargs)] = received
    assert type(got_args[0]) is float and got_args[0] == 1e20
    assert math.copysign(1, got_args[1]) == -1, "-0.0 came back as 0.0"
    assert got_args[2:5] == (0.1, 2**70, "\u0000")
    assert math.isnan(got_args[5]) and got_args[6:] == (float("inf"), float("-inf"))
    assert list(got_kwargs) == ["zebra", "apple", "text"], "key order changed"
    assert list(got_kwargs["apple"]) == ["b", "a"]
    assert got_kwargs["text"] == "a\u0000b\ud800"
    assert broker.store.get(message.message_id)["status"] == "succeeded"
    # The jsonb view (display only) is a safe copy, never null for a JSON message.
    view = row["message"]
    assert view["args"][5] == "NaN" and view["args"][4] == "\ufffd"
    assert view["kwargs"]["text"] == "a\ufffdb\ufffd"


class DatetimeEncoder(dramatiq.JSONEncoder):
    """A user's encoder: datetimes travel as tagged ISO strings and come back as datetimes."""

    def encode(self, data):
        def default(value):
            if isinstance(value, dt.datetime):
                return {"$dt": value.isoformat()}
            raise TypeError(f"{type(value).__name__} is not JSON serializable")

        return json.dumps(data, default=default, separators=(",", ":")).encode()

    def decode(self, data):
        def hook(obj):
            return dt.datetime.fromisoformat(obj["$dt"]) if set(obj) == {"$dt"} else obj

        return json.loads(data, object_hook=hook)


def test_a_json_encoder_subclass_set_with_set_encoder_is_used(broker, queue, encoder):
    encoder(DatetimeEncoder())
    received = []

    @dramatiq.actor(broker=broker, queue_name=queue)
    def task(when):
        received.append(when)

    when = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)
    message = task.send(when)
    assert broker.store.get(message.message_id)["message"]["args"] == [{"$dt": when.isoformat()}]
    broker.start_worker()
    broker.join(queue, timeout=20_000)
    assert received == [when]


def test_a_value_the_encoder_cannot_encode_is_a_clear_error_at_send(broker, queue, conn):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def task(value):
        pass

    with pytest.raises(InvalidMessage, match="cannot be encoded by JSONEncoder") as excinfo:
        task.send(object())
    assert isinstance(excinfo.value, ValueError)
    with pytest.raises(InvalidMessage, match="cannot be encoded"):
        task.send(dt.date(2026, 1, 1))
    assert count_rows(broker, conn, queue) == 0


def test_the_message_is_stored_once_and_shown_the_same(broker, queue, conn):
    """A message jsonb holds as it is keeps no jsonb copy in the row (migration 0018): the
    view all_jobs parses the bytes, unfinished and finished, and shows what the copy did.
    A display-safe copy is still stored and shown; bytes that are not JSON show nothing,
    and a row with only its jsonb copy (an earlier release's) shows its copy."""

    @dramatiq.actor(broker=broker, queue_name=queue)
    def task(*args, **kwargs):
        pass

    schema = broker.settings.schema
    plain = task.send(1, "two", {"three": [3.5, None]}, flag=True)
    safe = task.send(float("nan"), "a\u0000b")
    # One small batch (one statement) and one large enough for the direct COPY.
    batches = [
        broker.enqueue_many([task.message(n) for n in range(2)]),
        broker.enqueue_many([task.message(n) for n in range(broker.store.BULK_COPY_MIN)]),
    ]
    plain_ones = [plain, batches[0][0], batches[1][0], batches[1][-1]]

    def stored(table, message_id):
        return conn.execute(
            f'SELECT message FROM "{schema}".{table} WHERE id = %s', (message_id,)
        ).fetchone()[0]

    def shown(message_id):
        return broker.store.get(message_id)["message"]

    for message in plain_ones:
        assert stored("jobs", message.message_id) is None, "the parsed bytes are stored again"
        assert shown(message.message_id) == json.loads(message.encode())
    assert stored("jobs", safe.message_id)["args"] == ["NaN", "a\ufffdb"]
    assert shown(safe.message_id)["args"] == ["NaN", "a\ufffdb"]

    broker.start_worker()
    broker.join(queue, timeout=20_000)
    for message in plain_ones:
        assert stored("jobs_history", message.message_id) is None
        assert shown(message.message_id) == json.loads(message.encode())
    assert shown(safe.message_id)["args"] == ["NaN", "a\ufffdb"]
    conn.execute(
        f'UPDATE "{schema}".jobs_history SET message_bytes = %s WHERE id = %s',
        (b"\x80\x04opaque", plain.message_id),
    )
    assert shown(plain.message_id) is None
    conn.execute(
        f'UPDATE "{schema}".jobs_history SET message = %s, message_bytes = NULL WHERE id = %s',
        (json.dumps({"args": [7]}), plain.message_id),
    )
    assert shown(plain.message_id) == {"args": [7]}


# -- enqueueing an existing id -------------------------------------------------------------


def test_enqueueing_a_queued_message_again_reschedules_it(broker, queue, conn):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def task():
        pass

    message = task.send()
    before = broker.store.get(message.message_id)["available_at"]
    broker.enqueue(message.copy(), delay=60_000)
    row = broker.store.get(message.message_id)
    assert row["status"] == "queued"
    assert dt.timedelta(seconds=55) < row["available_at"] - before < dt.timedelta(seconds=90)
    assert count_rows(broker, conn, queue) == 1


def test_enqueueing_a_running_message_again_reschedules_its_row(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def task():
        pass

    message = task.send()
    [claimed] = broker.store.claim(queue, 1, "other-worker", 60)
    result = broker.enqueue(message.copy(), delay=30_000)
    assert result.message_id == message.message_id
    row = broker.store.get(message.message_id)
    assert row["status"] == "queued" and row["locked_by"] is None
    assert row["available_at"] > row["updated_at"] + dt.timedelta(seconds=25)
    # The attempt that was running no longer owns the row: its ack writes nothing.
    attempt = Attempt(claimed.id, "other-worker", claimed.attempts)
    assert broker.store.complete([attempt]) == set()
    events = [e["type"] for e in broker.store.events_of(message.message_id)]
    assert events[-1] == "retry_scheduled"
    # It can be claimed again even with max_retries=0.
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=60)
    assert [j.id for j in broker.store.claim(queue, 1, "w", 60, now=later)] == [claimed.id]


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "cancelled"])
def test_enqueueing_a_finished_message_again_raises(broker, queue, outcome):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def task():
        pass

    message = task.send()
    if outcome == "cancelled":
        broker.store.cancel(message.message_id)
    else:
        [claimed] = broker.store.claim(queue, 1, "w", 60)
        attempt = Attempt(claimed.id, "w", claimed.attempts)
        if outcome == "succeeded":
            broker.store.complete([attempt])
        else:
            broker.store.fail([attempt], ["boom"])
    with pytest.raises(JobAlreadyFinished, match=f"already {outcome}"):
        broker.enqueue(message.copy(), delay=1000)
    assert broker.store.get(message.message_id)["status"] == outcome


def test_an_actor_that_snoozes_itself_runs_again(broker, queue):
    runs = []

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def snoozer():
        runs.append(time.monotonic())
        if len(runs) == 1:
            broker.enqueue(CurrentMessage.get_current_message().copy(), delay=200)

    message = snoozer.send()
    broker.start_worker()
    wait_for(lambda: len(runs) == 2, 20, "the snoozed job's second run")
    broker.join(queue, timeout=20_000)
    row = broker.store.get(message.message_id)
    assert row["status"] == "succeeded"
    assert len(runs) == 2


# -- idempotency keys ----------------------------------------------------------------------


def test_idempotency_keys_are_scoped_by_actor(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def first_actor(n):
        pass

    @dramatiq.actor(broker=broker, queue_name=f"{queue}_other")
    def second_actor(n):
        pass

    key = f"k-{uuid.uuid4()}"
    a = first_actor.send_with_options(args=(1,), idempotency_key=key)
    b = second_actor.send_with_options(args=(2,), idempotency_key=key)
    assert b.message_id != a.message_id, "actor B got actor A's job"
    assert broker.store.get(b.message_id)["actor_name"] == "second_actor"
    again = first_actor.send_with_options(args=(3,), idempotency_key=key)
    assert again.message_id == a.message_id and again.args == (1,)


@pytest.mark.parametrize(
    "key, words",
    [("", "must not be empty"), (42, "must be a string"), ("a\x00b", "NUL"), ("x" * 1001, "1000")],
)
def test_a_bad_idempotency_key_is_a_value_error(broker, queue, conn, key, words):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def task():
        pass

    with pytest.raises(ValueError, match="idempotency_key") as excinfo:
        task.send_with_options(idempotency_key=key)
    assert words in str(excinfo.value)
    assert count_rows(broker, conn, queue) == 0


# -- bad options at send() -----------------------------------------------------------------


@pytest.mark.parametrize(
    "options, words",
    [
        ({"priority": 2**31}, "priority must be an integer from -2147483648 to 2147483647"),
        ({"priority": -(2**31) - 1}, "priority must be an integer from -2147483648"),
        ({"priority": "high"}, "priority must be an integer"),
        ({"priority": 1.5}, "priority must be an integer"),
        ({"delay": 10**17}, "delay must be an integer from 0 to 315360000000 milliseconds"),
        ({"delay": -5}, "delay must be an integer from 0"),
        ({"eta": 10**17}, "eta must be at most 315360000000 milliseconds"),
        ({"eta": "tomorrow"}, "eta must be a time in epoch milliseconds"),
        ({"max_retries": -1}, "max_retries must be an integer from 0"),
        ({"max_retries": 2**40}, "max_retries must be an integer from 0 to 2147483646"),
    ],
)
def test_bad_send_options_raise_a_value_error_naming_the_option(
    broker, queue, conn, options, words
):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def task():
        pass

    with pytest.raises(ValueError) as excinfo:
        task.send_with_options(**options)
    assert words in str(excinfo.value)
    assert count_rows(broker, conn, queue) == 0


def test_a_message_id_that_is_not_a_uuid_is_a_value_error(broker, queue):
    @dramatiq.actor(broker=broker, queue_name=queue)
    def task():
        pass

    with pytest.raises(ValueError, match="message_id must be a UUID"):
        broker.enqueue(task.message().copy(message_id="not-a-uuid"))


# -- join(fail_fast=True) uses the server's clock ------------------------------------------


def skewed_clock(monkeypatch, seconds: float) -> None:
    """This host's clock, as the broker module sees it, is ``seconds`` off the server's."""

    class Skewed(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return dt.datetime.now(tz) + dt.timedelta(seconds=seconds)

    fake = types.SimpleNamespace(datetime=Skewed, timedelta=dt.timedelta, timezone=dt.timezone)
    monkeypatch.setattr(broker_module, "dt", fake, raising=False)


def test_join_fail_fast_sees_a_failure_when_this_host_runs_ahead(broker, queue, monkeypatch):
    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def doomed():
        time.sleep(0.3)
        raise RuntimeError("boom")

    skewed_clock(monkeypatch, +5)
    doomed.send()
    broker.start_worker()
    with pytest.raises(JobFailed):
        broker.join(queue, timeout=20_000, fail_fast=True)


def test_join_fail_fast_ignores_an_earlier_failure_when_this_host_runs_behind(
    broker, queue, monkeypatch
):
    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def doomed():
        raise RuntimeError("boom")

    message = doomed.send()
    broker.start_worker()
    wait_for(lambda: broker.store.get(message.message_id)["status"] == "failed", 20, "failure")
    # Past join's one-second grace, by the server's clock.
    finished = broker.store.get(message.message_id)["finished_at"]
    wait_for(lambda: broker.store.server_now() - finished > dt.timedelta(seconds=1.5), 20, "time")
    skewed_clock(monkeypatch, -5)
    broker.join(queue, timeout=20_000, fail_fast=True)  # an idle queue: returns at once


def test_a_send_is_one_prepared_statement_in_one_round_trip(pg_url, schema, queue, tmp_path):
    """A durable send is a single autocommit statement: no BEGIN, no separate COMMIT, and
    (once psycopg has prepared it) no query text sent again. (The wake-up of its queue is
    the notifier's statement, after it: held back here by a long interval.)"""
    broker = PostgresBroker(url=pg_url, schema=schema, pool_min_size=1, pool_max_size=1)
    try:

        @dramatiq.actor(broker=broker, queue_name=queue)
        def task(n):
            pass

        for n in range(10):  # psycopg prepares a statement on its fifth execution
            task.send(n)
        broker.sender.notifier.interval = 60.0
        task.send(10)  # its wake-up: the notifier's next statement is a minute after it
        assert broker.sender.notifier.flush(5)
        trace = tmp_path / "trace.txt"
        with open(trace, "w") as f:
            with broker.pool.connection() as c:
                c.pgconn.trace(f.fileno())
            task.send(99)
            with broker.pool.connection() as c:
                c.pgconn.untrace()
        sent = [line.split("\t")[3].split()[0] for line in trace.read_text().splitlines()
                if line.split("\t")[1] == "F"]  # fmt: skip
        assert sent.count("Sync") == 1, sent  # one round trip
        assert "Query" not in sent and "Parse" not in sent, sent  # prepared, no COMMIT
    finally:
        broker.close()
