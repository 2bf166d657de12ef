"""``enqueue`` on Django's connection: the message joins the transaction of ``connections[using]``.

    from django.db import transaction
    from outbox_relay.integrations.django import enqueue

    with transaction.atomic():
        order = Order.objects.create(customer=customer, total=total)
        enqueue(aggregate_type="order", aggregate_id=order.pk,
                event_type="order.created", payload={"id": order.pk})

Needs Django 4.2+ with the psycopg 3 backend (``django.db.backends.postgresql``
with psycopg 3 installed). ``enqueue`` runs inside ``transaction.atomic(using=...)``:
within your ``atomic`` block it is a savepoint of your transaction, so the
message commits with the order or not at all; outside any block (autocommit)
it commits on its own, like a lone ``Model.save()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

import psycopg
from django.db import connections, transaction

from ... import producer
from ...producer import NewMessage
from ...table import OutboxTable

__all__ = ["enqueue", "enqueue_many", "psycopg_connection"]


def _alias(using: str | None) -> str:
    if using is not None:
        return using
    from .conf import database_alias

    return database_alias()


def psycopg_connection(using: str | None = None) -> psycopg.Connection[Any]:
    """The psycopg 3 connection of Django's database alias ``using`` (connected if needed).

    ``using`` defaults to ``OUTBOX_DATABASE`` (the database the relay reads).
    """
    using = _alias(using)
    wrapper = connections[using]
    if wrapper.vendor != "postgresql":
        raise TypeError(
            f"outbox_relay.integrations.django needs PostgreSQL; database {using!r} "
            f"is {wrapper.vendor}"
        )
    wrapper.ensure_connection()
    raw = wrapper.connection
    if not isinstance(raw, psycopg.Connection):
        raise TypeError(
            f"outbox_relay.integrations.django needs the psycopg 3 driver; database {using!r} "
            f"uses {type(raw).__name__} (install psycopg, not psycopg2)"
        )
    return raw


def enqueue(
    *,
    aggregate_type: str,
    aggregate_id: str | int,
    event_type: str,
    payload: Any,
    operation_key: str | None = None,
    delay: timedelta | float | None = None,
    headers: Mapping[str, Any] | None = None,
    using: str | None = None,
    table: OutboxTable | str | None = None,
    ordered: bool | None = None,
    notify: bool | None = None,
    max_payload_bytes: int | None = None,
    now: datetime | None = None,
) -> int:
    """``outbox_relay.enqueue`` in the current transaction of ``using``; returns the id.

    ``using`` defaults to ``OUTBOX_DATABASE``: a row written to another
    database's outbox is never read by this project's relay.
    """
    using = _alias(using)
    with transaction.atomic(using=using):
        return producer.enqueue(
            psycopg_connection(using),
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
    messages: Iterable[NewMessage],
    *,
    using: str | None = None,
    table: OutboxTable | str | None = None,
    ordered: bool | None = None,
    notify: bool | None = None,
    max_payload_bytes: int | None = None,
    now: datetime | None = None,
) -> list[int]:
    """``outbox_relay.enqueue_many`` in the current transaction of ``using``
    (default ``OUTBOX_DATABASE``)."""
    using = _alias(using)
    with transaction.atomic(using=using):
        return producer.enqueue_many(
            psycopg_connection(using),
            messages,
            table=table,
            ordered=ordered,
            notify=notify,
            max_payload_bytes=max_payload_bytes,
            now=now,
        )
