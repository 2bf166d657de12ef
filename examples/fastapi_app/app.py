"""A minimal FastAPI shop: an order and its event written in one async transaction.

    SHOP_DATABASE_URL=postgresql+asyncpg://postgres@127.0.0.1/shop \
        uvicorn app:app --port 8000

``SHOP_DATABASE_URL`` may name the ``postgresql+asyncpg`` or the
``postgresql+psycopg`` dialect; both write the event on the session's own
connection, inside its transaction. The relay (``celery -A outbox_relay.app
worker`` and ``beat``) delivers it; see README.md beside this file.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from pydantic import BaseModel, Field
from sqlalchemy import String
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox_relay.integrations.sqlalchemy_asyncio import enqueue, migrate

DATABASE_URL = os.environ.get("SHOP_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1/shop")

engine = create_async_engine(DATABASE_URL)
Session = async_sessionmaker(engine, expire_on_commit=False)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(200))
    total_cents: Mapped[int]


class NewOrder(BaseModel):
    customer: str = Field(min_length=1, max_length=200)
    total_cents: int = Field(gt=0)


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    # An example's shortcut: a real service runs its migrations (and
    # `outbox-relay migrate`) at deploy time, not at start-up.
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
        await migrate(conn)
    yield
    await engine.dispose()


app = FastAPI(title="shop", lifespan=lifespan)


@app.post("/orders", status_code=201)
async def create_order(body: NewOrder) -> dict[str, int]:
    async with Session() as session, session.begin():  # one transaction, committed at the end
        order = Order(customer=body.customer, total_cents=body.total_cents)
        session.add(order)
        await session.flush()  # assigns order.id; still uncommitted
        await enqueue(
            session,
            aggregate_type="order",
            aggregate_id=order.id,
            event_type="order.created",
            payload={"id": order.id, "customer": order.customer, "total_cents": order.total_cents},
            operation_key=f"order-created-{order.id}",
        )
    return {"id": order.id}
