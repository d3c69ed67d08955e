"""The shop's table and its database URL, shared by the web app and the workers."""

from __future__ import annotations

import datetime as dt
import os

from sqlalchemy import DateTime, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def database_url() -> str:
    """``DATABASE_URL``: a libpq URL (``postgresql://user@host/db``); the broker, the web
    app and the workers all use this one database."""
    return os.environ.get("DATABASE_URL", "postgresql:///shop")


def sqlalchemy_url(url: str) -> str:
    """The same URL for SQLAlchemy's psycopg 3 driver (``postgresql+psycopg://``)."""
    scheme, sep, rest = url.partition("://")
    if scheme not in ("postgresql", "postgres") or not sep:
        raise ValueError(f"DATABASE_URL must be a postgresql:// URL, not {scheme!r}")
    return f"postgresql+psycopg://{rest}"


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    item: Mapped[str] = mapped_column(String(200))
    quantity: Mapped[int] = mapped_column(Integer)
    #: Set by the send_receipt job, once the order it reads is committed.
    receipt_sent_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
