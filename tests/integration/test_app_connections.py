"""The application's synchronous connection, as the send path writes on it: whatever the
application configured on it (row factory, JSON loader, cursor class), and however lazily
its transaction began, the jobs are written in that transaction and read back right."""

from __future__ import annotations

import psycopg
import sqlalchemy as sa
from psycopg.rows import dict_row
from psycopg.types.string import TextLoader
from sqlalchemy.orm import Session

from tests.rows import status_of


def test_a_batch_as_the_first_statement_of_a_sqlalchemy_transaction_rolls_back_with_it(
    broker, task, pg_url
):
    """Nothing was sent on the session's connection before the batch, so psycopg saw an
    idle connection: its transaction() would have begun and committed a transaction of
    its own, and the jobs would have outlived the application's rollback."""
    engine = sa.create_engine(
        "postgresql+psycopg://" + pg_url.split("://", 1)[1], pool_size=1, max_overflow=0
    )
    try:
        with Session(engine) as session:
            # The first block checks which database the connection reaches (a statement);
            # the next one, on the same pooled connection, has nothing to check.
            with session.begin(), broker.transaction(session):
                pass
            with session.begin(), broker.transaction(session):
                with broker.batch():
                    sent = [task.send(n) for n in range(3)]
                session.rollback()
    finally:
        engine.dispose()
    assert [status_of(broker.store, m.message_id) for m in sent] == [None] * 3


def test_a_dict_row_connection_with_a_text_jsonb_loader_gets_the_existing_job(broker, task, pg_url):
    first = task.send_with_options(args=(1,), idempotency_key="k1")
    with psycopg.connect(pg_url, row_factory=dict_row) as app:
        # What Django configures: jsonb read as text; rows as dicts is the application's.
        app.adapters.register_loader("jsonb", TextLoader)
        with broker.transaction(app):
            again = task.send_with_options(args=(1,), idempotency_key="k1")
            many = broker.enqueue_many([task.message(n) for n in range(2)])
    assert again.message_id == first.message_id
    assert again.args == (1,)
    assert {status_of(broker.store, m.message_id) for m in many} == {"queued"}


def test_a_client_binding_cursor_class_is_not_used_for_the_store(broker, task, pg_url):
    with psycopg.connect(pg_url, cursor_factory=psycopg.ClientCursor) as app:
        with broker.transaction(app):
            sent = broker.enqueue_many([task.message(n) for n in range(250)])
            one = task.send(1)
    assert {status_of(broker.store, m.message_id) for m in [*sent, one]} == {"queued"}
