"""The asyncio drivers of the store's plans: psycopg ``AsyncConnection`` and asyncpg.

The statements and the logic are the sync store's (``store/producer.py``,
``store/schema.py``), run through ``_plan`` plans; only the execution is
here. psycopg takes the named queries as they are. asyncpg numbers its
parameters (``$1``) instead of naming them (``%(name)s``): ``asyncpg_query``
rewrites a named query mechanically, in this one place, and caches the result.

asyncpg is never imported: a connection is recognised by its module, so this
module (and ``outbox_relay.aio``) loads without asyncpg installed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from typing import Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

from ..table import OutboxTable
from ._base import TableLike, failed_transaction, tableless
from ._plan import Plan, Statement
from .producer import insert_plan, missing_table
from .schema import migrate_plan

__all__ = [
    "AsyncConn",
    "asyncpg_query",
    "begin_sqlalchemy_transaction",
    "insert_messages",
    "is_asyncpg",
    "migrate",
]

T = TypeVar("T")

# A psycopg AsyncConnection, or an asyncpg Connection (or pool proxy).
AsyncConn = Any

# %(name)s placeholders (%(name)b: psycopg's binary format, which asyncpg
# always uses), and %% (a literal percent sign in psycopg's syntax).
_PLACEHOLDER = re.compile(r"%\((\w+)\)[sb]|%%|%s")


def is_asyncpg(conn: Any) -> bool:
    """Whether ``conn`` is asyncpg's (``Connection`` or a pool's ``PoolConnectionProxy``)."""
    return type(conn).__module__.split(".")[0] == "asyncpg"


@cache
def asyncpg_query(query: str) -> tuple[str, tuple[str, ...]]:
    """``query`` with ``%(name)s`` as ``$n`` (one number per name) and ``%%`` as ``%``.

    Returns the text and the parameter names in number order. A repeated name
    keeps its number, as psycopg does, so the server infers the same types.
    Only for queries with parameters; parameterless DDL is sent untouched.
    """
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        name = match.group(1)
        if name is None:
            raise ValueError("asyncpg_query takes named placeholders only, found %s")
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    # Whole-line comments go first: a placeholder named in a comment would
    # otherwise be numbered, and the server (which skips comments) would
    # expect fewer arguments than asyncpg sends.
    code = "\n".join(line for line in query.splitlines() if not line.lstrip().startswith("--"))
    return _PLACEHOLDER.sub(number, code), tuple(names)


async def _run_psycopg(conn: psycopg.AsyncConnection[Any], plan: Plan[T]) -> T:
    result: Any = None
    try:
        while True:
            stmt = plan.send(result)
            query: Any = stmt.query.encode() if stmt.params is None else stmt.query
            cur = await conn.execute(query, stmt.params)
            result = await _fetch_psycopg(cur, stmt)
    except StopIteration as done:
        value: T = done.value
        return value


async def _fetch_psycopg(cur: psycopg.AsyncCursor[Any], stmt: Statement) -> Any:
    if stmt.fetch == "one":
        return await cur.fetchone()
    if stmt.fetch == "all":
        return await cur.fetchall()
    return None


async def _run_asyncpg(conn: Any, plan: Plan[T]) -> T:
    result: Any = None
    try:
        while True:
            stmt = plan.send(result)
            if stmt.params is None:
                # DDL without parameters: the simple protocol, several
                # statements in one text, as psycopg sends it.
                await conn.execute(stmt.query)
                result = None
                continue
            text, names = asyncpg_query(stmt.query)
            args = [stmt.params[name] for name in names]
            if stmt.fetch == "one":
                result = await conn.fetchrow(text, *args)
            elif stmt.fetch == "all":
                result = await conn.fetch(text, *args)
            else:
                await conn.execute(text, *args)
                result = None
    except StopIteration as done:
        value: T = done.value
        return value


def _check(conn: Any) -> None:
    name = type(conn).__name__
    if is_asyncpg(conn) and name in ("Pool", "PoolAcquireContext"):
        raise TypeError(
            f"outbox_relay.aio needs one asyncpg connection, got an asyncpg {name}: "
            "`async with pool.acquire() as conn, conn.transaction():` and pass conn"
        )
    if not (isinstance(conn, psycopg.AsyncConnection) or is_asyncpg(conn)):
        raise TypeError(
            "outbox_relay.aio needs a psycopg.AsyncConnection or an asyncpg connection, "
            f"got {name}{_what_to_pass(conn)}"
        )


def _what_to_pass(conn: Any) -> str:
    """The hint for a wrong ``conn``: what to pass instead of what was passed."""
    module = type(conn).__module__
    if module.split(".")[0] == "psycopg_pool":
        # AsyncConnectionPool (or a sync pool): it failed with the generic
        # message, which did not say how to take a connection from it.
        return ": `async with pool.connection() as conn, conn.transaction():` and pass conn"
    if isinstance(conn, psycopg.AsyncCursor | psycopg.Cursor):
        return ": pass the cursor's connection (cursor.connection)"
    if hasattr(conn, "__aenter__") and hasattr(conn, "__aexit__"):
        # pool.connection() or AsyncConnection.connect() not entered.
        return ", an async context manager not entered: `async with ... as conn:` and pass conn"
    return " (for a sync psycopg.Connection use outbox_relay.enqueue)"


async def _in_savepoint(conn: AsyncConn, plan: Plan[T], table: OutboxTable) -> T:
    """Run ``plan`` in a nested transaction: a savepoint inside the caller's."""
    if is_asyncpg(conn):
        from asyncpg.exceptions import InterfaceError, UndefinedColumnError, UndefinedTableError

        try:
            # Inside a transaction asyncpg manages (conn.transaction(), or
            # SQLAlchemy's), this is a savepoint; outside any, its own
            # transaction, committed at the end, like an autocommit psycopg
            # connection.
            async with conn.transaction():
                return await _run_asyncpg(conn, plan)
        except (UndefinedTableError, UndefinedColumnError) as exc:
            raise missing_table(table, str(exc)) from None
        except InterfaceError as exc:
            if "manually started transaction" not in str(exc):
                raise
            # Nothing was written: asyncpg refused before the savepoint.
            raise TypeError(
                "outbox_relay.aio on asyncpg needs the caller's transaction begun with "
                "`async with conn.transaction():`, not by executing BEGIN (asyncpg then "
                "refuses the savepoint enqueue writes in)"
            ) from None
    try:
        async with conn.transaction():
            return await _run_psycopg(conn, plan)
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn) as exc:
        raise missing_table(table, exc.diag.message_primary) from None


