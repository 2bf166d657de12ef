"""Publishers: where a message goes once the relay holds its lease.

A publisher is any callable ``publish(message) -> None`` that raises
``RetryableError``, ``PermanentError`` or ``Defer`` on failure.
``resolve_publisher`` turns configuration (``OUTBOX_PUBLISHER``) into one.
"""

from __future__ import annotations

from .base import Publisher, resolve_publisher
from .routing import Router

__all__ = ["Publisher", "Router", "resolve_publisher"]
