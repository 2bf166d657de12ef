"""Write outbox messages inside the caller's business transaction.

``enqueue`` never commits: the message becomes visible to relays exactly when
the caller's transaction commits, together with the business change. If that
transaction rolls back, the message never existed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from . import tracing
from ._defaults import producer_settings
from .config import ProducerSettings
from .errors import InvalidMessage
from .store._base import begin_caller_transaction, failed_transaction
from .store.producer import insert_messages
from .table import OutboxTable

__all__ = [
    "CANVAS_EVENT_TYPE",
    "DURABLE_EVENT_TYPE",
    "RESERVED_EVENT_TYPES",
    "Batch",
    "NewMessage",
    "enqueue",
    "enqueue_many",
    "prepare",
    "require_psycopg",
]

# Event types outbox-relay writes itself: a durable Celery task's row, which
# the relay runs as that task, and a stored canvas (apply_async), which it
# sends through Celery. A plain message of either type would be read as one
# (a canvas row with a payload that is not a canvas failed every attempt),
# so only the library's own writers may use them.
DURABLE_EVENT_TYPE = "celery.durable"
CANVAS_EVENT_TYPE = "celery.apply_async"
RESERVED_EVENT_TYPES = frozenset({DURABLE_EVENT_TYPE, CANVAS_EVENT_TYPE})


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


# A JSON text's \u0000 escape (not an escaped backslash before "u0000"):
# PostgreSQL's jsonb cannot hold the NUL character.
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# The latest a message may be due: anything later is a unit mistake, and far
# enough past it PostgreSQL's timestamps overflow.
MAX_DELAY = timedelta(days=36525)


def _dumps(value: Any, what: str) -> tuple[str, int]:
    """``value`` as JSON, and its size in UTF-8 bytes; InvalidMessage naming
    what PostgreSQL would refuse (after a raw driver error, before)."""
    try:
        # allow_nan=False: NaN and Infinity are not JSON and jsonb rejects them.
        text = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidMessage(f"{what} must be JSON-serializable: {exc}") from None
    if "\\u0000" in text and _JSON_NUL.search(text):
        raise InvalidMessage(
            f"{what} holds a NUL character (\\u0000) in a string; PostgreSQL's jsonb "
            "cannot store it"
        )
    return text, len(_utf8(text, what))


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessage(
            f"{what} is not valid Unicode: {text[exc.start : exc.end]!r} at position "
            f"{exc.start} is a lone surrogate (text decoded with errors='surrogateescape'?)"
        ) from None


def _text(name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidMessage(f"{name} must be a string or an integer, got {type(value).__name__}")
    text = str(value)
    if not text:
        raise InvalidMessage(f"{name} must not be empty")
    if "\x00" in text:
        raise InvalidMessage(f"{name} holds a NUL character; PostgreSQL text cannot store it")
    _utf8(text, name)
    return text


def _delay(value: timedelta | float | None) -> timedelta:
    if value is None:
        return timedelta(0)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise InvalidMessage("delay must be a finite number of seconds")
        if abs(value) > MAX_DELAY.total_seconds():
            raise InvalidMessage(f"delay must be at most {MAX_DELAY.days} days, not {value}s")
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta):
        raise InvalidMessage(f"delay must be a timedelta or seconds, got {type(value).__name__}")
    if value < timedelta(0):
        raise InvalidMessage("delay must not be negative")
    if value > MAX_DELAY:
        raise InvalidMessage(f"delay must be at most {MAX_DELAY.days} days, not {value}")
    return value


def _params(
    msg: NewMessage, limit: int, now: datetime | None, trace: Mapping[str, str]
) -> dict[str, Any]:
    payload, size = _dumps(msg.payload, "payload")
    if size > limit:
        # A stored canvas's payload is what apply_async wrote: the caller
        # knows it as the tasks' arguments, not as a payload.
        what = (
            "the canvas as stored (its tasks' arguments and options)"
            if msg.event_type == CANVAS_EVENT_TYPE
            else "payload"
        )
        raise InvalidMessage(
            f"{what} is {size} bytes (JSON), over the limit of {limit} (max_payload_bytes, "
            "OUTBOX_MAX_PAYLOAD_BYTES); store large documents elsewhere and send a reference"
        )
    headers = dict(msg.headers or {})
    if not all(isinstance(k, str) for k in headers):
        raise InvalidMessage("headers must have string names")
    # As propagators read them and the operation-key digest leaves them out:
    # "Traceparent" was kept as written, compared as content, and ignored by
    # the relay's extract.
    headers = tracing.lower_trace_names(headers)
    present = {k.lower() for k in headers}
    if trace and "traceparent" not in present:
        # A traceparent the caller passed wins (with its tracestate); other
        # headers the caller set are kept as given.
        headers.update({k: v for k, v in trace.items() if k not in present})
    key = msg.operation_key
    if key is not None and (not isinstance(key, str) or not key):
        raise InvalidMessage("operation_key must be a non-empty string or None")
    if key is not None:
        key = _text("operation_key", key)  # NUL, lone surrogates: as every text field
    return {
        "aggregate_type": _text("aggregate_type", msg.aggregate_type),
        "aggregate_id": _text("aggregate_id", msg.aggregate_id),
        "event_type": _text("event_type", msg.event_type),
        "payload": payload,
        "headers": _dumps(headers, "headers")[0],
        # Left out of the operation-key digest (queries.sql insert): the same
        # operation retried under another trace is still the same operation.
        "trace_keys": list(tracing.TRACE_HEADERS),
        "operation_key": key,
        "delay": _delay(msg.delay),
        "now": now,
    }


@dataclass(frozen=True)
class Batch:
    """Validated rows ready to insert, and how: what ``prepare`` makes.

    Pure data, shared by the sync producer here and the asyncio one
    (``outbox_relay.aio``), so both validate and lock exactly alike.
    """

    table: OutboxTable
    rows: list[dict[str, Any]]
    # The ordered aggregates' advisory-lock keys (taken sorted, see store.producer).
    lock_keys: list[str]
    notify: bool


def prepare(
    messages: Iterable[NewMessage],
    *,
    settings: ProducerSettings | None = None,
    table: OutboxTable | str | None = None,
    ordered: bool | None = None,
    notify: bool | None = None,
    max_payload_bytes: int | None = None,
    now: datetime | None = None,
    allow_reserved: bool = False,
) -> Batch:
    """Validate ``messages`` and build their rows; touches no database.

    Raises ``InvalidMessage`` naming the problem before anything is written
    (also for a reserved event type, unless ``allow_reserved``: the library's
    own writers).
    The current trace context (OpenTelemetry, when installed) is recorded in
    each row's headers unless the caller set ``traceparent`` itself.
    """
    messages = list(messages)
    for index, m in enumerate(messages):
        if not isinstance(m, NewMessage):
            # A dict of enqueue's keyword arguments is the likely mistake; it
            # would otherwise fail deep inside as an AttributeError.
            raise InvalidMessage(
                f"message {index} is a {type(m).__name__}, not an outbox_relay.NewMessage: "
                "enqueue_many takes NewMessage(aggregate_type=..., aggregate_id=..., "
                "event_type=..., payload=...) for each message"
            )
        if not allow_reserved and m.event_type in RESERVED_EVENT_TYPES:
            what = (
                "durable Celery tasks" if m.event_type == DURABLE_EVENT_TYPE else "Celery canvases"
            )
            raise InvalidMessage(
                f"event_type {m.event_type!r} is reserved for {what}; "
                "write one with outbox_relay.apply_async() or task.enqueue()"
            )
    if settings is None:
        settings = producer_settings()
    outbox = OutboxTable.parse(table if table is not None else settings.table)
    limit = max_payload_bytes if max_payload_bytes is not None else settings.max_payload_bytes
    trace = tracing.current_headers()
    rows = []
    for index, m in enumerate(messages):
        try:
            rows.append(_params(m, limit, now, trace))
        except InvalidMessage as exc:
            if len(messages) == 1:
                raise
            # One bad row of a bulk import: say which.
            raise InvalidMessage(f"message {index} of {len(messages)}: {exc}") from None
    lock_keys = []
    for p in rows:
        p["ordered"] = ordered if ordered is not None else settings.is_ordered(p["event_type"])
        if p["ordered"]:
            lock_keys.append(f"{outbox.lock_key}:{p['aggregate_type']}:{p['aggregate_id']}")
    return Batch(
        table=outbox,
        rows=rows,
        lock_keys=lock_keys,
        notify=notify if notify is not None else settings.notify,
    )


def require_psycopg(conn: Any, call: str) -> None:
    """Refuse, naming the call that takes it, a connection ``call`` cannot use:
    a SQLAlchemy Session failed with "'Session' object has no attribute
    'autocommit'"."""
    if isinstance(conn, psycopg.Connection):
        return
    module = type(conn).__module__
    if module.startswith("sqlalchemy."):
        hint = (
            f"; for a SQLAlchemy Session or Connection use outbox_relay.integrations.sqlalchemy."
            f"{call}(session, ...), or outbox_relay.{call}(psycopg_connection(session), ...)"
            if call != "migrate"
            else "; give it outbox_relay.integrations.sqlalchemy.psycopg_connection(session)"
        )
    elif module.startswith("django."):
        hint = (
            "; in Django use outbox_relay.integrations.django.enqueue(...)"
            if call != "migrate"
            else "; in Django, manage.py migrate creates the table"
        )
    elif isinstance(conn, psycopg.AsyncConnection) or module.startswith("asyncpg"):
        hint = f"; for an asyncio connection, await outbox_relay.aio.{call}(conn, ...)"
    else:
        hint = ""
    raise InvalidMessage(
        f"outbox_relay.{call} needs a psycopg 3 connection, not {type(conn).__name__}{hint}"
    )


