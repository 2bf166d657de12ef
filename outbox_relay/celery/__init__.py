"""The relay inside Celery: tasks, routes, beat entries, worker bootstep, signals.

Glue only: the work is done by ``outbox_relay.services``.
"""

from __future__ import annotations

from .durable import DurableTask, write_durable
from .install import install
from .runtime import Installation

__all__ = ["DurableTask", "Installation", "install", "write_durable"]
