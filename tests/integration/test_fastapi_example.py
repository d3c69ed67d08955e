"""The FastAPI example (``examples/fastapi``) in this process, through FastAPI's
``TestClient``, with an in-process worker: an order commits with its job (committed by
``await session.commit()`` inside the broker's block), a refused order leaves neither, and
the worker runs the job once the order is there.

The same example under uvicorn with ``dramatiq`` worker processes is in
``tests/e2e/test_async_e2e.py``.
"""

from __future__ import annotations

import importlib
import sys
import uuid

import dramatiq
import pytest
from psycopg import sql

from tests.helpers import idle_in_transaction, wait_for
from tests.rows import created_count, status_of

from .harness import start_worker, stop_workers

pytest.importorskip("fastapi")
pytest.importorskip("httpx")  # TestClient's


@pytest.fixture(scope="module")
def app_name() -> str:
    return f"shop_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def shop(pg_url, schema, app_name):
    """The example's modules, imported with its DATABASE_URL on the module's schema (and
    forgotten afterwards, their broker closed and engine disposed)."""
    if not pg_url.startswith(("postgresql://", "postgres://")):
        pytest.skip("the FastAPI example needs a postgresql:// URL")
    separator = "&" if "?" in pg_url else "?"
    database_url = (
        f"{pg_url}{separator}options=-csearch_path%3D{schema}&application_name={app_name}"
    )
    patch = pytest.MonkeyPatch()
    patch.setenv("DATABASE_URL", database_url)
    patch.setenv("DRAMATIQ_PG_SCHEMA", schema)
    previous = dramatiq.broker.global_broker
    names = [f"examples.fastapi.{name}" for name in ("models", "tasks", "app")]
    for name in names:
        sys.modules.pop(name, None)
    app = importlib.import_module("examples.fastapi.app")
    workers: list[dramatiq.Worker] = []
    try:
        yield app, workers
    finally:
        stop_workers(workers)
        app.broker.close()
        tasks = sys.modules["examples.fastapi.tasks"]
        if tasks.engine.cache_info().currsize:  # the workers' engine, made on first use
            tasks.engine().dispose()
        for name in names:
            sys.modules.pop(name, None)
        dramatiq.broker.global_broker = previous
        patch.undo()


@pytest.fixture(scope="module")
def client(shop):
    from fastapi.testclient import TestClient

    app, _ = shop
    with TestClient(app.app) as client:  # runs the lifespan: creates the orders table
        yield client


def orders(conn, schema) -> int:
    table = sql.Identifier(schema, "orders")
    return conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0]


def test_an_order_commits_with_its_job_and_the_worker_runs_it(shop, client, conn, schema, app_name):
    app, workers = shop
    created = client.post("/orders", json={"item": "tea", "quantity": 2})
    assert created.status_code == 201, created.text
    body = created.json()
    # Committed by the endpoint's own commit, inside the broker's block.
    assert status_of(app.broker.store, body["job"]) == "queued"
    assert idle_in_transaction(conn, app_name) == []
    start_worker(app.broker, workers, threads=1)
    wait_for(
        lambda: client.get(f"/orders/{body['order']}").json()["receipt_sent_at"] is not None,
        30,
        "the worker to send the receipt",
    )
    # The job's outcome is written a moment after its actor returned (write-behind).
    wait_for(
        lambda: status_of(app.broker.store, body["job"]) == "succeeded",
        10,
        "the job's success to be written",
    )


def test_a_refused_order_leaves_neither_order_nor_job(shop, client, conn, schema, app_name):
    before = created_count(conn, schema), orders(conn, schema)
    refused = client.post("/orders", json={"item": "tea", "quantity": 11})
    assert refused.status_code == 409, refused.text
    assert "at most 10" in refused.json()["detail"]
    assert (created_count(conn, schema), orders(conn, schema)) == before
    assert client.post("/orders", json={"item": "", "quantity": 0}).status_code == 422
    assert idle_in_transaction(conn, app_name) == []


def test_bulk_orders_and_a_resend_outside_a_transaction(shop, client, conn, app_name):
    app, _ = shop
    bulk = client.post("/orders/bulk", json=[{"item": "tea"}, {"item": "cake", "quantity": 3}])
    assert bulk.status_code == 201, bulk.text
    jobs = bulk.json()["jobs"]
    assert len(jobs) == 2 and all(status_of(app.broker.store, job) for job in jobs)
    again = client.post(f"/orders/{bulk.json()['orders'][0]}/receipt")
    assert again.status_code == 202, again.text
    assert status_of(app.broker.store, again.json()["job"]) is not None
    assert client.post("/orders/999999/receipt").status_code == 404
    assert idle_in_transaction(conn, app_name) == []
