"""OpenTelemetry trace context across the outbox, when the ``otel`` extra is installed.

* ``enqueue`` records the current trace context (W3C ``traceparent`` and
  ``tracestate``, plus ``baggage`` when that propagator is configured) in the
  row's ``headers``, unless the caller set one of them itself.
* The relay opens one span per publish, a child of the context stored on the
  row (attributes: row id, attempt, event type, outcome), and hands the
  publisher a message whose trace headers name that span. Webhooks forward
  ``traceparent`` (publishers/webhook.py), broker messages carry it as a
  message header, and Celery tasks get it as a top-level task header, where
  Celery's OpenTelemetry instrumentation looks for it.

Without ``opentelemetry-api`` nothing here imports it, and both hooks are
no-ops: ``current_headers()`` returns ``{}`` and ``default_tracer()`` ``None``.
With the API but no SDK, spans are non-recording and the row's own context is
forwarded unchanged; a row without headers gets no span at all while no
provider is set (it would record nothing and carry nothing, and cost 15 us
a publish here: a tenth of a chunked relay's CPU per delivered message).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from .errors import Defer
from .model import Message

__all__ = [
    "TRACE_HEADERS",
    "PublishSpan",
    "PublishTracer",
    "current_headers",
    "default_tracer",
    "lower_trace_names",
]

# The W3C propagation headers. Also what the operation-key digest leaves out
# (sql/queries.sql insert): the same operation retried under another trace is
# still the same operation.
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")

_lock = threading.Lock()
_loaded = False
_api: tuple[ModuleType, ModuleType, ModuleType] | None = None


def _otel() -> tuple[ModuleType, ModuleType, ModuleType] | None:
    """``(trace, propagate, context)`` from opentelemetry-api, or None when absent.

    Imported on first use, never by ``import outbox_relay``: a producer that
    does not trace pays nothing.
    """
    global _loaded, _api
    if _loaded:
        return _api
    with _lock:
        if not _loaded:
            try:
                from opentelemetry import context, propagate, trace
            except ImportError:
                _api = None
            else:
                _api = (trace, propagate, context)
            _loaded = True
    return _api


def lower_trace_names(headers: Mapping[str, Any]) -> dict[str, Any]:
    """``headers`` with the W3C trace headers under their lower-case names,
    as propagators look them up ("TraceParent" is "traceparent")."""
    return {(k.lower() if k.lower() in TRACE_HEADERS else k): v for k, v in headers.items()}


def _trace_only(carrier: Mapping[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in carrier.items() if k.lower() in TRACE_HEADERS}


def current_headers() -> dict[str, str]:
    """The current span's context as W3C headers; ``{}`` when there is none."""
    api = _otel()
    if api is None:
        return {}
    trace, propagate, _ = api
    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return _trace_only(carrier)


class PublishSpan:
    """One publish's span; ``message`` is what the publisher is given."""

    def __init__(self, owner: PublishTracer, message: Message) -> None:
        trace, propagate, context = owner.api
        # Rows written before the producer lowered the names may hold "Traceparent".
        parent = propagate.extract(lower_trace_names(message.headers or {}))
        self._span = owner.tracer.start_span(
            f"outbox publish {message.event_type}",
            context=parent,
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "outbox.message.id": message.id,
                "outbox.attempt": message.attempts,
                "outbox.lease_version": message.lease_version,
                "outbox.event_type": message.event_type,
                "outbox.aggregate_type": message.aggregate_type,
                "messaging.message.id": message.idempotency_key,
            },
        )
        # Current in this thread while the publisher runs, so an instrumented
        # HTTP or AMQP client nests its own span under this one.
        self._token = context.attach(trace.set_span_in_context(self._span, parent))
        self._context = context
        self._trace = trace
        self.message = message
        if self._span.get_span_context().is_valid:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            untraced = {
                k: v for k, v in (message.headers or {}).items() if k.lower() not in TRACE_HEADERS
            }
            self.message = dataclasses.replace(message, headers={**untraced, **carrier})

    def end(self, outcome: str, error: BaseException | None = None) -> None:
        """``outcome`` is the row's next status (done, pending, dead)."""
        self._span.set_attribute("outbox.outcome", outcome)
        if error is not None:
            self._span.record_exception(error)
            if not isinstance(error, Defer):  # a deferral is not a failure
                self._span.set_status(self._trace.Status(self._trace.StatusCode.ERROR,
                                                         type(error).__name__))  # fmt: skip
        self._context.detach(self._token)
        self._span.end()


class PublishTracer:
    """The relay's tracer (``Deliverer(tracer=...)``); ``tracer`` defaults to the global one."""

    def __init__(self, tracer: Any = None) -> None:
        api = _otel()
        if api is None:
            raise RuntimeError(
                "PublishTracer needs opentelemetry-api (pip install outbox-relay[otel])"
            )
        self.api = api
        # The global provider's tracer follows whatever provider is set later.
        self._global = tracer is None
        self.tracer = tracer if tracer is not None else api[0].get_tracer("outbox_relay")

    def start(self, message: Message) -> PublishSpan | None:
        """This publish's span; None when it could neither record nor carry a
        trace: no provider set yet on the global tracer (no SDK), and no
        headers on the row (so no trace context to forward)."""
        if self._global and not message.headers:
            trace = self.api[0]
            if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
                return None
        return PublishSpan(self, message)


def default_tracer() -> PublishTracer | None:
    """A tracer on the global provider when opentelemetry-api is installed, else None."""
    return PublishTracer() if _otel() is not None else None
