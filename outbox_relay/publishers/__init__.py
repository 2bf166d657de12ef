"""Publishers: where a message goes once the relay holds its lease.

A publisher is any callable ``publish(message) -> None`` that raises
``RetryableError``, ``PermanentError`` or ``Defer`` on failure.
``resolve_publisher`` turns configuration (``OUTBOX_PUBLISHER``) into one:
a webhook URL, a broker URL, ``celery:task.name``, ``module:callable`` or a
routing table of those. See docs/publishers.md.

``protocol.py`` says what a publisher is; the concrete publishers import only
that, and ``resolve.py`` imports them to dispatch on a setting's scheme.
"""

from __future__ import annotations

from .broker import BrokerPublisher
from .celery_task import CeleryTaskPublisher
from .protocol import Publisher, load_callable, publisher_timeout
from .resolve import resolve_publisher, router_from_config
from .routing import Router
from .webhook import WebhookPublisher, parse_retry_after

__all__ = [
    "BrokerPublisher",
    "CeleryTaskPublisher",
    "Publisher",
    "Router",
    "WebhookPublisher",
    "load_callable",
    "parse_retry_after",
    "publisher_timeout",
    "resolve_publisher",
    "router_from_config",
]
