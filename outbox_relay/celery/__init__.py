"""The relay inside Celery: tasks, routes, beat entries, worker bootstep, signals.

Glue only: the work is done by ``outbox_relay.services``.
"""

from __future__ import annotations

from .install import install
from .runtime import Installation

__all__ = ["Installation", "install"]