async def insert_messages(
    conn: AsyncConn,
    rows: Sequence[dict[str, Any]],
    *,
    table: OutboxTable,
    lock_keys: Sequence[str],
    notify: bool,
) -> list[int]:
    """``store.producer.insert_messages`` on an asyncio connection."""
    _check(conn)
    if (
        isinstance(conn, psycopg.AsyncConnection)
        and conn.info.transaction_status == TransactionStatus.INERROR
    ):
        raise failed_transaction()  # as the sync producer says it
    if (
        isinstance(conn, psycopg.AsyncConnection)
        and not conn.autocommit
        and conn.info.transaction_status == TransactionStatus.IDLE
    ):
        # As in the sync producer: begin the caller's transaction, so the
        # savepoint below does not become a transaction committed on its own.
        await conn.execute(tableless().begin_caller_transaction)
    plan = insert_plan(rows, table=table, lock_keys=lock_keys, notify=notify)
    return await _in_savepoint(conn, plan, table)


async def migrate(conn: AsyncConn, *, table: TableLike = None) -> list[int]:
    """``store.migrate`` on an asyncio connection: the same steps, one transaction."""
    _check(conn)
    outbox = OutboxTable.parse(table)
    plan = migrate_plan(outbox)
    if is_asyncpg(conn):
        async with conn.transaction():
            return await _run_asyncpg(conn, plan)
    async with conn.transaction():
        return await _run_psycopg(conn, plan)


async def begin_sqlalchemy_transaction(connection: Any) -> None:
    """Make a SQLAlchemy ``AsyncConnection`` begin its DBAPI transaction now.

    SQLAlchemy's asyncpg adapter begins the driver's transaction lazily, at
    its first statement; statements sent to the asyncpg connection before
    that would run outside it, committed on their own. One no-op statement
    through SQLAlchemy makes it begin.
    """
    await connection.exec_driver_sql(tableless().begin_caller_transaction)
