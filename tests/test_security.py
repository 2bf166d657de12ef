"""Security defaults, tested against the real thing.

* The least-privilege roles of ``outbox-relay grant``: real roles in a real
  database, each connecting as itself and running the real code paths
  (enqueue, the relay's services, the operator commands), and being refused
  everything else.
* The webhook publisher: TLS verification, warnings for credentials over
  plain HTTP, no credential or token in any log line, and producer headers
  forwarded only through an allowlist, all over real HTTP on loopback.
* The broker publisher verifies TLS (certificate and host name) by default.
* The metrics exporter listens on loopback unless told otherwise.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import socket
import ssl
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from click.testing import CliRunner, Result
from psycopg import errors, sql
from psycopg.conninfo import make_conninfo

from outbox_relay import (
    ConfigError,
    DirectDatabase,
    Message,
    OperationKeyConflict,
    OutboxTable,
    PermanentError,
    RetryableError,
    enqueue,
    operations,
    store,
)
from outbox_relay.cli import main
from outbox_relay.metrics import OutboxCollector
from outbox_relay.publishers import BrokerPublisher, WebhookPublisher, resolve_publisher
from outbox_relay.services.claimer import Claimer
from outbox_relay.services.deliverer import Deliverer
from outbox_relay.services.purger import Purger
from outbox_relay.services.rescuer import Rescuer
from outbox_relay.sql.queries import migrations_for

from .opsdata import LEASE, add, claim_all, db_now, make_dead

pytestmark = pytest.mark.security


# ================================================================ roles
Connect = Callable[[str], psycopg.Connection[Any]]


@pytest.fixture
def roles(conn: psycopg.Connection[Any], dsn: str) -> Iterator[Callable[[str], tuple[str, str]]]:
    """``make(kind)`` creates a login role with ``operations.grants(role, kind)``
    applied and returns ``(role, dsn as that role)``. Roles are cluster-wide:
    unique names, dropped (with what they were granted) after the test."""
    made: list[str] = []

    def make(kind: str) -> tuple[str, str]:
        name = f"outbox_sec_{kind}_{uuid.uuid4().hex[:8]}"
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        made.append(name)
        conn.execute(operations.grants(name, kind))  # type: ignore[arg-type]
        return name, make_conninfo(dsn, user=name)

    try:
        yield make
    finally:
        for name in made:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@contextmanager
def connected(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


def refused(c: psycopg.Connection[Any], statement: str, params: Any = None) -> None:
    with pytest.raises(errors.InsufficientPrivilege):
        c.execute(statement, params)


def test_producer_enqueues_but_reads_no_payload(
    conn: psycopg.Connection[Any], dsn: str, roles: Callable[[str], tuple[str, str]]
) -> None:
    _, producer_dsn = roles("producer")
    channel = OutboxTable().channel
    store.listen(conn)  # enqueue's NOTIFY must arrive
    # A message written by someone else, with a payload that is none of the producer's business.
    secret_id = enqueue(conn, aggregate_type="user", aggregate_id="7", event_type="user.created",
                        payload={"ssn": "078-05-1120"}, operation_key="user-7")  # fmt: skip
    list(conn.notifies(timeout=1, stop_after=1))
    with connected(producer_dsn) as c:
        with c.transaction():
            first = enqueue(c, aggregate_type="order", aggregate_id=1, event_type="order.created",
                            payload={"total": 10}, operation_key="order-1-created",
                            headers={"traceparent": "00-1-2-01"})  # fmt: skip
        # Delivered at commit: the producer may NOTIFY without any grant.
        assert [n.channel for n in conn.notifies(timeout=5, stop_after=1)] == [channel]
        # The operation-key check: same content, same id; other content, a clear
        # error; both without reading the stored payload.
        again = enqueue(c, aggregate_type="order", aggregate_id=1, event_type="order.created",
                        payload={"total": 10}, operation_key="order-1-created",
                        headers={"traceparent": "00-1-2-01"})  # fmt: skip
        assert again == first
        with pytest.raises(OperationKeyConflict):
            enqueue(c, aggregate_type="order", aggregate_id=1, event_type="order.created",
                    payload={"total": 99}, operation_key="order-1-created")  # fmt: skip
        # A key someone else used is a conflict too, and tells nothing of its content.
        with pytest.raises(OperationKeyConflict):
            enqueue(c, aggregate_type="user", aggregate_id="7", event_type="user.created",
                    payload={"ssn": "guess"}, operation_key="user-7")  # fmt: skip
        # An ordered message takes its aggregate's advisory lock.
        with c.transaction():
            enqueue(c, aggregate_type="order", aggregate_id=1, event_type="order.paid",
                    payload={}, ordered=True, delay=timedelta(seconds=5))  # fmt: skip
            locks = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            ).fetchone()
            assert locks == (1,)
        # What it may read: ids, keys and digests.
        assert c.execute("SELECT count(*) FROM outbox WHERE operation_key IS NOT NULL").fetchone()
        for statement in (
            "SELECT payload FROM outbox",
            "SELECT headers FROM outbox",
            "SELECT * FROM outbox",
            "SELECT id FROM outbox WHERE payload ->> 'ssn' LIKE '0%%'",  # no oracle either
            "SELECT status, last_error FROM outbox",
            "UPDATE outbox SET status = 'done'",
            "UPDATE outbox SET payload = '{}'",
            "DELETE FROM outbox",
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status)"
            " VALUES ('a', 'b', 'c', '{}', 'done')",
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, lease_version)"
            " VALUES ('a', 'b', 'c', '{}', 99)",
            "SELECT * FROM outbox_migrations",
        ):
            refused(c, statement)
        # It cannot act as the relay.
        with pytest.raises(errors.InsufficientPrivilege):
            store.claim(c, owner="producer", batch=10, lease=LEASE)
        with pytest.raises(errors.InsufficientPrivilege):
            store.rescue(c, max_attempts=3)
    assert store.get_row(conn, secret_id)["status"] == "pending"  # type: ignore[index]


def test_the_digest_is_the_same_in_the_insert_and_the_migration(
    conn: psycopg.Connection[Any],
) -> None:
    """The content digest is computed in three places (insert, insert_conflict,
    migration 0004's backfill); they must agree, or keys written before the
    migration would conflict with themselves."""
    for payload, headers in (({"a": [1, "é", None]}, {"traceparent": "x"}), ([], {})):
        enqueue(conn, aggregate_type="t", aggregate_id="ä", event_type="e", payload=payload,
                headers=headers, operation_key=f"k-{len(payload)}")  # fmt: skip
    # Migration 0004 wrote the first digest; 0006 recomputed it without the
    # trace headers (a retry under another trace is the same operation). An
    # upgrade runs both backfills in turn; the result is what insert writes.
    backfills = [
        m.sql[m.sql.index("UPDATE") :]
        for m in migrations_for(OutboxTable())
        if m.name in ("content_hash", "untraced_digest")
    ]
    assert len(backfills) == 2
    before = conn.execute("SELECT id, content_hash FROM outbox ORDER BY id").fetchall()
    assert all(h is not None for _, h in before)
    for backfill in backfills:
        conn.execute(backfill)
    assert conn.execute("SELECT id, content_hash FROM outbox ORDER BY id").fetchall() == before
    # Rows without a key carry no digest: nothing ever compares them.
    enqueue(conn, aggregate_type="t", aggregate_id="1", event_type="e", payload={})
    assert conn.execute("SELECT count(*) FROM outbox WHERE content_hash IS NULL").fetchone() == (1,)


def test_a_keyed_row_without_digest_is_compared_in_full(conn: psycopg.Connection[Any]) -> None:
    """A row written by a producer of an older version (rolling upgrade) has no
    digest; a role that may read payloads still gets the right answer."""
    first = enqueue(conn, aggregate_type="o", aggregate_id="1", event_type="e",
                    payload={"x": 1}, operation_key="legacy")  # fmt: skip
    conn.execute("UPDATE outbox SET content_hash = NULL")
    assert enqueue(conn, aggregate_type="o", aggregate_id="1", event_type="e",
                   payload={"x": 1}, operation_key="legacy") == first  # fmt: skip
    with pytest.raises(OperationKeyConflict):
        enqueue(conn, aggregate_type="o", aggregate_id="1", event_type="e",
                payload={"x": 2}, operation_key="legacy")  # fmt: skip


def test_relay_runs_its_services_and_changes_only_dispatch_columns(
    conn: psycopg.Connection[Any], roles: Callable[[str], tuple[str, str]]
) -> None:
    t0 = db_now(conn) - timedelta(days=10)
    ok, retry, dead, expired, old_done = add(conn, at=t0, n=5)
    _, relay_dsn = roles("relay")
    with connected(relay_dsn) as c:
        table = OutboxTable()
        # The worker's start-up checks and its LISTEN connection.
        assert store.table_exists(c, table=table)
        assert store.missing_migrations(c, table=table) == []
        store.listen(c, table=table)
        # An old delivery, done ten days ago: for the purge below.
        held = claim_all(c, t0)
        assert store.mark_done(c, held[old_done], now=t0)
        # One whose worker died: its lease (from ten days ago) has expired.
        for i in (ok, retry, dead):
            store.reschedule(c, held[i], delay=timedelta(0), error=None, refund_attempt=True,
                             now=t0)  # fmt: skip
        assert held[expired].lease_version >= 1
        freed = Rescuer(DirectDatabase(c), table=table, max_attempts=5).run_once()
        assert freed.released == [expired]

        # The Celery path: claim (fan-out), then begin, publish, finalize.
        claimed = Claimer(DirectDatabase(c), table=table, owner=lambda: "w1", batch_size=10,
                          max_in_flight=100, lease=LEASE, max_attempts=5).run_once()  # fmt: skip
        assert sorted(m.id for m in claimed.claimed) == sorted([ok, retry, dead, expired])
        assert store.in_flight(c, table=table) == 4

        def publish(message: Message) -> None:
            if message.id == retry:
                raise RetryableError("503")
            if message.id == dead:
                raise PermanentError("400")

        deliverer = Deliverer(publish, db=DirectDatabase(c), table=table, count_attempt=True)
        report = deliverer.deliver([m.ref for m in claimed.claimed])
        deliverer.close()
        assert report.lost == 0
        purged = Purger(DirectDatabase(c), table=table, older_than=timedelta(days=7)).run_once()
        assert purged.deleted == 1
        # A long publish's lease renewal.
        again = store.claim(c, owner="w2", batch=10, lease=LEASE, now=db_now(conn) + LEASE * 10)
        assert [m.id for m in again] == [retry]
        assert store.extend_lease(c, again[0], lease=LEASE, now=db_now(conn) + LEASE * 10)

        # What a message says is not the relay's to change, and it writes none.
        for column, value in (
            ("payload", "'{}'"),
            ("headers", "'{}'"),
            ("event_type", "'x'"),
            ("aggregate_id", "'x'"),
            ("operation_key", "'x'"),
            ("content_hash", "NULL"),
            ("created_at", "now()"),
        ):
            refused(c, f"UPDATE outbox SET {column} = {value} WHERE id = {ok}")
        with pytest.raises(errors.InsufficientPrivilege):
            enqueue(c, aggregate_type="a", aggregate_id="b", event_type="c", payload={})
        refused(c, "DELETE FROM outbox_migrations")
        refused(c, "CREATE TABLE outbox_evil (id int)")
    states = {i: store.get_row(conn, i)["status"] for i in (ok, dead, expired)}  # type: ignore[index]
    assert states == {ok: "done", dead: "dead", expired: "done"}


def operator_cli(dsn: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--dsn", dsn, *args], env={"OUTBOX_DSN": None})


def test_operator_does_dead_letter_work_without_reading_or_writing_messages(
    conn: psycopg.Connection[Any], roles: Callable[[str], tuple[str, str]]
) -> None:
    t0 = db_now(conn) - timedelta(days=10)
    ids = add(conn, at=t0, n=4)
    make_dead(conn, ids[:3], t0, "HTTP 400")
    done = claim_all(conn, t0)
    assert store.mark_done(conn, done[ids[3]], now=t0)
    role, operator_dsn = roles("operator")

    def run(*args: str) -> str:
        result = operator_cli(operator_dsn, *args)
        assert result.exit_code == 0, (result.output, result.exception)
        return result.output

    status = json.loads(run("status", "--json"))
    assert (status["dead"], status["done"]) == (3, 1)
    listed = json.loads(run("dead", "list", "--json"))
    assert [r["id"] for r in listed] == ids[:3]
    run("dead", "retry", str(ids[0]))
    run("dead", "skip", str(ids[1]))
    run("dead", "retry", "--all", "--spread", "1m", "--yes")
    assert "purged 1 done message(s)" in run("purge", "--older-than", "7d")
    gauges = OutboxCollector(operator_dsn).read()  # the metrics exporter
    assert (gauges.pending, gauges.dead) == (2, 0)

    with connected(operator_dsn) as c:
        for statement in (
            "SELECT payload FROM outbox",
            "SELECT headers FROM outbox",
            "UPDATE outbox SET lease_version = lease_version + 1",
            "UPDATE outbox SET lease_until = now()",
            "UPDATE outbox SET payload = '{}'",
            "CREATE TABLE outbox_evil (id int)",
        ):
            refused(c, statement)
        with pytest.raises(errors.InsufficientPrivilege):
            enqueue(c, aggregate_type="a", aggregate_id="b", event_type="c", payload={})
        with pytest.raises(errors.InsufficientPrivilege):
            store.claim(c, owner="operator", batch=10, lease=LEASE)
    assert role


def test_grant_kinds_are_checked() -> None:
    with pytest.raises(ValueError, match="producer, relay, operator"):
        operations.grants("x", "admin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        operations.grants("", "operator")
    text = operations.grants('we"ird', "operator", table="app.events")
    assert 'TO "we""ird";' in text and '"app"."events"' in text
    statements = "\n".join(line for line in text.splitlines() if not line.startswith("--"))
    assert "INSERT" not in statements and "payload" not in statements


# ================================================================ webhooks
class Recorder:
    """A loopback HTTP/1.1 server that records each request's path and headers."""

    def __init__(self, tls: ssl.SSLContext | None = None, status: int = 204) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                recorder.requests.append(
                    (self.path, {k.lower(): v for k, v in self.headers.items()})
                )
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, scheme: str = "http", userinfo: str = "", rest: str = "/hook") -> str:
        return f"{scheme}://{userinfo}127.0.0.1:{self.port}{rest}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    server = Recorder()
    yield server
    server.close()


SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
FAST: dict[str, Any] = {"connect_timeout": 1.0, "write_timeout": 1.0, "read_timeout": 2.0}


def message(headers: dict[str, Any] | None = None, id: int = 1) -> Message:
    return Message(id=id, idempotency_key=f"outbox-{id}", aggregate_type="order",
                   aggregate_id="1", event_type="order.paid", payload={"a": 1},
                   headers=headers or {}, attempts=1, lease_version=1, created_at=None)  # fmt: skip


def warnings_of(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING
    ]


WEBHOOK_LOG = "outbox_relay.publishers.webhook"


def _certificate(folder: Path, name: str, san: str) -> tuple[Path, Path]:
    key, cert = folder / f"{name}.key", folder / f"{name}.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


def _server_context(key: Path, cert: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@needs_openssl
def test_tls_verification_is_on_and_turning_it_off_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WEBHOOK_LOG)
    tls = Recorder(tls=_server_context(*_certificate(tmp_path, "loopback", "IP:127.0.0.1")))
    try:
        verified = WebhookPublisher(tls.url("https"), secret=SECRET, **FAST)
        with pytest.raises(RetryableError, match="CERTIFICATE_VERIFY_FAILED"):
            verified(message())
        assert warnings_of(caplog, WEBHOOK_LOG) == []  # verified, and not loopback-exempt: silent

        # Off through the documented option (text, as from the environment): one
        # warning when the publisher is built, none per request.
        insecure = resolve_publisher(tls.url("https"), webhook_verify="false",
                                     publish_timeout_seconds=4.0)  # fmt: skip
        insecure(message(id=1))
        insecure(message(id=2))
        assert len(tls.requests) == 2
        (warning,) = warnings_of(caplog, WEBHOOK_LOG)
        assert "TLS certificate verification is off" in warning
        # An SSLContext that checks nothing counts as off too.
        caplog.clear()
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        WebhookPublisher(tls.url("https"), verify=context, **FAST)
        assert len(warnings_of(caplog, WEBHOOK_LOG)) == 1
    finally:
        tls.close()


