"""Publishers for the progress, queue and hang tests: a receiver in the test's database.

Every call is written to ``received`` (message id, attempt, lease version,
pid, thread, time from the database clock) *before* the publisher decides
what to do, so a test sees each attempt, including one that never returns.
``delivered`` is true on the rows of publishes that returned normally.

Configured from the environment (names outside ``OUTBOX_*``, which the relay
refuses when it does not know them):

* ``RECEIVER_DSN``: the test database (required);
* ``RECEIVER_DELAY_SECONDS``: how long ``record`` waits before returning.

Callables (``OUTBOX_PUBLISHER=tests.apps.receiver:<name>``):

* ``record``: waits ``RECEIVER_DELAY_SECONDS``, then succeeds;
* ``hang_once``: the first call for a message never returns (it sleeps for an
  hour, as a publish stuck on a socket without a timeout would); later calls
  for the same message succeed at once;
* ``fail``: always raises ``RetryableError`` (a receiver that is down).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg

from outbox_relay import RetryableError

DDL = """
CREATE TABLE IF NOT EXISTS received (
    seq           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    bigint      NOT NULL,
    attempts      integer     NOT NULL,
    lease_version bigint      NOT NULL,
    pid           integer     NOT NULL,
    thread        text        NOT NULL,
    delivered     boolean     NOT NULL DEFAULT false,
    at            timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

HANG_SECONDS = 3600.0

_local = threading.local()


def _connection() -> psycopg.Connection[Any]:
    # One connection per process and thread: the threads pool and the
    # relay's publish executor call publishers from several threads at once,
    # and a prefork child must not reuse its parent's socket.
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed or getattr(_local, "pid", None) != os.getpid():
        conn = psycopg.connect(os.environ["RECEIVER_DSN"], autocommit=True)
        _local.conn = conn
        _local.pid = os.getpid()
    return conn


def _arrive(message: Any) -> tuple[int, int]:
    """Record this call; return (its seq, how many calls for this message came before)."""
    row = (
        _connection()
        .execute(
            "INSERT INTO received (message_id, attempts, lease_version, pid, thread)"
            " VALUES (%s, %s, %s, %s, %s)"
            " RETURNING seq, (SELECT count(*) FROM received WHERE message_id = %s)",
            (
                message.id,
                message.attempts,
                message.lease_version,
                os.getpid(),
                threading.current_thread().name,
                message.id,
            ),
        )
        .fetchone()
    )
    assert row is not None
    return int(row[0]), int(row[1])


def _delivered(seq: int) -> None:
    _connection().execute("UPDATE received SET delivered = true WHERE seq = %s", (seq,))


def record(message: Any) -> None:
    seq, _ = _arrive(message)
    time.sleep(float(os.environ.get("RECEIVER_DELAY_SECONDS", "0")))
    _delivered(seq)


def hang_once(message: Any) -> None:
    seq, earlier = _arrive(message)
    if earlier == 0:
        time.sleep(HANG_SECONDS)
    _delivered(seq)


def fail(message: Any) -> None:
    _arrive(message)
    raise RetryableError("receiver unavailable (test)")
