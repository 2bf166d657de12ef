"""The relay's end of the fault suite: the real webhook publisher, with a call log.

``OUTBOX_PUBLISHER=tests.faults.publisher:publish`` in the workers. Each call
is written to ``calls`` (row id, attempt, lease version, pid) before the
webhook request and given its outcome after it (``ok`` or the error's class),
so the ledger can tell *why* the receiver saw a message twice: the earlier
call's response was lost (it ended in an error although the receiver applied
it), or the earlier lease was lost after a successful call (its worker was
killed or frozen, or its finalize failed), which the next lease's higher
version shows. A call with no outcome is one whose process died in it.

A message whose payload has ``"poison": true`` kills its worker process
(``os._exit``) every time it is published, as a segfaulting C extension or
the OOM killer would.

Configured from the environment (outside ``OUTBOX_*``, which the relay
checks): ``FAULT_WEBHOOK_URL`` (the receiver) and ``FAULT_DSN`` (the test
database, for the call log).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from outbox_relay import Message
from outbox_relay.publishers import WebhookPublisher

DDL = """
CREATE TABLE IF NOT EXISTS calls (
    seq           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    bigint      NOT NULL,
    attempt       integer     NOT NULL,
    lease_version bigint      NOT NULL,
    pid           integer     NOT NULL,
    outcome       text,
    at            timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

# Short request timeouts: the fault scenarios run with short leases.
CONNECT_TIMEOUT = 1.0
READ_TIMEOUT = 1.5

_webhook: dict[int, WebhookPublisher] = {}
_pools: dict[int, ConnectionPool[psycopg.Connection[Any]]] = {}
_lock = threading.Lock()


def _pool() -> ConnectionPool[psycopg.Connection[Any]]:
    # One small pool per process (a prefork child must not reuse its
    # parent's sockets), shared by the publish threads: a connection per
    # thread would be dozens per worker, and tests run side by side.
    with _lock:
        pool = _pools.get(os.getpid())
        if pool is None:
            pool = ConnectionPool(
                os.environ["FAULT_DSN"],
                min_size=0,
                max_size=2,
                timeout=5,
                kwargs={
                    "autocommit": True,
                    "connect_timeout": 5,
                    "options": "-c synchronous_commit=off",  # evidence, not the state under test
                },
                open=True,
            )
            _pools[os.getpid()] = pool
        return pool


def _publisher() -> WebhookPublisher:
    with _lock:
        found = _webhook.get(os.getpid())
        if found is None:
            found = WebhookPublisher(
                os.environ["FAULT_WEBHOOK_URL"],
                connect_timeout=CONNECT_TIMEOUT,
                read_timeout=READ_TIMEOUT,
            )
            _webhook[os.getpid()] = found
        return found


def _log(sql: str, params: tuple[Any, ...]) -> Any:
    # The call log lives on the receiver's database, not the outbox's; when
    # the fault cuts the relay off from it too (link-cut), the log is best
    # effort. A "lease lost after publish" needs its call logged (harness
    # Run._causes); a late request is also judged without one.
    try:
        with _pool().connection() as conn:
            return conn.execute(sql, params).fetchone()
    except (psycopg.Error, PoolTimeout):
        return None


def publish(message: Message) -> None:
    # ``at``: when the call was made, by this process's clock (the test's
    # host), not when the log reached its database: behind a cut link that
    # is many seconds later, after TCP's retransmissions get through.
    row = _log(
        "INSERT INTO calls (message_id, attempt, lease_version, pid, at)"
        " VALUES (%s, %s, %s, %s, to_timestamp(%s)) RETURNING seq",
        (message.id, message.attempts, message.lease_version, os.getpid(), time.time()),
    )
    if isinstance(message.payload, dict) and message.payload.get("poison"):
        os._exit(70)
    outcome = "ok"
    try:
        _publisher()(message)
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        if row is not None:
            _log("UPDATE calls SET outcome = %s WHERE seq = %s RETURNING seq", (outcome, row[0]))


# What the relay's start-up check reads: the worst case of one call.
publish.timeout_seconds = CONNECT_TIMEOUT + READ_TIMEOUT + 1.0  # type: ignore[attr-defined]
