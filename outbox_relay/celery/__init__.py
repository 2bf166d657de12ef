"""The relay inside Celery: tasks, beat entry, worker bootstep, signals."""

from __future__ import annotations

from .install import install
from .runtime import RelayRuntime

__all__ = ["RelayRuntime", "install"]
