"""What a durable Celery task's run needs beyond the relay's hot path."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg

from ..model import LeaseRef
from ._base import TableLike, queries, statement_tx
from .relay import Began, began_from_row

__all__ = ["begin_run", "bound_session"]


def bound_session(conn: psycopg.Connection[Any], seconds: float) -> None:
    """Bound this session's statements and idle transactions by ``seconds``."""
    value = f"{max(1, int(seconds * 1000))}ms"
    conn.execute(queries(None).bound_durable_session, {"value": value})


def begin_run(
    conn: psycopg.Connection[Any], ref: LeaseRef, *, needed: timedelta, table: TableLike = None
) -> Began | None:
    """``begin`` for a durable task's run (its attempt counted): None when the
    row is no longer held under ``ref``. The run's arguments come with its
    Celery message, so ``claimed.payload`` holds only what the run hands on:
    ``{"chain": [...]}``, or None without a chain."""
    params = {"id": ref.id, "version": ref.lease_version, "needed": needed}
    with statement_tx(conn):
        row = conn.execute(queries(table).begin_run, params).fetchone()
    if row is None:
        return None
    chain = row[6]
    return began_from_row((*row[:6], {"chain": chain} if chain else None, *row[7:]))
