"""OpenTelemetry for the tests: an SDK provider of their own, spans kept in memory.

Never the global provider: other tests in the same process (xdist) expect
the relay's default, which without a configured SDK forwards a row's trace
headers unchanged. Producers need no provider (enqueue reads the current
span from the context); the relay is given ``publish_tracer()``.
"""

from __future__ import annotations

import threading

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from outbox_relay.tracing import PublishTracer

_lock = threading.Lock()
_exporter: InMemorySpanExporter | None = None
_provider: TracerProvider | None = None


def exporter() -> InMemorySpanExporter:
    """The process's in-memory exporter (installing the provider on first use)."""
    global _exporter, _provider
    with _lock:
        if _exporter is None:
            _provider = TracerProvider()
            _exporter = InMemorySpanExporter()
            _provider.add_span_processor(SimpleSpanProcessor(_exporter))
        return _exporter


def tracer() -> trace.Tracer:
    exporter()
    assert _provider is not None
    return _provider.get_tracer("outbox-relay-tests")


def publish_tracer() -> PublishTracer:
    """The relay's tracer on this provider (``dispatch_once(..., tracer=...)``)."""
    return PublishTracer(tracer())


def hex_ids(span: ReadableSpan) -> tuple[str, str, str | None]:
    """(trace id, span id, parent span id) as in a W3C traceparent."""
    ctx = span.get_span_context()
    assert ctx is not None
    parent = f"{span.parent.span_id:016x}" if span.parent is not None else None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", parent
