"""Publishers: where a message goes once the relay holds its lease.

A publisher is any callable ``publish(message) -> None`` that raises
``RetryableError``, ``PermanentError`` or ``Defer`` on failure.
``resolve_publisher`` turns configuration (``OUTBOX_PUBLISHER``) into one:
a webhook URL, a broker URL, ``celery:task.name``, ``module:callable`` or a
routing table of those. See docs/publishers.md.
"""

from __future__ import annotations

from .base import Publisher, load_callable, publisher_timeout, resolve_publisher
from .broker import BrokerPublisher
from .celery_task import CeleryTaskPublisher
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
]
