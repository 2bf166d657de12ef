"""OpenTelemetry: enqueue records the trace, the relay continues it, and
without the ``otel`` extra nothing changes and nothing is imported.

The relay runs in this process here (``dispatch_once``, the same Deliverer
step the Celery tasks run), so its spans land in the in-memory exporter;
tests/test_examples.py follows one trace through a real worker process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry.trace import StatusCode

import outbox_relay
from outbox_relay import Message, OperationKeyConflict, RetryableError

from .otel import exporter, hex_ids, publish_tracer, tracer
from .test_producer import order_created as order

ROOT = Path(__file__).resolve().parent.parent
LEASE = timedelta(seconds=30)


@pytest.fixture(autouse=True)
def no_earlier_spans() -> None:
    # Row ids restart in every test's database; spans of earlier tests would match.
    exporter().clear()


def headers_of(conn: psycopg.Connection[Any], message_id: int) -> dict[str, Any]:
    row = conn.execute("SELECT headers FROM outbox WHERE id = %s", (message_id,)).fetchone()
    assert row is not None
    return dict(row[0])


def deliver(conn: psycopg.Connection[Any], publisher: Any) -> int:
    return outbox_relay.dispatch_once(
        conn, publisher, owner="test", lease=LEASE, tracer=publish_tracer()
    )


def publish_spans(message_id: int) -> list[Any]:
    return [
        s
        for s in exporter().get_finished_spans()
        if s.name.startswith("outbox publish")
        and (s.attributes or {}).get("outbox.message.id") == message_id
    ]


def test_enqueue_records_the_current_trace_and_the_relay_continues_it(
    conn: psycopg.Connection[Any],
) -> None:
    with tracer().start_as_current_span("place order") as producer:
        message_id = order(conn)
    trace_id, producer_id, _ = hex_ids(producer)  # type: ignore[arg-type]
    stored = headers_of(conn, message_id)
    assert stored["traceparent"].split("-")[1:3] == [trace_id, producer_id]

    seen: list[Message] = []
    assert deliver(conn, seen.append) == 1
    [span] = publish_spans(message_id)
    assert hex_ids(span)[0] == trace_id and hex_ids(span)[2] == producer_id
    assert span.attributes is not None
    assert span.attributes["outbox.outcome"] == "done"
    assert span.attributes["outbox.attempt"] == 1
    # The publisher was handed the publish span's context, not the producer's.
    [message] = seen
    assert message.headers["traceparent"].split("-")[1:3] == [trace_id, hex_ids(span)[1]]
    # The row itself keeps what the producer recorded.
    assert headers_of(conn, message_id) == stored


def test_a_failed_publish_is_an_error_span_with_the_rows_next_status(
    conn: psycopg.Connection[Any],
) -> None:
    message_id = order(conn)  # no current span: the publish span starts a trace

    def down(message: Message) -> None:
        raise RetryableError("receiver down")

    deliver(conn, down)
    [span] = publish_spans(message_id)
    assert span.parent is None
    assert span.attributes is not None and span.attributes["outbox.outcome"] == "pending"
    assert span.status.status_code == StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]


def test_the_same_operation_under_another_trace_is_the_same_message(
    conn: psycopg.Connection[Any],
) -> None:
    with tracer().start_as_current_span("first request"):
        first = order(conn, operation_key="order-1-created")
    with tracer().start_as_current_span("retried request"):
        again = order(conn, operation_key="order-1-created")
        with pytest.raises(OperationKeyConflict):
            order(conn, operation_key="order-1-created", payload={"id": 2})
    assert again == first


def test_a_traceparent_given_by_the_caller_wins(conn: psycopg.Connection[Any]) -> None:
    given = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    with tracer().start_as_current_span("ignored"):
        message_id = order(conn, headers={"traceparent": given})
    assert headers_of(conn, message_id) == {"traceparent": given}
    # Other headers of the caller's are kept beside the recorded trace.
    with tracer().start_as_current_span("recorded") as span:
        other = order(conn, headers={"baggage": "tenant=7", "x-tenant": "7"})
    stored = headers_of(conn, other)
    assert stored["baggage"] == "tenant=7" and stored["x-tenant"] == "7"
    assert stored["traceparent"].split("-")[2] == hex_ids(span)[1]  # type: ignore[arg-type]


def test_a_trace_header_written_in_another_case_is_the_same_header(
    conn: psycopg.Connection[Any],
) -> None:
    """ "TraceParent" was stored as written: the relay's propagator, which
    reads names as written, missed it (the publish span started a trace of
    its own and the caller's trace was lost), and the operation-key check
    compared it as content (the same operation under another trace was a
    conflict)."""
    first_trace = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    message_id = order(conn, operation_key="op-case", headers={"TraceParent": first_trace})
    assert headers_of(conn, message_id) == {"traceparent": first_trace}
    other_trace = "00-" + "3" * 32 + "-" + "4" * 16 + "-01"
    again = order(conn, operation_key="op-case", headers={"Traceparent": other_trace})
    assert again == message_id
    # A row stored before names were normalised: the relay reads it too.
    conn.execute(
        "UPDATE outbox SET headers = jsonb_build_object('Traceparent', %s::text) WHERE id = %s",
        (first_trace, message_id),
    )
    deliver(conn, lambda message: None)
    [span] = publish_spans(message_id)
    assert span.parent is not None and span.context.trace_id == int("1" * 32, 16)


# The same scenario in a fresh interpreter in which opentelemetry cannot be
# imported (as if the extra were not installed): the row gets only the
# caller's headers, the publisher gets them unchanged, and no opentelemetry
# module was loaded.
WITHOUT_OTEL = """
import json, sys
sys.modules["opentelemetry"] = None          # import opentelemetry -> ImportError
import psycopg, outbox_relay
from outbox_relay import tracing
from datetime import timedelta
with psycopg.connect(sys.argv[1], autocommit=True) as conn:
    mid = outbox_relay.enqueue(conn, aggregate_type="o", aggregate_id="1", event_type="e",
                               payload={}, headers={"tracestate": "k=v"})
    seen = []
    outbox_relay.dispatch_once(conn, seen.append, owner="t", lease=timedelta(seconds=30))
    stored = conn.execute("SELECT headers FROM outbox WHERE id = %s", (mid,)).fetchone()[0]
loaded = sorted(m for m, v in sys.modules.items() if m.startswith("opentelemetry") and v)
print(json.dumps({"stored": stored, "published": [m.headers for m in seen],
                  "tracer": repr(tracing.default_tracer()), "loaded": loaded}))
"""


def test_without_opentelemetry_nothing_changes_and_nothing_is_imported(dsn: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL, dsn],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {
        "stored": {"tracestate": "k=v"},
        "published": [{"tracestate": "k=v"}],
        "tracer": "None",
        "loaded": [],
    }


def test_with_the_api_alone_only_a_row_with_headers_gets_a_span() -> None:
    # No SDK provider is set globally in the tests (tests/otel.py): the
    # relay's default tracer then has nothing to record. A row without
    # headers has nothing to forward either, so it gets no span (they cost
    # 15 us a publish); a row with a traceparent still has it forwarded.
    from opentelemetry import trace

    from outbox_relay import tracing

    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    relay_tracer = tracing.default_tracer()
    assert relay_tracer is not None

    def message(headers: dict[str, Any]) -> Message:
        return Message(1, "outbox-1", "order", "1", "order.paid", {}, headers, 1, 1, None)

    assert relay_tracer.start(message({})) is None
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    span = relay_tracer.start(message({"traceparent": parent, "k": "v"}))
    assert span is not None
    try:
        assert span.message.headers == {"traceparent": parent, "k": "v"}
    finally:
        span.end("done")
    # An explicit tracer (an SDK provider of the caller's) always traces.
    explicit = publish_tracer().start(message({}))
    assert explicit is not None
    explicit.end("done")


def test_importing_the_package_does_not_import_opentelemetry() -> None:
    # With the extra installed, still nothing until a producer or relay runs.
    code = (
        "import sys, outbox_relay, outbox_relay.aio, outbox_relay.services;"
        "print(any(m.startswith('opentelemetry') for m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "False", result.stderr


def test_a_celery_task_gets_the_trace_as_a_top_level_header() -> None:
    # Where Celery's OpenTelemetry instrumentation reads it (task.request);
    # the row's headers also stay nested under outbox-headers, as before.
    from celery import Celery

    from outbox_relay.publishers import CeleryTaskPublisher

    parent = "00-" + "3" * 32 + "-" + "4" * 16 + "-01"
    message = Message(
        id=7,
        idempotency_key="outbox-7",
        aggregate_type="order",
        aggregate_id="1",
        event_type="order.created",
        payload={},
        headers={"traceparent": parent, "id": "not-the-task-id"},
        attempts=1,
        lease_version=1,
        created_at=None,
    )
    publisher = CeleryTaskPublisher("shop.on_order", app=Celery("t", broker="memory://"))
    headers = publisher.send_options(message, [], {})["headers"]
    assert headers["traceparent"] == parent
    assert "id" not in headers  # only the trace headers come up to the top
    assert headers["outbox-headers"] == message.headers


def test_a_broker_message_carries_the_publish_spans_traceparent(
    conn: psycopg.Connection[Any],
) -> None:
    from outbox_relay.publishers import resolve_publisher

    from . import services
    from .test_publisher_broker import Bound

    url = services.redis_url()
    names = f"ex-{uuid.uuid4().hex[:8]}", f"q-{uuid.uuid4().hex[:8]}"
    bound = Bound(url, names[0], names[1], "order.*")
    publisher = resolve_publisher(url, publish_timeout_seconds=5.0, kombu_exchange=names[0])
    try:
        with tracer().start_as_current_span("place order") as producer:
            message_id = order(conn)
        assert deliver(conn, publisher) == 1
        [message] = bound.drain()
    finally:
        publisher.close()  # type: ignore[attr-defined]
        bound.close()
    [span] = publish_spans(message_id)
    trace_id, span_id, parent = hex_ids(span)
    assert parent == hex_ids(producer)[1]  # type: ignore[arg-type]
    assert message.headers["traceparent"].split("-")[1:3] == [trace_id, span_id]
