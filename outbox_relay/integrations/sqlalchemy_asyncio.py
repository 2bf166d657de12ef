"""``enqueue`` for SQLAlchemy's asyncio extension: the message joins an ``AsyncSession``'s
(or ``AsyncConnection``'s) transaction.

    from outbox_relay.integrations.sqlalchemy_asyncio import enqueue

    async with AsyncSession(engine) as session, session.begin():
        session.add(order)
        await session.flush()
        await enqueue(session, aggregate_type="order", aggregate_id=order.id,
                      event_type="order.created", payload={"id": order.id})

Two dialects, both with everything the sync producer does (savepoint,
operation-key rules, ordering lock, NOTIFY at commit):

* ``postgresql+psycopg``: the statements run on the psycopg ``AsyncConnection``
  under the session;
* ``postgresql+asyncpg``: the same statements, numbered for asyncpg
  (``store.aio.asyncpg_query``), on the asyncpg connection under it.

SQLAlchemy's transaction is begun first (through SQLAlchemy, where the
asyncpg adapter has not begun it yet), so the message is written inside it
and commits or rolls back with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from .. import aio
from ..producer import NewMessage
from ..store.aio import begin_sqlalchemy_transaction, is_asyncpg
from ..table import OutboxTable

__all__ = ["driver_connection", "enqueue", "enqueue_many", "migrate"]


async def driver_connection(bind: AsyncSession | AsyncConnection) -> Any:
    """The driver's connection under ``bind``, inside its (begun) transaction.

    A psycopg ``AsyncConnection`` or an asyncpg ``Connection``; a TypeError
    naming the dialects for anything else.
    """
    if isinstance(bind, AsyncSession):
        connection = await bind.connection()
    elif isinstance(bind, AsyncConnection):
        connection = bind
        if not connection.in_transaction():
            await connection.begin()
    else:
        raise TypeError(
            f"enqueue needs a SQLAlchemy AsyncSession or AsyncConnection, got {type(bind).__name__}"
            " (for a sync Session use outbox_relay.integrations.sqlalchemy)"
        )
    raw = await connection.get_raw_connection()
    driver: Any = raw.driver_connection
    if not (isinstance(driver, psycopg.AsyncConnection) or is_asyncpg(driver)):
        raise TypeError(
            "outbox_relay.integrations.sqlalchemy_asyncio needs the postgresql+psycopg or "
            f"postgresql+asyncpg dialect; this engine's driver is {type(driver).__name__}"
        )
    if is_asyncpg(driver) and not driver.is_in_transaction():
        # SQLAlchemy's asyncpg adapter begins the driver's transaction at its
        # first statement; make that happen now, or the outbox statements
        # would run outside it and commit on their own. (psycopg begins its
        # transaction implicitly, and the producer sees to that itself.)
        await begin_sqlalchemy_transaction(connection)
    return driver


async def enqueue(
    bind: AsyncSession | AsyncConnection,
    *,
    aggregate_type: str,
    aggregate_id: str | int,
    event_type: str,
    payload: Any,
    operation_key: str | None = None,
    delay: timedelta | float | None = None,
    headers: Mapping[str, Any] | None = None,
    table: OutboxTable | str | None = None,
    ordered: bool | None = None,
    notify: bool | None = None,
    max_payload_bytes: int | None = None,
    now: datetime | None = None,
) -> int:
    """``outbox_relay.aio.enqueue`` in ``bind``'s transaction; returns the message id."""
    [message_id] = await enqueue_many(
        bind,
        [
            NewMessage(
                aggregate_type=aggregate_type,
                aggregate_id=aggregate_id,
                event_type=event_type,
                payload=payload,
                operation_key=operation_key,
                delay=delay,
                headers=headers,
            )
        ],
        table=table,
        ordered=ordered,
        notify=notify,
        max_payload_bytes=max_payload_bytes,
        now=now,
    )
    return message_id


async def enqueue_many(
    bind: AsyncSession | AsyncConnection,
    messages: Iterable[NewMessage],
    *,
    table: OutboxTable | str | None = None,
    ordered: bool | None = None,
    notify: bool | None = None,
    max_payload_bytes: int | None = None,
    now: datetime | None = None,
) -> list[int]:
    """``outbox_relay.aio.enqueue_many`` in ``bind``'s transaction; the ids in order."""
    return await aio.enqueue_many(
        await driver_connection(bind),
        messages,
        table=table,
        ordered=ordered,
        notify=notify,
        max_payload_bytes=max_payload_bytes,
        now=now,
    )


async def migrate(
    bind: AsyncSession | AsyncConnection, *, table: OutboxTable | str | None = None
) -> list[int]:
    """``outbox_relay.aio.migrate`` in ``bind``'s transaction (commit it to keep the schema)."""
    return await aio.migrate(await driver_connection(bind), table=table)
