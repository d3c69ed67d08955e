"""A FastAPI shop: ``POST /orders`` commits an order and its receipt job together through
an ``AsyncSession``, the way FastAPI code commits (``await session.commit()`` where the
endpoint pleases), without blocking the event loop.

Run it next to a worker::

    export DATABASE_URL=postgresql://app@localhost/app
    dramatiq-pg-broker --url "$DATABASE_URL" migrate
    dramatiq examples.fastapi.tasks &
    uvicorn examples.fastapi.app:app
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from dramatiq_pg_broker import send_async

from .models import Base, Order, database_url, sqlalchemy_url
from .tasks import broker, send_receipt

#: The most items one order may hold.
MAX_QUANTITY = 10

engine = create_async_engine(sqlalchemy_url(database_url()))
sessions = async_sessionmaker(engine, expire_on_commit=False)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    yield
    await engine.dispose()


app = FastAPI(title="shop", lifespan=lifespan)


async def session() -> AsyncIterator[AsyncSession]:
    async with sessions() as s:
        yield s


class NewOrder(BaseModel):
    item: str = Field(min_length=1, max_length=200)
    quantity: int = Field(default=1, ge=1)


class Refused(Exception):
    """An order the shop refuses after it was written: the rollback takes its job too."""


@app.post("/orders", status_code=201)
async def create_order(order: NewOrder, db: AsyncSession = Depends(session)) -> dict:
    try:
        async with broker.transaction(db):
            row = Order(item=order.item, quantity=order.quantity)
            db.add(row)
            await db.flush()  # the order's id
            # No I/O here: the job is collected by the block...
            message = send_receipt.send(row.id)
            if order.quantity > MAX_QUANTITY:
                # ...so a refusal leaves nothing: the block writes nothing when it raises,
                # and the session rolls the order back when it closes.
                raise Refused(f"at most {MAX_QUANTITY} items an order")
            # ...and written on the session's connection just before this COMMIT: the
            # order and its job commit together, and the worker only ever sees a job
            # whose order is there.
            await db.commit()
    except Refused as e:
        raise HTTPException(status_code=409, detail=str(e)) from None
    return {"order": row.id, "job": message.message_id}


@app.post("/orders/bulk", status_code=201)
async def create_orders(orders: list[NewOrder], db: AsyncSession = Depends(session)) -> dict:
    # The other way to commit: session.begin() around the block commits once it is over.
    async with db.begin(), broker.transaction(db):
        rows = [Order(item=o.item, quantity=min(o.quantity, MAX_QUANTITY)) for o in orders]
        db.add_all(rows)
        await db.flush()
        # Collected, then written together (one statement) when the broker's block ends.
        messages = [send_receipt.send(row.id) for row in rows]
    return {"orders": [row.id for row in rows], "jobs": [m.message_id for m in messages]}


@app.post("/orders/{order_id}/receipt", status_code=202)
async def resend_receipt(order_id: int, db: AsyncSession = Depends(session)) -> dict:
    if await db.get(Order, order_id) is None:
        raise HTTPException(status_code=404, detail=f"no order {order_id}")
    # No transaction to join: the send commits at once, in a thread, through the pool.
    message = await send_async(send_receipt, order_id)
    return {"order": order_id, "job": message.message_id}


@app.get("/orders/{order_id}")
async def show_order(order_id: int, db: AsyncSession = Depends(session)) -> dict:
    row = await db.get(Order, order_id)
    if row is None:
        raise HTTPException(status_code=404, detail=f"no order {order_id}")
    sent = row.receipt_sent_at.isoformat() if row.receipt_sent_at else None
    return {"order": row.id, "item": row.item, "receipt_sent_at": sent}
