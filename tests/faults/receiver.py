"""The consumer end of the fault suite: a webhook receiver on loopback that
applies every message through the inbox and keeps a log of every request.

Each request is logged in ``deliveries`` with its verdict, on a connection of
its own, before the answer is sent, so the log holds the requests whose
answer never reached the relay too. The effect itself is
one row in ``effects``, written in the same transaction as the inbox record
(``outbox_relay.inbox.receive``): a repeat of a message already applied is
answered 200 and logged as ``duplicate``, never applied twice. ``effects``
has no unique constraint on purpose: the ledger counts its rows, so a second
effect would be seen rather than turned into an error the relay retries.

What the receiver does with a request is decided by the row id and the
attempt (headers ``Outbox-Message-Id`` / ``Outbox-Attempt``) and by the
switches on ``Behaviour``, which a scenario flips while the relay runs:

* ``reject_every``: every n-th id is answered 400 (permanent: it ends ``dead``);
* ``lose_every``: on the first attempt of every n-th id, apply the effect,
  commit, then drop the connection without answering (a lost response);
* ``slow_every`` / ``slow_seconds``: on the first attempt of every n-th id,
  apply, then answer only after ``slow_seconds`` (past the publish timeout);
* ``fail_every``: 503 on the first attempt of every n-th id (transient);
* ``down()`` / ``up()``: stop listening (connections refused) and start
  again on the same port.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from outbox_relay import inbox

CONSUMER = "fault-receiver"
PATH = "/hooks"

DDL = """
CREATE TABLE IF NOT EXISTS deliveries (
    seq        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id bigint      NOT NULL,
    key        text        NOT NULL,
    attempt    integer     NOT NULL,
    verdict    text        NOT NULL,   -- applied | duplicate | rejected | failed | lost | slow
    at         timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS effects (
    message_id bigint      NOT NULL,
    at         timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


@dataclass
class Behaviour:
    reject_every: int = 0
    lose_every: int = 0
    slow_every: int = 0
    slow_seconds: float = 0.0
    fail_every: int = 0


def _every(n: int, message_id: int, attempt: int) -> bool:
    return n > 0 and attempt == 1 and message_id % n == 0


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle on, the second waits
    # for the client's delayed ACK (~40 ms a request on Linux).
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self.server.receiver.opened(self.connection)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        self.server.receiver.closed(self.connection)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        receiver = self.server.receiver
        message_id = int(self.headers["Outbox-Message-Id"])
        attempt = int(self.headers.get("Outbox-Attempt") or 1)
        key = self.headers["Idempotency-Key"]
        plan = receiver.behaviour
        if plan.reject_every and message_id % plan.reject_every == 0:
            receiver.log(message_id, key, attempt, "rejected")
            return self._answer(400)
        if _every(plan.fail_every, message_id, attempt):
            receiver.log(message_id, key, attempt, "failed")
            return self._answer(503)
        lose = _every(plan.lose_every, message_id, attempt)
        slow = _every(plan.slow_every, message_id, attempt)
        applied = receiver.apply(message_id, key)
        verdict = "applied" if applied else "duplicate"
        receiver.log(
            message_id, key, attempt, ("lost " if lose else "slow " if slow else "") + verdict
        )
        if lose:
            # Effect committed, answer never sent: close without a byte.
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return None
        if slow:
            time.sleep(plan.slow_seconds)
        return self._answer(200)

    def _answer(self, status: int) -> None:
        body = json.dumps({"ok": status == 200}).encode()
        with contextlib.suppress(OSError):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    receiver: Receiver

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # relays die mid-request in these tests; that is the point


class Receiver:
    """Serves ``url`` from a thread of the test process until ``close()``."""

    def __init__(self, dsn: str, *, port: int = 0, bind: str = "127.0.0.1") -> None:
        self.dsn = dsn
        self.behaviour = Behaviour()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(DDL)
            inbox.ensure_inbox(conn)
        self._pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            dsn,
            min_size=2,
            max_size=6,
            # The receiver's database is never the one under fault: no need to
            # wait for each commit's fsync (that was most of a request's time).
            kwargs={"autocommit": True, "options": "-c synchronous_commit=off"},
            open=True,
        )
        self._server: _Server | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.port = port
        self.bind = bind
        self.up()

    @property
    def url(self) -> str:
        return self.url_at("127.0.0.1")

    def url_at(self, host: str) -> str:
        """The URL as seen from a host that reaches this one at ``host``."""
        return f"http://{host}:{self.port}{PATH}"

    def apply(self, message_id: int, key: str) -> bool:
        with (
            self._pool.connection() as conn,
            inbox.receive(conn, consumer=CONSUMER, message_id=key) as fresh,
        ):
            if fresh:
                conn.execute("INSERT INTO effects (message_id) VALUES (%s)", (message_id,))
            return fresh

    def log(self, message_id: int, key: str, attempt: int, verdict: str) -> None:
        with self._pool.connection() as conn:
            conn.execute(
                "INSERT INTO deliveries (message_id, key, attempt, verdict)"
                " VALUES (%s, %s, %s, %s)",
                (message_id, key, attempt, verdict),
            )

    def opened(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.add(connection)

    def closed(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.discard(connection)

    def up(self) -> None:
        if self._server is not None:
            return
        server = _Server((self.bind, self.port), _Handler)
        server.receiver = self
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()

    def down(self) -> None:
        """Stop listening: new connections are refused until ``up()``."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            if self._thread is not None:
                self._thread.join(5)
        # Kept-alive connections would go on being served by their threads:
        # a host that goes down takes them with it.
        with self._lock:
            open_now, self._connections = list(self._connections), set()
        for connection in open_now:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.down()
        self._pool.close()
