"""Producer throughput by form: what each way of calling ``enqueue`` costs.

    .venv/bin/python -m benchmarks.producers --dsn postgresql://postgres@127.0.0.1/postgres

One process, one connection per form, a fresh database. Each form writes
``--messages`` messages, one per transaction (a business change with its
event: the common case), then the same number in transactions of
``--batch`` messages through ``enqueue_many``. Forms: sync psycopg, aio on
psycopg's ``AsyncConnection``, aio on asyncpg, and the SQLAlchemy asyncio
integration on both dialects. The machine is shared: compare the ratios of
one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import outbox_relay
from outbox_relay import NewMessage, aio
from outbox_relay.integrations import sqlalchemy_asyncio


def fields(i: int) -> dict[str, Any]:
    return {
        "aggregate_type": "order",
        "aggregate_id": i,
        "event_type": "order.created",
        "payload": {"id": i, "total": 1999, "lines": [{"sku": "A-1", "qty": 2}]},
    }


def asyncpg_kwargs(dsn: str) -> dict[str, Any]:
    p = conninfo_to_dict(dsn)
    return {
        "host": p.get("host"),
        "port": int(p.get("port") or 5432),
        "user": p.get("user"),
        "password": p.get("password"),
        "database": p.get("dbname"),
    }


def sync_psycopg(dsn: str, n: int, batch: int) -> tuple[float, float]:
    with psycopg.connect(dsn) as conn:
        started = time.perf_counter()
        for i in range(n):
            outbox_relay.enqueue(conn, **fields(i))
            conn.commit()
        single = time.perf_counter() - started
        started = time.perf_counter()
        for start in range(0, n, batch):
            outbox_relay.enqueue_many(
                conn, [NewMessage(**fields(i)) for i in range(start, start + batch)]
            )
            conn.commit()
        return single, time.perf_counter() - started


Commit = Callable[[], Awaitable[None]]


async def _timed(
    enqueue: Callable[..., Awaitable[int]],
    enqueue_many: Callable[[list[NewMessage]], Awaitable[list[int]]],
    commit: Commit,
    n: int,
    batch: int,
) -> tuple[float, float]:
    started = time.perf_counter()
    for i in range(n):
        await enqueue(**fields(i))
        await commit()
    single = time.perf_counter() - started
    started = time.perf_counter()
    for start in range(0, n, batch):
        await enqueue_many([NewMessage(**fields(i)) for i in range(start, start + batch)])
        await commit()
    return single, time.perf_counter() - started


async def aio_psycopg(dsn: str, n: int, batch: int) -> tuple[float, float]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        return await _timed(
            lambda **f: aio.enqueue(conn, **f),
            lambda ms: aio.enqueue_many(conn, ms),
            conn.commit,
            n,
            batch,
        )


async def aio_asyncpg(dsn: str, n: int, batch: int) -> tuple[float, float]:
    conn = await asyncpg.connect(**asyncpg_kwargs(dsn))
    # The caller's transaction, as the other forms have one: enqueue writes
    # in a savepoint of it.
    tx = conn.transaction()
    await tx.start()

    async def commit() -> None:
        nonlocal tx
        await tx.commit()
        tx = conn.transaction()
        await tx.start()

    try:
        return await _timed(
            lambda **f: aio.enqueue(conn, **f),
            lambda ms: aio.enqueue_many(conn, ms),
            commit,
            n,
            batch,
        )
    finally:
        await tx.rollback()
        await conn.close()


async def sqlalchemy_form(dsn: str, n: int, batch: int, dialect: str) -> tuple[float, float]:
    async def creator() -> Any:
        if dialect == "psycopg":
            return await psycopg.AsyncConnection.connect(dsn)
        return await asyncpg.connect(**asyncpg_kwargs(dsn))

    engine = create_async_engine(f"postgresql+{dialect}://", async_creator=creator)
    try:
        async with AsyncSession(engine) as session:
            return await _timed(
                lambda **f: sqlalchemy_asyncio.enqueue(session, **f),
                lambda ms: sqlalchemy_asyncio.enqueue_many(session, ms),
                session.commit,
                n,
                batch,
            )
    finally:
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True, help="a superuser DSN (makes a scratch database)")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    name = f"outbox_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    dsn = make_conninfo(args.dsn, dbname=name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            outbox_relay.migrate(conn)
        n, batch = args.messages, args.batch
        forms: list[tuple[str, Callable[[], tuple[float, float]]]] = [
            ("sync psycopg", lambda: sync_psycopg(dsn, n, batch)),
            ("aio psycopg", lambda: asyncio.run(aio_psycopg(dsn, n, batch))),
            ("aio asyncpg", lambda: asyncio.run(aio_asyncpg(dsn, n, batch))),
            ("sqlalchemy+psycopg", lambda: asyncio.run(sqlalchemy_form(dsn, n, batch, "psycopg"))),
            ("sqlalchemy+asyncpg", lambda: asyncio.run(sqlalchemy_form(dsn, n, batch, "asyncpg"))),
        ]
        # Rounds interleave the forms; each form's best round counts, which
        # keeps a burst of load from the machine's other users out of a ratio.
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.rounds):
            for label, run in forms:
                single, batched = run()
                was = best.get(label, (float("inf"), float("inf")))
                best[label] = (min(was[0], single), min(was[1], batched))
        print(f"{n} messages; batches of {batch}; one commit per message / per batch;")
        print(f"best of {args.rounds} interleaved rounds")
        print(
            f"{'form':<20} {'single msg/s':>13} {'vs sync':>8} {'batched msg/s':>14} {'vs sync':>8}"
        )
        base_single, base_batched = best["sync psycopg"]
        for label, (single, batched) in best.items():
            print(
                f"{label:<20} {n / single:>13.0f} {base_single / single:>8.2f}"
                f" {n / batched:>14.0f} {base_batched / batched:>8.2f}"
            )
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
