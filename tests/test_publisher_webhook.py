"""The webhook publisher against a real HTTP server on loopback, driving real outbox rows.

The server is scripted per aggregate id: each request pops the next action
(a status, a slow answer, a dropped connection) from that aggregate's
script, then answers 200 once the script is empty.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

import outbox_relay
from outbox_relay import RetryPolicy, dispatch_once, store
from outbox_relay.errors import ConfigError, PermanentError, RetryableError
from outbox_relay.publishers import (
    Router,
    WebhookPublisher,
    parse_retry_after,
    publisher_timeout,
    resolve_publisher,
    router_from_config,
)

from .chunks import deliver_chunks
from .closing import closing_every

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@dataclass
class Action:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b'{"ok":true}'
    delay: float = 0.0
    drop: bool = False
    # Answer with what the request carried (path and credentials), as some
    # receivers' error pages do.
    echo: bool = False


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: bytes


class Server:
    """A scripted HTTP/1.1 server (keep-alive) recording every request."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[Request] = []
        self.connections = 0  # TCP connections accepted
        self.scripts: dict[str, deque[Action]] = defaultdict(deque)
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with server.lock:
                    server.connections += 1

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                headers = {k: v for k, v in self.headers.items()}
                aggregate = self.headers.get("Outbox-Aggregate-Id", "")
                with server.lock:
                    server.requests.append(Request(self.path, headers, body))
                    script = server.scripts[aggregate]
                    action = script.popleft() if script else Action()
                if action.drop:
                    # Close the socket without a response.
                    self.close_connection = True
                    return
                if action.delay:
                    time.sleep(action.delay)
                body = action.body
                if action.echo:
                    sent = [
                        self.headers.get(n, "") for n in ("Authorization", "X-Api-Key", "X-Sig")
                    ]
                    body = f"bad request {self.path} {' '.join(sent)}".encode()
                self.send_response(action.status)
                for name, value in action.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Listener(ThreadingHTTPServer):
            request_queue_size = 128  # a chunk's threads connect at once

        self.httpd = Listener(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def script(self, aggregate_id: str, *actions: Action) -> None:
        with self.lock:
            self.scripts[aggregate_id].extend(actions)

    def received(self, aggregate_id: str) -> list[Request]:
        with self.lock:
            return [
                r for r in self.requests if r.headers.get("Outbox-Aggregate-Id") == aggregate_id
            ]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def _close_publishers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield from closing_every(monkeypatch, WebhookPublisher)


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.close()


# Fast timeouts so "slower than the read timeout" costs a fraction of a second.
FAST = {"connect_timeout": 0.5, "write_timeout": 0.5, "read_timeout": 0.4}
NO_BACKOFF = RetryPolicy(max_attempts=4, backoff_base=0.0)


def _enqueue(conn: psycopg.Connection, aggregate_id: str, **extra: Any) -> int:
    return outbox_relay.enqueue(
        conn,
        aggregate_type="order",
        aggregate_id=aggregate_id,
        event_type=extra.pop("event_type", "order.paid"),
        payload=extra.pop("payload", {"order": aggregate_id, "amount": 42}),
        **extra,
    )


def _dispatch(conn: psycopg.Connection, publisher: Any, policy: RetryPolicy = NO_BACKOFF) -> int:
    return dispatch_once(
        conn,
        publisher,
        owner="test",
        batch=50,
        lease=timedelta(seconds=30),
        policy=policy,
        publish_timeout=publisher_timeout(publisher) or 5.0,
    )


def _make_due(conn: psycopg.Connection) -> None:
    """Jump over Retry-After waits without sleeping."""
    conn.execute("UPDATE outbox SET available_at = now() WHERE status = 'pending'")


def _message(message_id: int, aggregate_id: str, payload: Any) -> outbox_relay.Message:
    """A first attempt at an order.paid message, for a publisher called directly."""
    return outbox_relay.Message(
        id=message_id,
        idempotency_key=f"outbox-{message_id}",
        aggregate_type="order",
        aggregate_id=aggregate_id,
        event_type="order.paid",
        payload=payload,
        headers={},
        attempts=1,
        lease_version=1,
        created_at=None,
    )


def _row(conn: psycopg.Connection, message_id: int) -> dict[str, Any]:
    row = store.get_row(conn, message_id)
    assert row is not None
    return row


def test_every_message_ends_done_or_dead_as_classified(
    conn: psycopg.Connection, server: Server
) -> None:
    soon = datetime.now(timezone.utc) + timedelta(seconds=90)
    server.script("flaky", Action(503), Action(502, body=b"upstream down"))
    server.script("limited", Action(429, headers={"Retry-After": "120"}))
    server.script("dated", Action(503, headers={"Retry-After": format_datetime(soon, True)}))
    server.script("slow", Action(delay=1.0))
    server.script("dropped", Action(drop=True))
    server.script("timeout408", Action(408), Action(425))
    server.script("invalid", Action(400, body=b"field 'amount' is invalid " + b"x" * 1000))
    server.script("gone", Action(410, body=b""))
    server.script("moved", Action(301, headers={"Location": "https://elsewhere.test/hook?t=1"}))
    server.script("broken", *[Action(500)] * 10)

    names = [
        "ok",
        "flaky",
        "limited",
        "dated",
        "slow",
        "dropped",
        "timeout408",
        "invalid",
        "gone",
        "moved",
        "broken",
    ]
    ids = {name: _enqueue(conn, name) for name in names}
    publisher = WebhookPublisher(server.url + "/hooks", secret=SECRET, **FAST)

    # Round 1: everything is tried once.
    assert _dispatch(conn, publisher) == len(names)
    assert _row(conn, ids["ok"])["status"] == "done"
    for name in ("invalid", "gone", "moved"):
        assert _row(conn, ids[name])["status"] == "dead", name
    limited = _row(conn, ids["limited"])
    assert limited["status"] == "pending"
    wait = (limited["available_at"] - datetime.now(timezone.utc)).total_seconds()
    assert 100 < wait <= 121, "Retry-After: 120 is the minimum delay"
    dated = _row(conn, ids["dated"])
    wait = (dated["available_at"] - datetime.now(timezone.utc)).total_seconds()
    assert 70 < wait <= 91, "an HTTP-date Retry-After counts from now"
    slow = _row(conn, ids["slow"])["last_error"]
    # Which wait ran out, and every bound, to tell which setting to raise.
    assert "ReadTimeout" in slow and re.search(r"connect \S+s, write \S+s, read \S+s", slow), slow
    assert "closed the connection" in _row(conn, ids["dropped"])["last_error"]
    assert "HTTP 503" in _row(conn, ids["flaky"])["last_error"]

    # Later rounds: retries are due at once (no backoff); Retry-After rows are
    # moved forward by hand instead of sleeping.
    for _ in range(4):
        _make_due(conn)
        _dispatch(conn, publisher)

    expected = {
        "ok": ("done", 1),
        "flaky": ("done", 3),
        "limited": ("done", 2),
        "dated": ("done", 2),
        "slow": ("done", 2),
        "dropped": ("done", 2),
        "timeout408": ("done", 3),
        "invalid": ("dead", 1),
        "gone": ("dead", 1),
        "moved": ("dead", 1),
        "broken": ("dead", 4),
    }
    for name, (status, attempts) in expected.items():
        row = _row(conn, ids[name])
        assert (row["status"], row["attempts"]) == (status, attempts), (name, row["last_error"])
        assert len(server.received(name)) == attempts, name
        if status == "done":
            assert row["last_error"] is None

    invalid = _row(conn, ids["invalid"])["last_error"]
    assert invalid.startswith("permanent: PermanentError: webhook http://127.0.0.1:")
    assert "HTTP 400: field 'amount' is invalid xxx" in invalid
    assert len(invalid) < 420, "the body excerpt is bounded"
    assert "HTTP 410" in _row(conn, ids["gone"])["last_error"]
    moved = _row(conn, ids["moved"])["last_error"]
    assert "HTTP 301 redirect to https://elsewhere.test/hook;" in moved
    assert "t=1" not in moved, "query strings (tokens) stay out of last_error"
    broken = _row(conn, ids["broken"])["last_error"]
    assert broken.startswith("retries exhausted after 4 attempts; last: retryable:")
    assert "HTTP 500" in broken

    # Every attempt of a message carried the same idempotency key, and every
    # signature verifies with the Standard Webhooks reference library.
    verifier = Webhook(SECRET)
    for name, message_id in ids.items():
        requests = server.received(name)
        keys = {r.headers["Idempotency-Key"] for r in requests}
        assert keys == {f"outbox-{message_id}"}, name
        for request in requests:
            assert request.headers["webhook-id"] == f"outbox-{message_id}"
            assert request.headers["Outbox-Message-Id"] == str(message_id)
            assert request.headers["Outbox-Event-Type"] == "order.paid"
            assert request.headers["Outbox-Aggregate-Type"] == "order"
            assert request.headers["Content-Type"] == "application/json"
            assert verifier.verify(request.body, request.headers) == {
                "order": name,
                "amount": 42,
            }
        assert [r.headers["Outbox-Attempt"] for r in requests] == [
            str(n) for n in range(1, len(requests) + 1)
        ]
    # A tampered body fails verification.
    request = server.received("ok")[0]
    with pytest.raises(WebhookVerificationError):
        verifier.verify(request.body.replace(b"42", b"43"), request.headers)


def test_envelope_operation_key_and_header_safety(conn: psycopg.Connection, server: Server) -> None:
    # The server sees the aggregate id percent-encoded, so scripts use that form.
    server.script("z%C3%BCrich%0D%0AX-Injected: 1", Action(503))
    message_id = _enqueue(
        conn,
        "zürich\r\nX-Injected: 1",
        operation_key="charge-7f3a",
        headers={"traceparent": "00-abc-def-01", "Content-Length": "0", "bad name": "x"},
    )
    publisher = resolve_publisher(
        server.url + "/events",
        publish_timeout_seconds=2.0,
        webhook_secret=SECRET,
        webhook_envelope="true",
        webhook_headers={"Authorization": "Bearer t0ken"},
    )
    assert isinstance(publisher, WebhookPublisher)
    assert publisher.envelope and publisher.timeout_seconds <= 2.0
    assert "t0ken" not in repr(publisher) and "whsec" not in repr(publisher)

    _dispatch(conn, publisher)
    _dispatch(conn, publisher)
    assert _row(conn, message_id)["status"] == "done"

    requests = [r for r in server.requests if r.path == "/events"]
    assert len(requests) == 2
    created = _row(conn, message_id)["created_at"]
    for request in requests:
        headers = request.headers
        assert "X-Injected" not in headers
        assert headers["Outbox-Aggregate-Id"] == "z%C3%BCrich%0D%0AX-Injected: 1"
        assert headers["Idempotency-Key"] == "charge-7f3a"  # the operation key
        assert headers["traceparent"] == "00-abc-def-01"
        assert headers["Authorization"] == "Bearer t0ken"
        assert headers["Content-Length"] == str(len(request.body))
        assert "bad name" not in headers
        document = Webhook(SECRET).verify(request.body, headers)
        assert document["type"] == "order.paid"
        assert document["data"] == {"order": "zürich\r\nX-Injected: 1", "amount": 42}
        stamp = datetime.fromisoformat(document["timestamp"].replace("Z", "+00:00"))
        assert stamp == created
    # The body is byte-identical across retries (only the signature is renewed).
    assert requests[0].body == requests[1].body


def _deliverer(
    conn: psycopg.Connection, publisher: WebhookPublisher, concurrency: int
) -> outbox_relay.Deliverer:
    """The Celery path's deliverer, on this test's connection."""
    return outbox_relay.Deliverer(
        publisher,
        db=outbox_relay.DirectDatabase(conn),
        policy=NO_BACKOFF,
        publish_timeout=publisher.timeout_seconds,
        concurrency=concurrency,
    )


def test_chunk_delivery_through_the_deliverer(conn: psycopg.Connection, server: Server) -> None:
    """The Celery path: claim, then Deliverer.deliver publishes a chunk concurrently."""
    ids = [_enqueue(conn, f"agg-{i}") for i in range(12)]
    server.script("agg-3", Action(400))
    server.script("agg-5", Action(503))
    publisher = WebhookPublisher(server.url, secret=SECRET, **FAST)
    relay = _deliverer(conn, publisher, concurrency=6)
    try:
        claimed = outbox_relay.claim(conn, owner="w1", batch=50, lease=timedelta(seconds=30))
        report = relay.deliver([c.ref for c in claimed])
    finally:
        relay.close()
    assert (report.done, report.dead, report.retried, report.lost) == (10, 1, 1, 0)
    statuses = {i: _row(conn, i)["status"] for i in ids}
    assert statuses[ids[3]] == "dead" and statuses[ids[5]] == "pending"
    assert len(server.requests) == 12


def test_chunks_reuse_each_publishing_threads_connection(
    conn: psycopg.Connection, server: Server
) -> None:
    # A receiver slower than the ramp: every chunk publishes from all its
    # threads at once. Each thread keeps its connection for the next chunk
    # (with one client shared by the threads, 32 were kept and every later
    # chunk opened the rest again: 80 connections here, and a TLS handshake
    # each in production).
    threads, chunks = 48, 3
    for i in range(threads * chunks):
        _enqueue(conn, f"slow-{i}")
        server.script(f"slow-{i}", Action(delay=0.03))
    publisher = WebhookPublisher(server.url, secret=SECRET, **FAST)
    assert deliver_chunks(conn, publisher, rows=threads, chunks=chunks) == threads * chunks
    assert len(server.requests) == threads * chunks
    # One connection per thread (and the task's own thread, which may publish inline).
    assert server.connections <= threads + 1, server.connections


def test_refused_connection_is_retryable(conn: psycopg.Connection) -> None:
    with socket_bound_then_closed() as port:
        publisher = WebhookPublisher(f"http://127.0.0.1:{port}/x", **FAST)
        message_id = _enqueue(conn, "nobody")
        _dispatch(conn, publisher)
    row = _row(conn, message_id)
    assert row["status"] == "pending" and row["attempts"] == 1
    assert row["last_error"].startswith("retryable: RetryableError: webhook http://127.0.0.1:")
    assert "ConnectError" in row["last_error"]


class socket_bound_then_closed:
    """A loopback port that nothing listens on."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        pass


def test_retry_after_parsing() -> None:
    now = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)
    assert parse_retry_after("120") == timedelta(seconds=120)
    assert parse_retry_after(" 0 ") == timedelta(0)
    in_90 = format_datetime(now + timedelta(seconds=90), usegmt=True)
    assert parse_retry_after(in_90, now=now) == timedelta(seconds=90)
    assert parse_retry_after("Sat, 01 Mar 2025 11:00:00 GMT", now=now) == timedelta(0)
    assert parse_retry_after("1000000", cap=3600) == timedelta(hours=1)
    for junk in (None, "", "soon", "-5", "1.5e3"):
        assert parse_retry_after(junk) is None


def test_configuration_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="OUTBOX_PUBLISH_TIMEOUT_SECONDS"):
        resolve_publisher(
            "https://example.test/hook", publish_timeout_seconds=5, webhook_read_timeout=30
        )
    with pytest.raises(ConfigError, match="whsec_"):
        WebhookPublisher("https://example.test/hook", secret="whsec_not base64!")
    # docker-compose.yml passes OUTBOX_WEBHOOK_SECRET empty when .env leaves
    # it out: refused, naming the variable, never an unsigned request.
    with pytest.raises(ConfigError, match=r"OUTBOX_WEBHOOK_SECRET\) must not be empty"):
        resolve_publisher("https://example.test/hook", webhook_secret="")
    with pytest.raises(ConfigError, match=r"OUTBOX_PUBLISHER\['order.\*'\]"):
        resolve_publisher({"order.*": "ftp://example.test/"})
    with pytest.raises(ConfigError, match="unexpected keyword"):
        resolve_publisher({"url": "https://example.test/hook", "secrte": SECRET})
    # A per-route mapping, the default route, and timeout_seconds of the slowest route.
    router = resolve_publisher(
        {
            "order.*": {"url": "https://a.test/hook", "read_timeout": 3.0},
            "default": "https://b.test/hook",
        },
        publish_timeout_seconds=8.0,
    )
    assert isinstance(router, Router)
    assert router.timeout_seconds == pytest.approx(8.0)
    fallback = router_from_config(
        {"order.*": "https://a.test/"}, default="https://b.test/", publish_timeout_seconds=4
    )
    assert isinstance(fallback.route("user.created"), WebhookPublisher)


def test_a_forked_child_builds_its_own_client(dsn: str, server: Server) -> None:
    publisher = WebhookPublisher(server.url, **FAST)
    with psycopg.connect(dsn, autocommit=True) as conn:
        first = _enqueue(conn, "parent")
        _dispatch(conn, publisher)
        second = _enqueue(conn, "child")
    parent_client = publisher._clients.peek()
    assert parent_client is not None
    # No database connection is open across the fork (rule 7 of the design).
    pid = os.fork()
    if pid == 0:  # the child: its own database connection and HTTP client
        code = 1
        try:
            with psycopg.connect(dsn, autocommit=True) as child_conn:
                _dispatch(child_conn, publisher)
                if publisher._clients.peek() is not parent_client:
                    code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's client still works (the child did not close its sockets).
    with psycopg.connect(dsn, autocommit=True) as conn:
        third = _enqueue(conn, "parent-again")
        _dispatch(conn, publisher)
        assert publisher._clients.peek() is parent_client
        for message_id in (first, second, third):
            assert _row(conn, message_id)["status"] == "done"


def _self_signed(folder: Path) -> tuple[Path, Path]:
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_is_verified_by_default(tmp_path: Path) -> None:
    key, cert = _self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    srv = Server(tls=context)
    message = _message(1, "tls", {"a": 1})
    try:
        with pytest.raises(RetryableError, match="CERTIFICATE_VERIFY_FAILED"):
            WebhookPublisher(srv.url, **FAST)(message)
        WebhookPublisher(srv.url, verify=str(cert), **FAST)(message)
        assert len(srv.received("tls")) == 1
    finally:
        srv.close()


def test_publisher_raises_the_classified_errors_directly(server: Server) -> None:
    message = _message(9, "direct", [1, 2, 3])
    publisher = WebhookPublisher(server.url, **FAST)
    server.script("direct", Action(429, headers={"Retry-After": "7"}), Action(422), Action(204))
    with pytest.raises(RetryableError) as retry:
        publisher(message)
    assert retry.value.retry_after == timedelta(seconds=7)
    with pytest.raises(PermanentError, match="HTTP 422"):
        publisher(message)
    publisher(message)
    assert json.loads(server.received("direct")[0].body) == [1, 2, 3]
    publisher.close()


def test_a_response_that_echoes_the_request_puts_no_credential_in_last_error(
    server: Server,
) -> None:
    """last_error quotes a failed response's body (operators read it, the
    operator role included): a receiver that echoes the request must not
    carry the publisher's own credentials there."""
    import base64

    message = _message(11, "echo", {})
    host = server.url.removeprefix("http://")
    publisher = WebhookPublisher(
        f"http://alice:BasicPw4567@{host}/hook?token=QueryTok987",
        headers={"X-Api-Key": "KeySecret123", "X-Sig": "Bearer BearTok456"},
        secret=SECRET,
        **FAST,
    )
    server.script("echo", Action(400, echo=True))
    with pytest.raises(PermanentError) as failed:
        publisher(message)
    text = str(failed.value)
    basic = base64.b64encode(b"alice:BasicPw4567").decode()
    # The receiver did get them; the error does not repeat them.
    request = server.received("echo")[0]
    assert request.headers["Authorization"] == f"Basic {basic}"
    assert "HTTP 400: bad request /hook?token=****" in text, text
    for secret in ("BasicPw4567", basic, "QueryTok987", "KeySecret123", "BearTok456"):
        assert secret not in text, text
    publisher.close()


