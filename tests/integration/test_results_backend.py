"""PostgresBackend against real PostgreSQL: the scenarios Dramatiq runs against its Redis and
Memcached result backends, with PostgresBroker and with Dramatiq's Redis and RabbitMQ
brokers; LISTEN/NOTIFY wake-ups, millisecond timeouts, TTLs and reclaiming."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

import dramatiq
import psycopg
import pytest
from dramatiq.encoder import PickleEncoder
from dramatiq.message import Message
from dramatiq.results import ResultFailure, ResultMissing, Results, ResultTimeout
from psycopg import sql

from dramatiq_pg_broker.results import PostgresBackend, describe_stored, prune_expired

from ..helpers import StatementCounter, drop_schema, new_schema_name
from .results_support import BROKER_KINDS, BrokerHarness

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def backend(pg_url, schema):
    backend = PostgresBackend(url=pg_url, schema=schema, namespace=f"ns-{uuid.uuid4().hex}")
    yield backend
    backend.close()


@pytest.fixture(params=BROKER_KINDS)
def h(request, pg_url, schema, backend):
    """A broker of each kind (the test runs once with each) with Dramatiq's Results
    middleware storing into ``backend``."""
    harness = BrokerHarness(request.param, pg_url, schema)
    harness.broker.add_middleware(Results(backend=backend))
    yield harness
    harness.close()


def a_message(queue="default", actor="do_work"):
    return Message(queue_name=queue, actor_name=actor, args=(), kwargs={}, options={})


def stored_rows(conn, schema, message):
    query = sql.SQL("SELECT count(*) FROM {}.results WHERE message_id = %s").format(
        sql.Identifier(schema)
    )
    return conn.execute(query, (message.message_id,)).fetchone()[0]


# -- Dramatiq's scenarios, on every broker ---------------------------------------------------


def test_actors_can_store_results(h, backend):

    @dramatiq.actor(store_results=True, queue_name=h.queue)
    def do_work():
        return {"answer": 42, "list": [1, 2.5, "x"]}

    h.start()
    message = do_work.send()
    assert backend.get_result(message, block=True, timeout=30_000) == {
        "answer": 42,
        "list": [1, 2.5, "x"],
    }
    # The inferred backend (the global broker's Results middleware) gives the same.
    assert message.get_result(block=True) == {"answer": 42, "list": [1, 2.5, "x"]}


def test_actors_can_store_exceptions(h, backend):

    @dramatiq.actor(store_results=True, max_retries=0, queue_name=h.queue)
    def do_work():
        raise RuntimeError("failed")

    h.start()
    message = do_work.send()
    with pytest.raises(ResultFailure) as e:
        backend.get_result(message, block=True, timeout=30_000)
    assert str(e.value) == "actor raised RuntimeError: failed"
    assert e.value.orig_exc_type == "RuntimeError"
    assert e.value.orig_exc_msg == "failed"


def test_a_missing_result_raises_result_missing_and_a_late_one_times_out(h, backend):
    release = threading.Event()

    @dramatiq.actor(store_results=True, queue_name=h.queue)
    def do_work():
        release.wait(30)
        return 42

    h.start()
    message = do_work.send()
    with pytest.raises(ResultMissing):
        backend.get_result(message)
    with pytest.raises(ResultTimeout):
        backend.get_result(message, block=True, timeout=100)
    release.set()
    assert backend.get_result(message, block=True, timeout=30_000) == 42


def test_group_and_pipeline_results(h, backend):

    @dramatiq.actor(store_results=True, queue_name=h.queue)
    def add(x, y=0):
        return x + y

    h.start()
    g = dramatiq.group([add.message(i, i) for i in range(6)]).run()
    assert list(g.get_results(block=True, timeout=30_000)) == [0, 2, 4, 6, 8, 10]
    g.wait(timeout=30_000)
    assert g.completed and g.completed_count == 6

    pipe = (add.message(1) | add.message(2) | add.message(3)).run()
    assert pipe.get_result(block=True, timeout=30_000) == 6
    assert list(pipe.get_results(block=True, timeout=30_000)) == [1, 3, 6]
    assert pipe.completed_count == 3


def test_a_group_that_cannot_finish_in_time_times_out(h, backend):
    release = threading.Event()

    @dramatiq.actor(store_results=True, queue_name=h.queue)
    def slow():
        release.wait(30)

    h.start()
    g = dramatiq.group([slow.message() for _ in range(3)]).run()
    started = time.monotonic()
    with pytest.raises(ResultTimeout):
        g.wait(timeout=300)
    elapsed = time.monotonic() - started
    release.set()
    assert 0.29 <= elapsed < 5, f"a 300 ms group wait took {elapsed:.3f}s"


def test_a_message_skipped_by_the_age_limit_stores_a_skip_failure(h, backend):

    @dramatiq.actor(store_results=True, max_age=1, queue_name=h.queue)
    def do_work():
        return 42

    message = do_work.send_with_options(delay=50)
    h.start()
    with pytest.raises(ResultFailure) as e:
        backend.get_result(message, block=True, timeout=30_000)
    assert e.value.orig_exc_type == "SkipMessage"


# -- the backend on its own --------------------------------------------------------------------


def test_results_stored_directly_are_read_back(backend):
    message = a_message()
    key = backend.build_message_key(message)
    # _store is the method Dramatiq's ResultBackend contract has backends implement.
    backend._store(key, 42, 3_600_000)
    assert backend.get_result(message, block=True) == 42
    assert backend.get_result(message) == 42


def test_namespace_prefix_keys_are_readable(pg_url, schema, conn):
    backend = PostgresBackend(
        url=pg_url, schema=schema, namespace="myns", use_namespace_prefix_keys=True
    )
    try:
        message = a_message()
        backend.store_result(message, 7, 60_000)
        key = conn.execute(
            sql.SQL("SELECT key FROM {}.results WHERE message_id = %s").format(
                sql.Identifier(schema)
            ),
            (message.message_id,),
        ).fetchone()[0]
        assert key == f"myns:default:do_work:{message.message_id}"
        assert backend.get_result(message) == 7
    finally:
        backend.close()


def test_a_blocked_reader_wakes_on_the_notification_without_polling(backend, monkeypatch):
    message = a_message()
    lookup = backend.expiring["live_value"]
    got = {}

    def reader():
        got["value"] = backend.get_result(message, block=True, timeout=60_000)
        got["at"] = time.monotonic()

    with StatementCounter(monkeypatch) as statements:

        def reads() -> int:
            return statements[lookup]

        thread = threading.Thread(target=reader)
        thread.start()
        deadline = time.monotonic() + 30
        while not reads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reads(), "the reader never looked for its result"
        # Long enough that a polling reader (Dramatiq's base backend backs off 100, 200,
        # 400, 800 ms ...) would have looked several times.
        time.sleep(1.5)
        assert reads() == 1, f"the blocked reader looked {reads()} times before any store"
        stored_at = time.monotonic()
        backend.store_result(message, "done", 60_000)
        thread.join(30)
        assert got["value"] == "done"
        assert reads() == 2, f"one wake-up should need one more read, not {reads() - 1}"
    latency = got["at"] - stored_at
    assert latency < 1.0, f"the reader woke {latency:.3f}s after the store"


def test_block_with_zero_timeout_looks_once(backend):
    message = a_message()
    with pytest.raises(ResultTimeout):
        backend.get_result(message, block=True, timeout=0)
    backend.store_result(message, 1, 60_000)
    assert backend.get_result(message, block=True, timeout=0) == 1


@pytest.mark.parametrize("timeout_ms", [50, 250])
def test_millisecond_timeouts_are_honoured(backend, timeout_ms):
    message = a_message()
    started = time.monotonic()
    with pytest.raises(ResultTimeout):
        backend.get_result(message, block=True, timeout=timeout_ms)
    elapsed = time.monotonic() - started
    assert timeout_ms / 1000 - 0.005 <= elapsed < timeout_ms / 1000 + 2, elapsed


def test_many_readers_of_different_keys_each_wake_for_their_own(backend):
    messages = [a_message() for _ in range(8)]
    got = {}

    def reader(m):
        got[m.message_id] = backend.get_result(m, block=True, timeout=60_000)

    threads = [threading.Thread(target=reader, args=(m,)) for m in messages]
    for t in threads:
        t.start()
    for i, m in enumerate(reversed(messages)):
        backend.store_result(m, i, 60_000)
    for t in threads:
        t.join(60)
    assert got == {m.message_id: i for i, m in enumerate(reversed(messages))}


def test_an_expired_result_is_gone_at_once_and_reclaimed_through_the_index(backend, conn, schema):
    message = a_message()
    backend.reclaimer.next_run = float("inf")  # no opportunistic pass in this test
    backend.store_result(message, 1, 1)
    time.sleep(0.01)
    # Still in the table, but no reader sees it.
    assert stored_rows(conn, schema, message) == 1
    with pytest.raises(ResultMissing):
        backend.get_result(message)
    with pytest.raises(ResultTimeout):
        backend.get_result(message, block=True, timeout=50)
    assert prune_expired(conn, schema, limit=1000) >= 1
    assert stored_rows(conn, schema, message) == 0


def test_reclaiming_reads_the_expiry_index_not_the_table(backend, conn, schema):
    table = sql.SQL("{}.results").format(sql.Identifier(schema))
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (key, message_id, value, expires_at) "
            "SELECT 'live-' || i, i::text, '\\x00', now() + interval '1 hour' "
            "FROM generate_series(1, 20000) AS i"
        ).format(table)
    )
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (key, message_id, value, expires_at) "
            "SELECT 'dead-' || i, i::text, '\\x00', now() - interval '1 hour' "
            "FROM generate_series(1, 30) AS i"
        ).format(table)
    )
    conn.execute(sql.SQL("ANALYZE {}").format(table))
    statement = backend.expiring["prune_expired"]
    with conn.transaction():
        plan = "\n".join(
            r[0] for r in conn.execute("EXPLAIN " + statement, {"limit": 10}).fetchall()
        )
    assert "results_expires_at_idx" in plan, plan
    assert "Seq Scan" not in plan, plan
    assert prune_expired(conn, schema, limit=10) == 10
    assert prune_expired(conn, schema, limit=1000) == 20
    assert prune_expired(conn, schema, limit=1000) == 0
    live = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0]
    assert live >= 20000
    conn.execute(sql.SQL("DELETE FROM {} WHERE key LIKE 'live-%%'").format(table))


def test_writers_reclaim_expired_results_as_they_go(pg_url, schema, conn):
    backend = PostgresBackend(url=pg_url, schema=schema, prune_batch=5, prune_interval=60)
    try:
        expired = [a_message() for _ in range(12)]
        for m in expired:
            backend.store_result(m, 0, 1)
        time.sleep(0.01)
        # The first store ran a pass (nothing had expired yet); the interval holds further
        # passes back until a pass finds a full batch.
        backend.reclaimer.next_run = 0.0
        for _ in range(4):
            backend.store_result(a_message(), 1, 60_000)
        left = sum(stored_rows(conn, schema, m) for m in expired)
        assert left == 0, f"{left} expired results are still stored"
    finally:
        backend.close()


def test_a_new_result_replaces_the_old_one_and_its_ttl(backend):
    message = a_message()
    backend.store_result(message, "first", 1)
    backend.store_result(message, "second", 60_000)
    time.sleep(0.01)
    assert backend.get_result(message) == "second"


def test_pickled_results_round_trip(pg_url, schema):
    backend = PostgresBackend(url=pg_url, schema=schema, encoder=PickleEncoder())
    try:
        message = a_message()
        backend.store_result(message, {1, 2, 3}, 60_000)
        assert backend.get_result(message, block=True) == {1, 2, 3}
    finally:
        backend.close()


def test_polling_mode_without_listen_still_gets_results(pg_url, schema):
    backend = PostgresBackend(url=pg_url, schema=schema, listen=False)
    try:
        message = a_message()
        timer = threading.Timer(0.2, backend.store_result, (message, 5, 60_000))
        timer.start()
        assert backend.get_result(message, block=True, timeout=30_000) == 5
        timer.join()
    finally:
        backend.close()


def test_a_reader_survives_its_listening_connection_being_killed(backend, conn):
    from dramatiq_pg_broker.db.core import application_name

    message = a_message()
    got = {}

    def reader():
        got["value"] = backend.get_result(message, block=True, timeout=60_000)

    thread = threading.Thread(target=reader)
    thread.start()
    deadline = time.monotonic() + 30
    listening = []
    while not listening and time.monotonic() < deadline:
        # The process's one LISTEN connection (its last statement may be the LISTEN of
        # another channel: a queue's, say).
        listening = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE 'LISTEN %%' "
            "AND application_name = %s AND pid <> pg_backend_pid()",
            (application_name(),),
        ).fetchall()
        time.sleep(0.02)
    assert listening, "no connection of this process listens"
    for (pid,) in listening:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    time.sleep(0.3)
    backend.store_result(message, "after the kill", 60_000)
    thread.join(60)
    assert got.get("value") == "after the kill"


def test_store_exception_from_another_process(backend, pg_url, schema):
    message = a_message()
    code = (
        "import sys; from dramatiq.message import Message;"
        "from dramatiq_pg_broker.results import PostgresBackend;"
        f"b = PostgresBackend(url={pg_url!r}, schema={schema!r}, namespace={backend.namespace!r});"
        f"m = Message(queue_name='default', actor_name='do_work', args=(), kwargs={{}},"
        f" options={{}}, message_id={message.message_id!r});"
        "b.store_exception(m, ValueError('from elsewhere'), 60000)"
    )
    waiter = {}

    def reader():
        try:
            backend.get_result(message, block=True, timeout=60_000)
        except ResultFailure as e:
            waiter["error"] = e

    thread = threading.Thread(target=reader)
    thread.start()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    thread.join(60)
    assert waiter["error"].orig_exc_type == "ValueError"
    assert waiter["error"].orig_exc_msg == "from elsewhere"


def test_a_backend_on_its_own_schema_beside_the_broker(pg_url, schema):
    from dramatiq_pg_broker.migrate import migrate

    own = new_schema_name("r")
    migrate(pg_url, own)
    harness = BrokerHarness("postgres", pg_url, schema)
    backend = PostgresBackend(url=pg_url, schema=own)
    try:
        harness.broker.add_middleware(Results(backend=backend))

        @dramatiq.actor(store_results=True, queue_name=harness.queue)
        def double(x):
            return 2 * x

        harness.start()
        message = double.send(21)
        assert message.get_result(block=True, timeout=30_000) == 42
        with psycopg.connect(pg_url) as c:
            count = c.execute(
                sql.SQL("SELECT count(*) FROM {}.results WHERE message_id = %s").format(
                    sql.Identifier(own)
                ),
                (message.message_id,),
            ).fetchone()[0]
        assert count == 1
    finally:
        harness.close()
        backend.close()
        drop_schema(pg_url, own)


def test_a_backend_on_the_brokers_pool_and_schema(pg_url, schema, conn):
    harness = BrokerHarness("postgres", pg_url, schema)
    try:
        backend = PostgresBackend(broker=harness.broker)
        assert backend.pool is harness.broker.pool and backend.schema == schema
        harness.broker.add_middleware(Results(backend=backend))

        @dramatiq.actor(store_results=True, queue_name=harness.queue)
        def one():
            return 1

        harness.start()
        message = one.send()
        assert message.get_result(block=True, timeout=30_000) == 1
        assert stored_rows(conn, schema, message) == 1
    finally:
        harness.close()


def test_describe_stored_shows_results_failures_and_opaque_values():
    assert describe_stored(b'{"a":1}', False) == {
        "failed": False,
        "encoding": "json",
        "value": {"a": 1},
    }
    failure = b'{"__t":"dramatiq.results.Result","exn":{"type":"KeyError","msg":"x"}}'
    assert describe_stored(failure, True) == {
        "failed": True,
        "encoding": "json",
        "error": {"type": "KeyError", "message": "x"},
    }
    assert describe_stored(b"\x80\x04\x95", False) == {"failed": False, "encoding": "binary"}


def test_a_broker_that_is_not_postgres_is_refused():
    from dramatiq.brokers.stub import StubBroker

    from dramatiq_pg_broker import ConfigurationError

    with pytest.raises(ConfigurationError, match="url="):
        PostgresBackend(broker=StubBroker())
