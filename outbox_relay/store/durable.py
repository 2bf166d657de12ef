"""What a durable Celery task's run needs beyond the relay's hot path."""

from __future__ import annotations

from typing import Any

import psycopg

from ._base import tableless

__all__ = ["bound_session"]


def bound_session(conn: psycopg.Connection[Any], seconds: float) -> None:
    """Bound this session's statements and idle transactions by ``seconds``."""
    value = f"{max(1, int(seconds * 1000))}ms"
    conn.execute(tableless().bound_durable_session, {"value": value})