def test_credentials_over_plain_http_warn_unless_loopback(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=WEBHOOK_LOG)
    # Loopback: tests and local development stay silent, and really deliver.
    loopback = (
        recorder.url(userinfo="u:pw@", rest="/hook?token=t"),
        f"http://localhost:{recorder.port}/hook",
        f"http://[::1]:{recorder.port}/",
    )
    for url in loopback:
        publisher = WebhookPublisher(url, secret=SECRET, headers={"Authorization": "Bearer x"})
        if "127.0.0.1" in url:
            publisher(message())
    assert len(recorder.requests) == 1
    assert warnings_of(caplog, WEBHOOK_LOG) == []
    # Nothing secret configured: nothing to warn about.
    WebhookPublisher("http://hooks.example.com/in", headers={"X-Tenant": "a"})
    WebhookPublisher("https://hooks.example.com/in", secret=SECRET,
                     headers={"Authorization": "Bearer x"})  # fmt: skip
    assert warnings_of(caplog, WEBHOOK_LOG) == []
    for kwargs, said in (
        ({"secret": SECRET}, "signed requests"),
        ({"headers": {"Authorization": "Bearer x"}}, "Authorization"),
        ({"headers": {"X-Api-Key": "k"}}, "X-Api-Key"),
    ):
        caplog.clear()
        WebhookPublisher("http://hooks.example.com/in", **kwargs)
        (warning,) = warnings_of(caplog, WEBHOOK_LOG)
        assert "plain http://" in warning and said in warning
    caplog.clear()
    WebhookPublisher("http://relay:pw1@10.0.0.8/in?token=tok1")
    (warning,) = warnings_of(caplog, WEBHOOK_LOG)
    assert "password in the URL" in warning and "query string" in warning
    assert "pw1" not in warning and "tok1" not in warning


