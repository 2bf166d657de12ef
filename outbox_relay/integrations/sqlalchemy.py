"""``enqueue`` for SQLAlchemy 2: the message joins the Session's (or Connection's) transaction.

    from outbox_relay.integrations.sqlalchemy import enqueue

    with Session(engine) as session, session.begin():
        session.add(order)
        session.flush()                      # the order's id, if the event needs it
        enqueue(session, aggregate_type="order", aggregate_id=order.id,
                event_type="order.created", payload={"id": order.id})

The engine must use the ``postgresql+psycopg`` dialect (psycopg 3): the
message is written on the very DBAPI connection SQLAlchemy holds for the
transaction, so it commits and rolls back with it. Nothing here flushes the
Session: pending ORM objects are written when SQLAlchemy decides, in the same
transaction either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from .. import producer
from ..producer import NewMessage
from ..table import OutboxTable

__all__ = ["enqueue", "enqueue_many", "psycopg_connection"]


def psycopg_connection(bind: Session | Connection) -> psycopg.Connection[Any]:
    """The psycopg 3 connection under ``bind``, inside its current transaction.

    A Session begins its transaction here if it has none (SQLAlchemy's
    autobegin). A Connection with no transaction gets one begun, as its
    first ``execute`` would have done: otherwise psycopg would open a
    transaction SQLAlchemy does not know about, and ``Connection.commit()``
    would silently leave the message uncommitted.
    """
    if isinstance(bind, Session):
        connection = bind.connection()
    elif isinstance(bind, Connection):
        connection = bind
        if not connection.in_transaction():
            connection.begin()
    else:
        raise TypeError(
            f"enqueue needs a SQLAlchemy Session or Connection, got {type(bind).__name__}"
        )
    driver = connection.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise TypeError(
            "outbox_relay.integrations.sqlalchemy needs the postgresql+psycopg dialect "
            f"(psycopg 3); this engine's driver connection is {type(driver).__name__}"
        )
    return driver


def enqueue(
    bind: Session | Connection,
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
    """``outbox_relay.enqueue`` in ``bind``'s transaction; returns the message id."""
    return producer.enqueue(
        psycopg_connection(bind),
        aggregate_type=aggregate_type,
        aggregate_id=aggregate_id,
        event_type=event_type,
        payload=payload,
        operation_key=operation_key,
        delay=delay,
        headers=headers,
        table=table,
        ordered=ordered,
        notify=notify,
        max_payload_bytes=max_payload_bytes,
        now=now,
    )


def enqueue_many(
    bind: Session | Connection,
    messages: Iterable[NewMessage],
    *,
    table: OutboxTable | str | None = None,
    ordered: bool | None = None,
    notify: bool | None = None,
    max_payload_bytes: int | None = None,
    now: datetime | None = None,
) -> list[int]:
    """``outbox_relay.enqueue_many`` in ``bind``'s transaction; returns the ids in order."""
    return producer.enqueue_many(
        psycopg_connection(bind),
        messages,
        table=table,
        ordered=ordered,
        notify=notify,
        max_payload_bytes=max_payload_bytes,
        now=now,
    )
