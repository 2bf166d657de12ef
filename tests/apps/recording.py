"""A test publisher that records every publish in the test's own database.

Used by the Celery tests as ``OUTBOX_PUBLISHER=tests.apps.recording:publish``.
Each publish inserts one row into ``published`` (message id, idempotency key,
lease version, worker pid), on a connection of its own per process, so the
test can count how often every message really went out.

A message's payload may steer the publisher, which lets one test mix cases:
``{"sleep": 2.0}`` publishes slowly, ``{"fail": "retryable" | "permanent"}``
fails, ``{"fail_times": 2}`` fails transiently for the first two attempts,
``{"steal": true}`` takes the row's first lease away while it is published
(as a rescue and another worker's claim would: the lease version moves on).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import psycopg

from outbox_relay import Message, PermanentError, RetryableError

DDL = """
CREATE TABLE IF NOT EXISTS published (
    seq             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id      bigint NOT NULL,
    idempotency_key text   NOT NULL,
    lease_version   bigint NOT NULL,
    event_type      text   NOT NULL,
    aggregate_id    text   NOT NULL,
    pid             integer NOT NULL,
    at              timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

_conn: psycopg.Connection[Any] | None = None
_pid: int | None = None


def _connection() -> psycopg.Connection[Any]:
    global _conn, _pid
    if _conn is None or _pid != os.getpid() or _conn.closed:
        _conn = psycopg.connect(os.environ["RECORDING_DSN"], autocommit=True)
        _pid = os.getpid()
    return _conn


def publish(message: Message) -> None:
    payload = message.payload if isinstance(message.payload, dict) else {}
    if "sleep" in payload:
        time.sleep(float(payload["sleep"]))
    fail = payload.get("fail")
    if fail == "permanent":
        raise PermanentError("receiver rejected the message (test)")
    if fail == "retryable" or message.attempts <= int(payload.get("fail_times", 0)):
        raise RetryableError("receiver unavailable (test)")
    _connection().execute(
        "INSERT INTO published (message_id, idempotency_key, lease_version, event_type,"
        " aggregate_id, pid) VALUES (%s, %s, %s, %s, %s, %s)",
        (
            message.id,
            message.idempotency_key,
            message.lease_version,
            message.event_type,
            message.aggregate_id,
            os.getpid(),
        ),
    )
    if payload.get("steal") and message.lease_version == 1:
        _connection().execute(
            "UPDATE outbox SET lease_version = lease_version + 1 WHERE id = %s", (message.id,)
        )


async def publish_async(message: Message) -> None:
    """``publish`` as a coroutine publisher (``async def``): the relay awaits
    it on an event loop of its own. The wait is awaited; the recording
    insert is the same blocking one (quick, and what is counted)."""
    payload = message.payload if isinstance(message.payload, dict) else {}
    await asyncio.sleep(float(payload.get("await", 0.01)))
    publish(message)
