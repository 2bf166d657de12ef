"""OpenTelemetry for the tests: one SDK provider per test process, spans kept in memory.

The global tracer provider can be set once per process; every test that
traces shares this one and reads the spans it finished.
"""

from __future__ import annotations

import threading

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_lock = threading.Lock()
_exporter: InMemorySpanExporter | None = None


def exporter() -> InMemorySpanExporter:
    """The process's in-memory exporter (installing the provider on first use)."""
    global _exporter
    with _lock:
        if _exporter is None:
            provider = TracerProvider()
            _exporter = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(_exporter))
            trace.set_tracer_provider(provider)
        return _exporter


def tracer() -> trace.Tracer:
    exporter()
    return trace.get_tracer("outbox-relay-tests")


def hex_ids(span: ReadableSpan) -> tuple[str, str, str | None]:
    """(trace id, span id, parent span id) as in a W3C traceparent."""
    ctx = span.get_span_context()
    assert ctx is not None
    parent = f"{span.parent.span_id:016x}" if span.parent is not None else None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", parent
