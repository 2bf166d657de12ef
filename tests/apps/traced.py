"""The standalone relay app with OpenTelemetry's SDK: spans go to a file.

``celery -A tests.apps.traced worker``: every span a worker process ends is
appended to ``TRACE_FILE`` as one JSON line (trace id, span id, parent,
name, attributes), for the test to read. A simple (synchronous) processor
and a file opened per export are safe in prefork children.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from outbox_relay.app import app


class FileExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a", encoding="utf-8") as out:
            for span in spans:
                ctx = span.get_span_context()
                assert ctx is not None
                record = {
                    "name": span.name,
                    "trace_id": f"{ctx.trace_id:032x}",
                    "span_id": f"{ctx.span_id:016x}",
                    "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
                    "attributes": dict(span.attributes or {}),
                    "status": span.status.status_code.name,
                }
                out.write(json.dumps(record) + "\n")
        return SpanExportResult.SUCCESS


_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(FileExporter(os.environ["TRACE_FILE"])))
trace.set_tracer_provider(_provider)

__all__ = ["app"]
