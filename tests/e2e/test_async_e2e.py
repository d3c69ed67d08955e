"""Async applications end to end: the FastAPI example (``examples/fastapi``) served by
uvicorn, its workers (``dramatiq examples.fastapi.tasks``), real PostgreSQL; and jobs that a
psycopg ``AsyncConnection`` or a SQLAlchemy ``AsyncSession`` committed with the
application's row, run by that worker.

The example's table and the broker's live in the module's schema (the database URL carries
``search_path``). Rollbacks and savepoints of async blocks are in
``tests/integration/test_send_async.py``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import dramatiq
import httpx
import psycopg
import pytest
from psycopg import sql
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from dramatiq_pg_broker import PostgresBroker
from examples.fastapi.models import Order, sqlalchemy_url
from tests.rows import created_count

from .workers import REPO, wait_for, wait_until_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def database_url(pg_url, schema):
    """The example's DATABASE_URL: the test database, the module's schema first on the
    search path."""
    if not pg_url.startswith(("postgresql://", "postgres://")):
        pytest.skip("the FastAPI example needs a postgresql:// URL")
    separator = "&" if "?" in pg_url else "?"
    return f"{pg_url}{separator}options=-csearch_path%3D{schema}"


@pytest.fixture(scope="module")
def worker(pg_url, schema, database_url, tmp_path_factory):
    """``dramatiq examples.fastapi.tasks --processes 1 --threads 2``, ready for action."""
    from .workers import WorkerProcess

    log = tmp_path_factory.mktemp("fastapi-worker") / "worker.log"
    process = WorkerProcess(
        pg_url, schema, log, app="examples.fastapi.tasks", DATABASE_URL=database_url
    )
    process.wait_ready()
    yield process
    process.kill_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(schema, database_url, tmp_path_factory):
    """``uvicorn examples.fastapi.app:app`` (its start-up creates the orders table)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("fastapi-server") / "uvicorn.log"
    log = open(log_path, "wb")
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DRAMATIQ_PG_SCHEMA": schema,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "examples.fastapi.app:app", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"

    def up():
        try:
            return httpx.get(f"{base}/openapi.json", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, 60, "uvicorn to serve", on_timeout=lambda: log_path.read_text(errors="replace"))
    with httpx.Client(base_url=base, timeout=10) as client:
        yield client
    process.terminate()
    process.wait(10)
    log.close()


@pytest.fixture(scope="module")
def broker(pg_url, schema):
    """A broker in the test process, with a stand-in for the workers' actor (same name and
    queue), to send its messages."""
    broker = PostgresBroker(url=pg_url, schema=schema)
    dramatiq.actor(
        lambda order_id: None, broker=broker, queue_name="shop", actor_name="send_receipt"
    )
    yield broker
    broker.close()


def receipt_sent(client: httpx.Client, order_id: int) -> bool:
    return client.get(f"/orders/{order_id}").json()["receipt_sent_at"] is not None


def test_the_endpoint_commits_the_order_with_its_job_and_the_worker_runs_it(server, worker, broker):
    created = server.post("/orders", json={"item": "tea", "quantity": 2})
    assert created.status_code == 201, created.text
    body = created.json()
    wait_until_run(broker, worker, body["job"])
    assert receipt_sent(server, body["order"])


def test_a_refused_order_takes_its_job_with_it(server, conn, schema):
    before = created_count(conn, schema)
    refused = server.post("/orders", json={"item": "tea", "quantity": 11})
    assert refused.status_code == 409, refused.text
    assert "at most 10" in refused.json()["detail"]
    assert created_count(conn, schema) == before, "the refused order's job was created"
    invalid = server.post("/orders", json={"item": "", "quantity": 0})
    assert invalid.status_code == 422, invalid.text


def test_send_async_outside_a_transaction_reaches_the_worker(server, worker, broker):
    order = server.post("/orders", json={"item": "cake"}).json()
    wait_until_run(broker, worker, order["job"])
    again = server.post(f"/orders/{order['order']}/receipt")
    assert again.status_code == 202, again.text
    wait_until_run(broker, worker, again.json()["job"])
    assert server.post("/orders/999999/receipt").status_code == 404


def test_a_psycopg_async_transaction_s_job_runs_once_committed(
    server, worker, broker, database_url
):
    async def main():
        async with await psycopg.AsyncConnection.connect(database_url) as app:
            async with broker.transaction(app):
                cur = await app.execute(
                    sql.SQL("INSERT INTO orders (item, quantity) VALUES (%s, %s) RETURNING id"),
                    ("bread", 1),
                )
                (order_id,) = await cur.fetchone()
                message = broker.actors["send_receipt"].send(order_id)
        return order_id, message

    order_id, message = asyncio.run(main())
    wait_until_run(broker, worker, message.message_id)
    assert receipt_sent(server, order_id)


def test_a_sqlalchemy_async_session_s_job_runs_once_committed(server, worker, broker, database_url):
    async def main():
        engine = create_async_engine(sqlalchemy_url(database_url))
        try:
            async with AsyncSession(engine) as session:
                async with session.begin(), broker.transaction(session):
                    order = Order(item="jam", quantity=1)
                    session.add(order)
                    await session.flush()
                    order_id = order.id
                    message = broker.actors["send_receipt"].send(order_id)
                return order_id, message
        finally:
            await engine.dispose()

    order_id, message = asyncio.run(main())
    wait_until_run(broker, worker, message.message_id)
    assert receipt_sent(server, order_id)
