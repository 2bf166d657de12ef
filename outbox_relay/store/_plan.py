"""Statement plans: a store operation written once, run by any driver.

A plan is a generator that yields ``Statement``s and is sent back each one's
result (``None``, the first row, or all rows, as the statement asks). It holds
the logic (which statements, in what order, what a result means); a driver
only executes. ``run`` drives a plan on a sync psycopg connection;
``store/aio.py`` drives the same plans on a psycopg ``AsyncConnection`` and on
an asyncpg connection.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import psycopg

__all__ = ["Plan", "Statement", "run"]

T = TypeVar("T")


@dataclass(frozen=True)
class Statement:
    """One named query with its parameters; ``params=None``: DDL sent as it is."""

    query: str
    params: dict[str, Any] | None = None
    fetch: Literal["none", "one", "all"] = "none"


Plan = Generator[Statement, Any, T]


def run(conn: psycopg.Connection[Any], plan: Plan[T]) -> T:
    """Execute ``plan`` on a sync connection; return what the plan returns."""
    result: Any = None
    try:
        while True:
            stmt = plan.send(result)
            # A parameterless statement (a migration's DDL) is sent as bytes,
            # so psycopg reads no placeholders in it.
            cur = conn.execute(stmt.query.encode() if stmt.params is None else stmt.query,
                               stmt.params)  # fmt: skip
            if stmt.fetch == "one":
                result = cur.fetchone()
            elif stmt.fetch == "all":
                result = cur.fetchall()
            else:
                result = None
    except StopIteration as done:
        value: T = done.value
        return value
