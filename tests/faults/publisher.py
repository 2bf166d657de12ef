"""The relay's end of the fault suite: the real webhook publisher, with a call log.

``OUTBOX_PUBLISHER=tests.faults.publisher:publish`` in the workers. Each call
is written to ``calls`` (row id, attempt, lease version, pid, time) before the
webhook request and given its outcome after it (``ok`` or the error's class;
the call's write waited for at most ``LOG_WAIT``, see there),
so the ledger can tell *why* the receiver saw a message twice: the earlier
call's response was lost (it ended in an error although the receiver applied
it), or the earlier lease was lost after a successful call (its worker was
killed or frozen, or its finalize failed), which the next lease's higher
version shows. A call with no outcome is one whose process died in it (or
whose outcome was lost on the way to the log).

A message whose payload has ``"poison": true`` kills its worker process
(``os._exit``) every time it is published, as a segfaulting C extension or
the OOM killer would.

Configured from the environment (outside ``OUTBOX_*``, which the relay
checks): ``FAULT_WEBHOOK_URL`` (the receiver) and ``FAULT_DSN`` (the test
database, for the call log).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

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
# How long a publish waits for its call to be logged. The log is the
# ledger's evidence, not part of the publisher under test: behind a cut link
# its connection hangs in TCP's retransmissions, and a publish that waited
# on it overran its declared timeout (a chunk's publishes still running when
# its task's time limit struck, their rows re-sent a lease later, the calls
# never logged: duplicates with no evidence). Past this the publish goes on
# and the write lands when the connection recovers, with ``at`` still the
# time of the call. The outcome is written after the call without waiting
# (in order, on the same connection).
LOG_WAIT = 0.5

_webhook: dict[int, WebhookPublisher] = {}
_lock = threading.Lock()


@dataclass
class _Write:
    sql: str
    params: tuple[Any, ...]
    # The calls row an outcome belongs to: its INSERT's write (same queue, so
    # written before the UPDATE that needs its seq).
    of: _Write | None = None
    seq: int | None = None
    done: threading.Event = field(default_factory=threading.Event)


class _CallLog:
    """One writer thread and connection per process, writing in order."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[_Write] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="fault-call-log", daemon=True).start()

    def write(self, sql: str, params: tuple[Any, ...], of: _Write | None = None) -> _Write:
        item = _Write(sql, params, of)
        self.queue.put(item)
        return item

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while True:
            item = self.queue.get()
            try:
                if item.of is not None:
                    if item.of.seq is None:
                        continue  # its INSERT failed: nothing to give an outcome
                    item.params = (*item.params, item.of.seq)
                if conn is None or conn.closed:
                    conn = psycopg.connect(
                        os.environ["FAULT_DSN"],
                        autocommit=True,
                        connect_timeout=5,
                        # Evidence, not the state under test.
                        options="-c synchronous_commit=off",
                    )
                row = conn.execute(item.sql, item.params).fetchone()
                item.seq = int(row[0]) if row else None
            except psycopg.Error:
                # Best effort: when the fault cuts the relay off from the log's
                # database too (link-cut), a write may be lost. A "lease lost
                # after publish" needs its call logged (harness Run._causes).
                if conn is not None:
                    conn.close()
                conn = None
            finally:
                item.done.set()


_logs: dict[int, _CallLog] = {}


def _log() -> _CallLog:
    # Per process: a prefork child must not reuse its parent's thread or socket.
    with _lock:
        log = _logs.get(os.getpid())
        if log is None:
            log = _logs[os.getpid()] = _CallLog()
        return log


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


def publish(message: Message) -> None:
    # ``at``: when the call was made, by this process's clock (the test's
    # host), not when the log reached its database: behind a cut link that
    # is many seconds later, after TCP's retransmissions get through.
    call = _log().write(
        "INSERT INTO calls (message_id, attempt, lease_version, pid, at)"
        " VALUES (%s, %s, %s, %s, to_timestamp(%s)) RETURNING seq",
        (message.id, message.attempts, message.lease_version, os.getpid(), time.time()),
    )
    poison = isinstance(message.payload, dict) and message.payload.get("poison")
    # A poison message's process dies next: its call must be written first.
    call.done.wait(5.0 if poison else LOG_WAIT)
    if poison:
        os._exit(70)
    outcome = "ok"
    try:
        _publisher()(message)
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        _log().write(
            "UPDATE calls SET outcome = %s WHERE seq = %s RETURNING seq", (outcome,), of=call
        )


# What the relay's start-up check reads: the worst case of one call.
# (The webhook's own, 3.5 s: connect, write and read, plus the log's wait.)
publish.timeout_seconds = CONNECT_TIMEOUT + READ_TIMEOUT + 1.0 + LOG_WAIT  # type: ignore[attr-defined]