def test_no_password_or_token_reaches_any_log(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx logs every request's URL at INFO, httpcore the connection at DEBUG."""
    for name in ("httpx", "httpcore", WEBHOOK_LOG):
        caplog.set_level(logging.DEBUG, logger=name)
    password, token = "s3cr3t-pw", "t0k3n-xyz"
    url = recorder.url(userinfo=f"relay:{password}@", rest=f"/hook?token={token}&v=2")
    publisher = WebhookPublisher(url, **FAST)
    publisher(message())
    # The receiver got both: the password as HTTP basic auth, the token in the URL.
    path, headers = recorder.requests[0]
    assert path == f"/hook?token={token}&v=2"
    basic = base64.b64encode(f"relay:{password}".encode()).decode()
    assert headers["authorization"] == f"Basic {basic}"
    # The logs got neither, though httpx did log the request.
    assert f'HTTP Request: POST http://127.0.0.1:{recorder.port}/hook "' in caplog.text
    assert "connect_tcp" in caplog.text  # httpcore's DEBUG trace ran too
    for leaked in (password, token, basic):
        assert leaked not in caplog.text
    assert password not in repr(publisher) and token not in repr(publisher)
    # A failure's last_error neither (nothing listens on port 1).
    refused_url = f"http://relay:{password}@127.0.0.1:1/hook?token={token}"
    with pytest.raises(RetryableError) as failed:
        WebhookPublisher(refused_url, **FAST)(message(id=2))
    assert "ConnectError" in str(failed.value)
    for leaked in (password, token, basic):
        assert leaked not in str(failed.value) and leaked not in caplog.text
    # The application's own httpx requests are not rewritten, not even those
    # to the same receiver without the token.
    other = Recorder()
    try:
        with httpx.Client() as client:
            client.post(other.url(rest="/own?page=3"))
            client.post(recorder.url(rest="/hook/other"))
        assert f"127.0.0.1:{other.port}/own?page=3" in caplog.text
        assert f"127.0.0.1:{recorder.port}/hook/other" in caplog.text
    finally:
        other.close()


PRODUCER_HEADERS = {
    "Authorization": "Bearer stolen",
    "Cookie": "session=abc",
    "Proxy-Authorization": "Basic eA==",
    "Host": "evil.example",
    "X-Foo": "bar",
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "tracestate": "vendor=1",
    "Outbox-Message-Id": "999",
    "webhook-signature": "v1,forged",
}


def _deliver(conn: psycopg.Connection[Any], publisher: Any) -> None:
    from outbox_relay import dispatch_once

    assert dispatch_once(conn, publisher, owner="sec", batch=10, lease=LEASE,
                         publish_timeout=5.0) == 1  # fmt: skip


def test_producer_headers_pass_only_through_the_allowlist(
    conn: psycopg.Connection[Any], recorder: Recorder
) -> None:
    """A producer is application code: what it writes into a row's headers must
    not become credentials or metadata of the relay's request."""
    message_id = enqueue(conn, aggregate_type="order", aggregate_id="1", event_type="order.paid",
                         payload={"a": 1}, headers=PRODUCER_HEADERS)  # fmt: skip
    _deliver(conn, resolve_publisher(recorder.url(), publish_timeout_seconds=4.0))
    (_, got), = [r for r in recorder.requests]  # fmt: skip
    # The default allowlist: trace context only.
    assert got["traceparent"] == PRODUCER_HEADERS["traceparent"]
    assert got["tracestate"] == "vendor=1"
    for absent in ("authorization", "cookie", "proxy-authorization", "x-foo", "webhook-signature"):
        assert absent not in got, absent
    assert got["host"] == f"127.0.0.1:{recorder.port}"
    assert got["outbox-message-id"] == str(message_id)

    # An operator's list, from the environment as a relay reads it; the relay's
    # own credentials (webhook_headers) win over nothing a producer wrote.
    from outbox_relay.config import Settings

    settings = Settings.load(environ={
        "OUTBOX_PUBLISHER": recorder.url(),
        "OUTBOX_WEBHOOK_FORWARD_HEADERS": "X-Foo, traceparent",
        "OUTBOX_WEBHOOK_HEADERS": '{"Authorization": "Bearer relay-own"}',
    })  # fmt: skip
    publisher = resolve_publisher(settings.publisher, publish_timeout_seconds=4.0,
                                  **dict(settings.publisher_options))  # fmt: skip
    enqueue(conn, aggregate_type="order", aggregate_id="2", event_type="order.paid",
            payload={"a": 2}, headers=PRODUCER_HEADERS)  # fmt: skip
    _deliver(conn, publisher)
    got = recorder.requests[1][1]
    assert got["x-foo"] == "bar" and "traceparent" in got and "tracestate" not in got
    assert got["authorization"] == "Bearer relay-own"
    assert "cookie" not in got

    # An empty list forwards nothing.
    enqueue(conn, aggregate_type="order", aggregate_id="3", event_type="order.paid",
            payload={"a": 3}, headers=PRODUCER_HEADERS)  # fmt: skip
    _deliver(conn, WebhookPublisher(recorder.url(), forward_headers="", **FAST))
    assert "traceparent" not in recorder.requests[2][1]


@pytest.mark.parametrize(
    "listed",
    ["Authorization", "cookie", "Proxy-Authorization", "Host", "Content-Length",
     "Transfer-Encoding", "webhook-signature", "Idempotency-Key", "Outbox-Attempt"],
)  # fmt: skip
def test_security_headers_can_never_be_forwarded(listed: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_WEBHOOK_FORWARD_HEADERS") as refused:
        resolve_publisher("https://hooks.example.com/in",
                          webhook_forward_headers=f"traceparent,{listed}")  # fmt: skip
    assert listed in str(refused.value)


def test_forward_headers_option_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"OUTBOX_WEBHOOK_FORWARD_HEADERS.*invalid header"):
        WebhookPublisher("https://hooks.example.com/in", forward_headers="bad name")
    with pytest.raises(ConfigError, match="OUTBOX_WEBHOOK_FORWARD_HEADERS"):
        WebhookPublisher("https://hooks.example.com/in", forward_headers=42)  # type: ignore[arg-type]
    # A misspelling is refused like every webhook option, never silently ignored.
    with pytest.raises(ConfigError, match="did you mean OUTBOX_WEBHOOK_FORWARD_HEADERS"):
        resolve_publisher("https://hooks.example.com/in", webhook_forward_header="X-Foo")


# ================================================================ brokers
class TlsListener:
    """Accepts TLS connections on loopback with a given certificate, then hangs
    up: enough for a client's handshake to succeed or fail for real."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handshakes = 0
        self.context = context
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            try:
                raw.settimeout(5)
                with self.context.wrap_socket(raw, server_side=True):
                    self.handshakes += 1
            except (OSError, ssl.SSLError):
                pass  # the client refused our certificate
            finally:
                raw.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def certificates(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    return {
        "loopback": _certificate(tmp_path, "loopback", "IP:127.0.0.1"),
        "elsewhere": _certificate(tmp_path, "elsewhere", "DNS:broker.example.com"),
    }


BROKER_FAST: dict[str, Any] = {"connect_timeout": 2.0, "confirm_timeout": 2.0}


@pytest.mark.parametrize("scheme", ["amqps", "rediss"])
def test_broker_tls_verifies_certificate_and_host_name(
    scheme: str, certificates: dict[str, tuple[Path, Path]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    ca_option = "ca_certs" if scheme == "amqps" else "ssl_ca_certs"
    for name in ("loopback", "elsewhere"):
        listener = TlsListener(_server_context(*certificates[name]))
        path = "//" if scheme == "amqps" else "/0"
        url = f"{scheme}://guest:guest@127.0.0.1:{listener.port}{path}"
        try:
            # Defaults: a certificate nobody vouches for is refused (kombu's own
            # default for rediss:// accepts any certificate).
            with pytest.raises(RetryableError, match="CERTIFICATE_VERIFY_FAILED"):
                BrokerPublisher(url, **BROKER_FAST)(message())
            trusted = BrokerPublisher(url, ssl={ca_option: str(certificates[name][1])},
                                      **BROKER_FAST)  # fmt: skip
            with pytest.raises(RetryableError) as failed:
                trusted(message())
            if name == "loopback":
                # Trusted and issued to 127.0.0.1: the handshake succeeds (then the
                # listener, no broker, hangs up).
                assert "CERTIFICATE_VERIFY_FAILED" not in str(failed.value)
                assert listener.handshakes >= 1
            else:
                # Trusted, but issued to another host: the host name is checked.
                assert "CERTIFICATE_VERIFY_FAILED" in str(failed.value)
                assert "mismatch" in str(failed.value)
        finally:
            listener.close()
    assert warnings_of(caplog, "outbox_relay.publishers.broker") == []
    assert not [r for r in caplog.records if "insecure SSL" in r.getMessage()]


def test_broker_tls_off_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outbox_relay.publishers.broker")
    BrokerPublisher("amqps://guest:guest@127.0.0.1:1//", ssl={"cert_reqs": ssl.CERT_NONE})
    resolve_publisher("rediss://127.0.0.1:1/0?ssl_cert_reqs=none")
    resolve_publisher("rediss://127.0.0.1:1/0", kombu_ssl='{"ssl_cert_reqs": "none"}')
    warned = warnings_of(caplog, "outbox_relay.publishers.broker")
    assert len(warned) == 3 and all("verification is off" in w for w in warned)
    caplog.clear()
    BrokerPublisher("amqp://guest:guest@127.0.0.1:1//")
    BrokerPublisher("rediss://127.0.0.1:1/0")
    assert warnings_of(caplog, "outbox_relay.publishers.broker") == []
