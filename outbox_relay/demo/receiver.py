"""The demo's webhook receiver: a local HTTP server that fails some requests on purpose.

It decides from the order id (header ``Outbox-Aggregate-Id``) and the attempt
(header ``Outbox-Attempt``) alone, so the outcome of every order is known in
advance and the same on every run:

* every 50th order (17, 67, ...) gets ``400``: a permanent error, the message ends ``dead``;
* every 7th (3, 10, ...) gets ``429`` with ``Retry-After: 1`` on its first attempt;
* every 5th (1, 6, ...) gets ``503`` on its first attempt;
* every 25th (4, 29, ...) gets ``503`` on its first two attempts;
* everything else, and every later attempt, gets ``200``.

It also plays the consumer's part of at-least-once delivery: it remembers
the idempotency keys it accepted and counts a repeat as a duplicate instead
of acting twice (what ``outbox_relay.inbox`` does with a database).
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Receiver", "Stats", "Verdict", "verdict"]

PATH = "/hooks"


@dataclass(frozen=True)
class Verdict:
    """What the receiver answers to one request."""

    status: int
    reason: str = ""
    retry_after: int | None = None


def verdict(order: int, attempt: int) -> Verdict:
    """The planned answer for ``order`` on its ``attempt`` (1 on the first try)."""
    if order % 50 == 17:
        return Verdict(400, "unknown customer: this order can never be accepted")
    if order % 7 == 3 and attempt == 1:
        return Verdict(429, "slow down", retry_after=1)
    if order % 5 == 1 and attempt == 1:
        return Verdict(503, "warming up")
    if order % 25 == 4 and attempt <= 2:
        return Verdict(503, "still warming up")
    return Verdict(200)


@dataclass
class Stats:
    """What the receiver saw; read with ``snapshot()`` from other threads."""

    by_status: Counter[int] = field(default_factory=Counter)
    accepted_keys: set[str] = field(default_factory=set)
    duplicates: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, status: int, key: str | None) -> None:
        with self.lock:
            self.by_status[status] += 1
            if status == 200 and key:
                if key in self.accepted_keys:
                    self.duplicates += 1
                else:
                    self.accepted_keys.add(key)

    def snapshot(self) -> tuple[dict[int, int], int, int]:
        """``({status: requests}, accepted messages, duplicates ignored)``."""
        with self.lock:
            return dict(self.by_status), len(self.accepted_keys), self.duplicates


def _int_header(handler: BaseHTTPRequestHandler, name: str) -> int | None:
    value = handler.headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: the publisher reuses its connections
    # Headers and body go out in separate writes; with Nagle on, each response
    # waited ~40 ms for the client's delayed ACK.
    disable_nagle_algorithm = True

    def do_POST(self) -> None:
        length = _int_header(self, "Content-Length") or 0
        self.rfile.read(length)  # the order itself; the verdict needs only the headers
        order = _int_header(self, "Outbox-Aggregate-Id")
        attempt = _int_header(self, "Outbox-Attempt") or 1
        if self.path != PATH or order is None:
            answer = Verdict(404 if self.path != PATH else 400, "not an outbox-relay webhook")
        else:
            answer = verdict(order, attempt)
        self.server.stats.record(answer.status, self.headers.get("Idempotency-Key"))
        body = json.dumps({"ok": answer.status == 200, "error": answer.reason or None}).encode()
        self.send_response(answer.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if answer.retry_after is not None:
            self.send_header("Retry-After", str(answer.retry_after))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would bury the progress display


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a kept-alive connection must not hold up shutdown
    # socketserver listens with a backlog of 5; a chunk's publishes connect
    # at once, and the kernel refuses what does not fit (each a retry).
    request_queue_size = 128
    stats: Stats

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A worker the demo stops (at the end, or on Ctrl-C) drops its
        # kept-alive connections, possibly mid-request: expected, and a
        # traceback on the demo's screen would read like a failure.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class Receiver:
    """The receiver on ``127.0.0.1`` at a free port, served by a daemon thread."""

    def __init__(self) -> None:
        self.stats = Stats()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.stats = self.stats
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="demo-webhook",
            daemon=True,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{PATH}"

    def start(self) -> Receiver:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()
