"""Write outbox messages inside the caller's business transaction.

``enqueue`` never commits: the message becomes visible to relays exactly when
the caller's transaction commits, together with the business change. If that
transaction rolls back, the message never existed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cache
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from .config import Settings
from .errors import InvalidMessage, OperationKeyConflict
from .sql.queries import queries_for
from .table import OutboxTable

__all__ = ["NewMessage", "enqueue", "enqueue_many"]


@cache
def _env_settings() -> Settings:
    # Producers usually configure nothing; OUTBOX_TABLE, OUTBOX_MAX_PAYLOAD_BYTES
    # and OUTBOX_ORDERED_EVENT_TYPES still apply when set.
    return Settings.load()


@dataclass(frozen=True)
class NewMessage:
    """One message for ``enqueue_many``; the same fields ``enqueue`` takes."""

    aggregate_type: str
    aggregate_id: str | int
    event_type: str
    payload: Any
    operation_key: str | None = None
    delay: timedelta | float | None = None
    headers: Mapping[str, Any] | None = field(default=None)


def _dumps(value: Any, what: str) -> str:
    try:
        # allow_nan=False: NaN and Infinity are not JSON and jsonb rejects them.
        return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidMessage(f"{what} must be JSON-serializable: {exc}") from None


def _text(name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidMessage(f"{name} must be a string, got {type(value).__name__}")
    text = str(value)
    if not text:
        raise InvalidMessage(f"{name} must not be empty")
    return text


def _delay(value: timedelta | float | None) -> timedelta:
    if value is None:
        return timedelta(0)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise InvalidMessage("delay must be a finite number of seconds")
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta):
        raise InvalidMessage(f"delay must be a timedelta or seconds, got {type(value).__name__}")
    if value < timedelta(0):
        raise InvalidMessage("delay must not be negative")
    return value


def _params(msg: NewMessage, limit: int, now: datetime | None) -> dict[str, Any]:
    payload = _dumps(msg.payload, "payload")
    size = len(payload.encode("utf-8"))
    if size > limit:
        raise InvalidMessage(
            f"payload is {size} bytes, over the limit of {limit} (OUTBOX_MAX_PAYLOAD_BYTES); "
            "store large documents elsewhere and send a reference"
        )
    headers = dict(msg.headers or {})
    if not all(isinstance(k, str) for k in headers):
        raise InvalidMessage("header names must be strings")
    key = msg.operation_key
    if key is not None and (not isinstance(key, str) or not key):
        raise InvalidMessage("operation_key must be a non-empty string or None")
    return {
        "aggregate_type": _text("aggregate_type", msg.aggregate_type),
        "aggregate_id": _text("aggregate_id", msg.aggregate_id),
        "event_type": _text("event_type", msg.event_type),
        "payload": payload,
        "headers": _dumps(headers, "headers"),
        "operation_key": key,
        "delay": _delay(msg.delay),
        "now": now,
    }


def enqueue_many(
    conn: psycopg.Connection[Any],
    messages: Iterable[NewMessage],
    *,
    table: OutboxTable | str | None = None,
    ordered: bool | None = None,
    notify: bool | None = None,
    max_payload_bytes: int | None = None,
    now: datetime | None = None,
) -> list[int]:
    """Insert many messages in the caller's transaction; return their ids in order.

    Everything is validated before anything is written, so one bad message
    leaves the transaction as it was.
    """
    settings = _env_settings()
    outbox = OutboxTable.parse(table if table is not None else settings.table)
    limit = max_payload_bytes if max_payload_bytes is not None else settings.max_payload_bytes
    items = list(messages)
    params = [_params(m, limit, now) for m in items]
    if not params:
        return []
    q = queries_for(outbox)
    ids: list[int] = []
    if not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        # The caller's transaction has not begun yet (psycopg begins it with
        # the first statement). Begin it now: on an idle connection
        # conn.transaction() below would open *and commit* a transaction of
        # its own, and the message would then survive a rollback of the
        # business change that follows (enqueue first, then INSERT the order).
        conn.execute("SELECT 1")
    with conn.transaction(), conn.cursor() as cur:
        for p in params:
            is_ordered = (
                ordered if ordered is not None else p["event_type"] in settings.ordered_event_types
            )
            if is_ordered:
                key = f"{outbox.lock_key}:{p['aggregate_type']}:{p['aggregate_id']}"
                cur.execute(q.advisory_lock, {"key": key})
            cur.execute(q.insert, p)
            row = cur.fetchone()
            if row is not None:
                ids.append(int(row[0]))
                continue
            # The operation key exists: the same content is the same
            # operation (return its id); anything else is a mistake.
            cur.execute(q.insert_conflict, p)
            existing = cur.fetchone()
            if existing is None:  # pragma: no cover - the key's row vanished meanwhile
                raise OperationKeyConflict(p["operation_key"], -1)
            if not existing[1]:
                raise OperationKeyConflict(p["operation_key"], int(existing[0]))
            ids.append(int(existing[0]))
        if notify if notify is not None else settings.notify:
            cur.execute(q.notify, {"channel": outbox.channel})
    return ids


def enqueue(
    conn: psycopg.Connection[Any],
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
    """Record one message in the caller's transaction and return its id.

    The same ``operation_key`` with the same content returns the existing id;
    with different content it raises ``OperationKeyConflict``. ``ordered``
    defaults to whether ``event_type`` is in ``OUTBOX_ORDERED_EVENT_TYPES``.
    """
    message = NewMessage(
        aggregate_type=aggregate_type,
        aggregate_id=aggregate_id,
        event_type=event_type,
        payload=payload,
        operation_key=operation_key,
        delay=delay,
        headers=headers,
    )
    [message_id] = enqueue_many(
        conn,
        [message],
        table=table,
        ordered=ordered,
        notify=notify,
        max_payload_bytes=max_payload_bytes,
        now=now,
    )
    return message_id
