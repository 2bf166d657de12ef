"""The producer API as coroutines, for asyncio applications (FastAPI, aiohttp, ...).

    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with conn.transaction():
            await conn.execute("INSERT INTO orders ...")
            await outbox_relay.aio.enqueue(conn, aggregate_type="order", ...)

``enqueue``, ``enqueue_many``, ``migrate`` and ``apply_async`` behave exactly as the sync ones:
validation (``producer.prepare``) before anything is written, a savepoint
inside the caller's transaction, the ``operation_key`` rules and
``OperationKeyConflict``, the ordering advisory lock, NOTIFY. They share the
sync code's validation and statement plans (``store/_plan.py``); only the
driver differs. ``conn`` is a ``psycopg.AsyncConnection``, an asyncpg
connection, or a SQLAlchemy ``AsyncSession`` / ``AsyncConnection`` (its
driver's connection, in its transaction: ``integrations.sqlalchemy_asyncio``),
as the sync ``apply_async`` takes a ``Session``.

A configured ``Outbox`` offers the same as ``outbox.aio.enqueue(...)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ._defaults import producer_settings
from .config import ProducerSettings
from .producer import NewMessage, prepare
from .store import aio as store_aio
from .store.aio import AsyncConn
from .table import OutboxTable

if TYPE_CHECKING:
    from .outbox import Outbox

__all__ = ["AsyncOutbox", "apply_async", "enqueue", "enqueue_many", "migrate"]


async def _driver(conn: Any) -> AsyncConn:
    """The driver's connection of a SQLAlchemy ``AsyncSession`` or
    ``AsyncConnection``, in its (begun) transaction; any other ``conn`` as it is."""
    # A subclass of AsyncSession defined in the application counts too.
    if any(c.__module__.startswith("sqlalchemy.") for c in type(conn).__mro__):
        from .integrations.sqlalchemy_asyncio import driver_connection

        return await driver_connection(conn)
    return conn


async def migrate(conn: AsyncConn, *, table: OutboxTable | str | None = None) -> list[int]:
    """Apply the migrations ``table`` lacks; the versions applied (see
    ``outbox_relay.migrate``: ``table`` None is the table ``enqueue`` writes to)."""
    chosen = producer_settings().outbox_table if table is None else table
    return await store_aio.migrate(await _driver(conn), table=chosen)


async def enqueue_many(
    conn: AsyncConn,
    messages: Iterable[NewMessage],
    *,
    settings: ProducerSettings | None = None,
    table: OutboxTable | str | None = None,
    ordered: bool | None = None,
    notify: bool | None = None,
    max_payload_bytes: int | None = None,
    now: datetime | None = None,
    allow_reserved: bool = False,
) -> list[int]:
    """Insert many messages in the caller's transaction; their ids in order."""
    batch = prepare(
        messages,
        settings=settings,
        table=table,
        ordered=ordered,
        notify=notify,
        max_payload_bytes=max_payload_bytes,
        now=now,
        allow_reserved=allow_reserved,
    )
    if not batch.rows:
        return []
    return await store_aio.insert_messages(
        await _driver(conn),
        batch.rows,
        table=batch.table,
        lock_keys=batch.lock_keys,
        notify=batch.notify,
    )


async def enqueue(
    conn: AsyncConn,
    *,
    aggregate_type: str,
    aggregate_id: str | int,
    event_type: str,
    payload: Any,
    operation_key: str | None = None,
    delay: timedelta | float | None = None,
    headers: Mapping[str, Any] | None = None,
    settings: ProducerSettings | None = None,
    table: OutboxTable | str | None = None,
    ordered: bool | None = None,
    notify: bool | None = None,
    max_payload_bytes: int | None = None,
    now: datetime | None = None,
) -> int:
    """Record one message in the caller's transaction; its id (see ``outbox_relay.enqueue``)."""
    message = NewMessage(
        aggregate_type=aggregate_type,
        aggregate_id=aggregate_id,
        event_type=event_type,
        payload=payload,
        operation_key=operation_key,
        delay=delay,
        headers=headers,
    )
    [message_id] = await enqueue_many(
        conn,
        [message],
        settings=settings,
        table=table,
        ordered=ordered,
        notify=notify,
        max_payload_bytes=max_payload_bytes,
        now=now,
    )
    return message_id


# --- apply_async -------------------------------------------------------------
async def apply_async(
    conn: AsyncConn, sig: Any, *, settings: ProducerSettings | None = None, **options: Any
) -> Any:
    """``outbox_relay.apply_async`` as a coroutine: ``sig`` (a task or a whole
    canvas) as one row in the caller's transaction; returns at once what
    ``sig.apply_async(**options)`` would, with every task id fixed now. The
    same row, the same checks (tasks registered, JSON arguments) as the sync
    one: both build it with ``celery.canvas.prepare_canvas``. ``settings``:
    the producer settings (default: those of the ``Outbox`` installed in the
    signature's app, else the process's default)."""
    from .celery.canvas import is_durable, prepare_canvas

    if is_durable(sig):
        from .celery.durable import prepare_durable

        message, result = prepare_durable(sig, options)
        # A reserved event type; a chain orders its own steps.
        extra: dict[str, Any] = {"ordered": False, "allow_reserved": True}
    else:
        message, result = prepare_canvas(sig, options)
        extra = {"allow_reserved": True}  # a reserved event type too
    if settings is None:
        from . import _app_of
        from .celery.runtime import outbox_for

        settings = outbox_for(_app_of(sig)).settings
    await enqueue_many(conn, [message], settings=settings, **extra)
    return result


class AsyncOutbox:
    """``outbox.aio``: the asyncio producer API with one ``Outbox``'s settings."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox

    async def enqueue(
        self,
        conn: AsyncConn,
        *,
        aggregate_type: str,
        aggregate_id: str | int,
        event_type: str,
        payload: Any,
        operation_key: str | None = None,
        delay: timedelta | float | None = None,
        headers: Mapping[str, Any] | None = None,
        now: datetime | None = None,
    ) -> int:
        """``Outbox.enqueue`` as a coroutine."""
        return await enqueue(
            conn,
            aggregate_type=aggregate_type,
            aggregate_id=aggregate_id,
            event_type=event_type,
            payload=payload,
            operation_key=operation_key,
            delay=delay,
            headers=headers,
            settings=self._outbox.settings,
            now=now,
        )

    async def enqueue_many(
        self, conn: AsyncConn, messages: Iterable[NewMessage], *, now: datetime | None = None
    ) -> list[int]:
        """``Outbox.enqueue_many`` as a coroutine."""
        return await enqueue_many(conn, messages, settings=self._outbox.settings, now=now)

    async def migrate(self, conn: AsyncConn) -> list[int]:
        """Migrate this outbox's table."""
        return await migrate(conn, table=self._outbox.table)

    async def apply_async(self, conn: AsyncConn, sig: Any, **options: Any) -> Any:
        """``Outbox.apply_async`` as a coroutine."""
        return await apply_async(conn, sig, settings=self._outbox.settings, **options)
