"""Interim home of the operator reads until store/ops.py lands (see the restructuring)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import psycopg

from ._base import TableLike, queries

if TYPE_CHECKING:
    from ..operations import PurgeResult
else:
    PurgeResult = Any

__all__ = ["PurgeResult", "get_row", "purge", "stats"]


def stats(
    conn: psycopg.Connection[Any], *, table: TableLike = None, now: Any = None
) -> dict[str, Any]:
    with conn.transaction():
        cur = conn.execute(queries(table).stats, {"now": now})
        row = cur.fetchone()
        names = [d.name for d in cur.description or []]
    assert row is not None
    return dict(zip(names, row))


def get_row(
    conn: psycopg.Connection[Any], message_id: int, *, table: TableLike = None
) -> dict[str, Any] | None:
    with conn.transaction():
        cur = conn.execute(queries(table).get, {"id": message_id})
        row = cur.fetchone()
        names = [d.name for d in cur.description or []]
    return dict(zip(names, row)) if row else None


def purge(conn: psycopg.Connection[Any], **kwargs: Any) -> Any:
    from .. import operations

    return operations.purge(conn, **kwargs)


_ = timedelta