def test_no_credential_leaks_from_a_body_cut_short_or_quoted_percent_encoded(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a security walkthrough: the body is read up to 4096 bytes
    and masked before the 300-character excerpt, but a credential that
    straddled byte 4096 kept its head (the excerpt collapses whitespace, so
    a blank stretch brought it in: "pass: BasicPw45"); one quoted
    percent-encoded (a receiver echoing a URL or form field) was kept whole;
    and a proxy's Proxy-Authorization, echoed by the proxy, too."""
    import base64

    host = server.url.removeprefix("http://")
    url = f"http://alice:BasicPw4567@{host}/hook?token=Query+Tok/987"
    publisher = WebhookPublisher(url, headers={"X-Api-Key": "Key Secret:123"}, **FAST)
    head = b"error page: pass: "
    pad = b" " * (4096 - len(head) - len(b"BasicPw45"))
    server.script("cut", Action(400, body=head + pad + b"BasicPw4567 and more"))
    with pytest.raises(PermanentError) as failed:
        publisher(_message(12, "cut", {}))
    text = str(failed.value)
    assert text.endswith("HTTP 400: error page: pass: ****"), text
    assert "BasicPw" not in text

    basic = base64.b64encode(b"alice:BasicPw4567").decode()
    quoted = " ".join(
        urllib.parse.quote(v, safe="")
        for v in (f"Basic {basic}", "Query+Tok/987", "Key Secret:123", "BasicPw4567")
    )
    server.script("quoted", Action(400, body=f"got {quoted} Key+Secret%3A123".encode()))
    with pytest.raises(PermanentError) as failed:
        publisher(_message(13, "quoted", {}))
    text = str(failed.value)
    assert text.endswith("HTTP 400: got **** **** **** **** ****"), text
    # The path as sent: the token as written in the URL, "+" and all.
    server.script("path", Action(400, echo=True))
    with pytest.raises(PermanentError) as failed:
        publisher(_message(14, "path", {}))
    assert "HTTP 400: bad request /hook?token=**** " in str(failed.value), failed.value
    publisher.close()

    monkeypatch.setenv("HTTP_PROXY", "http://proxyuser:ProxyPw000@127.0.0.1:9")
    behind_proxy = WebhookPublisher(url, **FAST, trust_env=True)
    proxy_basic = base64.b64encode(b"proxyuser:ProxyPw000").decode()
    assert {"ProxyPw000", proxy_basic} <= set(behind_proxy._secrets)
    assert behind_proxy._without_secrets(f"Basic {proxy_basic}".encode()) == b"Basic ****"
    behind_proxy.close()


def test_a_header_value_with_surrounding_whitespace_is_refused_without_quoting_it(
    server: Server,
) -> None:
    """OUTBOX_WEBHOOK_HEADERS='{"Authorization": "Bearer tok "}' (a space
    copied with the token) was accepted; h11 then refused every request with
    "Illegal header value b'Bearer tok '", which reached last_error (dead
    list, the worker's ERROR line) and httpcore's DEBUG log whole."""
    for value in ("Bearer HdrTok5551 ", " HdrTok5551"):
        with pytest.raises(ConfigError) as refused:
            WebhookPublisher(server.url + "/hook", headers={"Authorization": value})
        assert "webhook_headers Authorization: the value begins or ends with whitespace" in str(
            refused.value
        )
        assert "HdrTok5551" not in str(refused.value)
    # Whatever else an HTTP library's message quotes of a configured
    # credential is masked in last_error.
    publisher = WebhookPublisher(server.url + "/hook", headers={"X-Api-Key": "HdrTok5551"})
    assert publisher._scrub("Illegal header value b'HdrTok5551'") == "Illegal header value b'****'"
    publisher.close()


def test_headers_that_frame_the_request_or_belong_to_the_relay_are_refused() -> None:
    for name in ("Transfer-Encoding", "Host", "Content-Length", "Connection"):
        with pytest.raises(ConfigError, match=f"may not set {name}: those frame the request"):
            WebhookPublisher("https://example.test/hook", headers={name: "x"})
    for name in ("Idempotency-Key", "Outbox-Message-Id", "webhook-signature", "Content-Type"):
        with pytest.raises(ConfigError, match=f"may not set {name}: the relay sets it"):
            WebhookPublisher("https://example.test/hook", headers={name: "x"})
    # Credentials are the operator's to set.
    WebhookPublisher("https://example.test/hook", headers={"Authorization": "Bearer abcdef"})
