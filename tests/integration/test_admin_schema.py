"""The SQLAlchemy tables of the admin API match the migrated schema, column for column."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from admin_api.tables import metadata, views


def _type(column_type) -> str:
    return column_type.compile(dialect=postgresql.dialect()).lower()


def test_tables_match_the_migrated_schema(pg_url, schema):
    engine = sa.create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        inspector = sa.inspect(engine)
        migrated = set(inspector.get_table_names(schema=schema))
        assert set(metadata.tables) <= migrated, set(metadata.tables) - migrated
        assert {"jobs", "job_events", "users", "sessions", "api_tokens", "job_owners"} <= set(
            metadata.tables
        )
        for name, table in metadata.tables.items():
            columns = {c["name"]: c for c in inspector.get_columns(name, schema=schema)}
            assert list(columns) == [c.name for c in table.columns], name
            for column in table.columns:
                real = columns[column.name]
                assert _type(real["type"]) == _type(column.type), (name, column.name)
                assert real["nullable"] == column.nullable, (name, column.name)
            primary = inspector.get_pk_constraint(name, schema=schema)["constrained_columns"]
            assert primary == [c.name for c in table.primary_key.columns], name
            foreign = {
                (fk["constrained_columns"][0], fk["referred_table"])
                for fk in inspector.get_foreign_keys(name, schema=schema)
            }
            declared = {(fk.parent.name, fk.column.table.name) for fk in table.foreign_keys}
            assert foreign == declared, name
    finally:
        engine.dispose()


def test_the_views_match_the_migrated_schema(pg_url, schema):
    """all_jobs (0012) has the job tables' columns, in their order and types."""
    engine = sa.create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        inspector = sa.inspect(engine)
        assert set(views.tables) <= set(inspector.get_view_names(schema=schema))
        for name, view in views.tables.items():
            columns = {c["name"]: c for c in inspector.get_columns(name, schema=schema)}
            assert list(columns) == [c.name for c in view.columns], name
            for column in view.columns:
                assert _type(columns[column.name]["type"]) == _type(column.type), column.name
    finally:
        engine.dispose()


def test_the_admin_indexes_exist(pg_url, schema):
    engine = sa.create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = :s"),
                {"s": schema},
            ).all()
    finally:
        engine.dispose()
    indexes = dict(rows)
    # History (0012): the list's order and filters, per partition, and the dead letters
    # are their own partitions (no partial index over finished rows in the jobs table).
    # The hot jobs table indexes what the workers need, not the list's orders (0017).
    for name in ("jobs_created_at_idx", "jobs_queue_created_idx", "jobs_actor_created_idx"):
        assert name not in indexes
    assert "(actor_name, created_at, id)" in indexes["jobs_history_actor_created_idx"]
    assert "(created_at, id)" in indexes["jobs_history_created_at_idx"]
    assert "(queue_name, created_at, id)" in indexes["jobs_history_queue_created_idx"]
    assert "jobs_dead_idx" not in indexes
    assert "lower(email)" in indexes["users_email_uq"]
