"""What a durable Celery task's run needs beyond the relay's hot path."""

from __future__ import annotations

from typing import Any

import psycopg

from ._base import queries

__all__ = ["bound_transaction"]


def bound_transaction(conn: psycopg.Connection[Any], seconds: float) -> None:
    """Bound the open transaction (idle time and each statement) by ``seconds``."""
    value = f"{max(1, int(seconds * 1000))}ms"
    conn.execute(queries(None).bound_durable_transaction, {"value": value})