def enqueue_many(
    conn: psycopg.Connection[Any],
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
    """Insert many messages in the caller's transaction; return their ids in order.

    ``settings`` are the producer settings (an ``Outbox`` passes its own;
    without them, the process's default outbox decides, see ``_defaults``). Everything is
    validated before anything is written, so one bad message leaves the
    transaction as it was. ``ordered`` overrides the settings for every
    message; an ordered message takes its aggregate's lock (so that id order
    equals commit order) and is marked ordered on its row.
    """
    require_psycopg(conn, "enqueue")
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
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise failed_transaction()
    if not conn.autocommit and status == TransactionStatus.IDLE:
        # The caller's transaction has not begun yet (psycopg begins it with
        # the first statement). Begin it now: on an idle connection
        # conn.transaction() would open *and commit* a transaction of its
        # own, and the message would then survive a rollback of the business
        # change that follows (enqueue first, then INSERT the order).
        begin_caller_transaction(conn)
    return insert_messages(
        conn, batch.rows, table=batch.table, lock_keys=batch.lock_keys, notify=batch.notify
    )


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
    settings: ProducerSettings | None = None,
    table: OutboxTable | str | None = None,
    ordered: bool | None = None,
    notify: bool | None = None,
    max_payload_bytes: int | None = None,
    now: datetime | None = None,
) -> int:
    """Record one message in the caller's transaction and return its id.

    The same ``operation_key`` with the same content returns the existing id;
    with different content it raises ``OperationKeyConflict``. ``ordered``
    defaults to whether ``event_type`` is one of the producer settings'
    ``ordered_event_types``.
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
        settings=settings,
        table=table,
        ordered=ordered,
        notify=notify,
        max_payload_bytes=max_payload_bytes,
        now=now,
    )
    return message_id
