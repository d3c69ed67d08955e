"""The broker and the actor: ``dramatiq examples.fastapi.tasks`` runs the workers."""

from __future__ import annotations

import functools

import dramatiq
from sqlalchemy import create_engine, func, update
from sqlalchemy.orm import Session

from dramatiq_pg_broker import PostgresBroker

from .models import Order, database_url, sqlalchemy_url

# The broker's jobs live in the application's database (schema DRAMATIQ_PG_SCHEMA, by
# default "dramatiq"), so that a job can commit with the application's rows.
broker = PostgresBroker(url=database_url())
dramatiq.set_broker(broker)


@functools.cache
def engine():
    """The workers' (synchronous) engine, made on first use in each worker process."""
    return create_engine(sqlalchemy_url(database_url()))


@dramatiq.actor(queue_name="shop", max_retries=3)
def send_receipt(order_id: int) -> None:
    """Mark the order's receipt as sent. The order is always there: the job was committed
    with it, in the same transaction."""
    with Session(engine()) as session, session.begin():
        session.execute(
            update(Order)
            .where(Order.id == order_id, Order.receipt_sent_at.is_(None))
            .values(receipt_sent_at=func.now())
        )
