"""pgqueuer draining a pre-filled queue, for the side-by-side figures in ``run.py``.

Settings follow pgqueuer's own benchmark (``tools/benchmark.py`` in its
repository, drain strategy): asyncpg driver, one connection per
QueueManager, ``batch_size=10``, no concurrency limits (per entrypoint
``concurrency_limit=0``, ``max_concurrent_tasks=None``), ``mode=drain``, the
uvloop event loop and default (durable, logged) tables. The one difference is
that each QueueManager runs in its own OS process, as the relay's workers do.

Timing mirrors ``run.wait_progress``: from the first job leaving ``queued`` to
the queue table being empty (pgqueuer deletes a finished job from the queue
and writes it to its log table in the same statement), so process start-up
and imports are not counted.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

ENTRYPOINT = "bench"
BATCH_SIZE = 10  # pgqueuer's benchmark default for dequeue and for the log buffer
ENQUEUE_BATCH = 5_000


def _tables() -> tuple[str, str]:
    """pgqueuer's queue and log table names (from its PGQUEUER_* settings)."""
    from pgqueuer.domain.settings import db_settings

    settings = db_settings()
    return settings.queue_table, settings.queue_table_log


def _connect_args(dsn: str) -> dict[str, str]:
    """asyncpg.connect() keywords for a libpq DSN (URL or key=value, as database() makes)."""
    params = conninfo_to_dict(dsn)
    names = {"host": "host", "port": "port", "user": "user", "password": "password"}
    args = {names[k]: str(v) for k, v in params.items() if k in names and v is not None}
    if params.get("dbname"):
        args["database"] = str(params["dbname"])
    return args


async def _prepare(dsn: str, n: int) -> None:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries

    conn = await asyncpg.connect(**_connect_args(dsn))
    try:
        queries = Queries(AsyncpgDriver(conn))
        await queries.install()
        for start in range(0, n, ENQUEUE_BATCH):
            size = min(ENQUEUE_BATCH, n - start)
            await queries.enqueue([ENTRYPOINT] * size, [None] * size, [0] * size)
    finally:
        await conn.close()


async def _consume(dsn: str, wait_seconds: float) -> None:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.domain.types import QueueExecutionMode
    from pgqueuer.models import Job

    conn = await asyncpg.connect(**_connect_args(dsn))
    qm = QueueManager(Queries(AsyncpgDriver(conn)))

    if wait_seconds > 0:

        @qm.entrypoint(ENTRYPOINT)
        async def work(job: Job) -> None:
            await asyncio.sleep(wait_seconds)

    else:

        @qm.entrypoint(ENTRYPOINT)
        async def work(job: Job) -> None:
            return None

    try:
        await qm.run(batch_size=BATCH_SIZE, mode=QueueExecutionMode.drain)
    finally:
        if not conn.is_closed():
            await conn.close()


def _consumer_entry(dsn: str, wait_seconds: float) -> None:
    import uvloop

    uvloop.run(_consume(dsn, wait_seconds))


def _counts(conn: psycopg.Connection[Any], table: str) -> tuple[int, int]:
    """(jobs no longer queued, jobs still in the queue table), on the caller's
    connection: a connection per poll would fork a backend each time and steal
    CPU from the consumers being measured."""
    row = conn.execute(
        f"SELECT count(*) FILTER (WHERE status <> 'queued'), count(*) FROM {table}"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def drain(
    dsn: str,
    n: int,
    consumers: int,
    wait_seconds: float,
    *,
    timeout: float = 900,
    poll: float = 0.05,
) -> float:
    """Install pgqueuer in ``dsn``, queue ``n`` jobs, drain them with ``consumers`` processes.

    Returns the seconds from the first job picked to the last one done.
    """
    asyncio.run(_prepare(dsn, n))
    table, log_table = _tables()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {table}")
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_consumer_entry, args=(dsn, wait_seconds), daemon=True)
        for _ in range(consumers)
    ]
    for p in procs:
        p.start()
    probe = psycopg.connect(dsn, autocommit=True)
    try:
        deadline = time.monotonic() + timeout

        def check_alive() -> None:
            if any(p.exitcode not in (None, 0) for p in procs):
                codes = [p.exitcode for p in procs]
                raise RuntimeError(f"pgqueuer consumer failed, exit codes {codes}")

        while True:
            picked, left = _counts(probe, table)
            if picked or left < n:
                break
            check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("pgqueuer: work never started")
            time.sleep(poll)
        t0 = time.monotonic()
        while _counts(probe, table)[1]:
            check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("pgqueuer: work did not finish in time")
            time.sleep(poll)
        seconds = time.monotonic() - t0
        for p in procs:
            p.join(timeout=60)
        check_alive()
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT count(*) FROM {log_table} WHERE status = 'successful'"
            ).fetchone()
        if row is None or row[0] != n:
            raise RuntimeError(f"pgqueuer: {row and row[0]} of {n} jobs logged successful")
    finally:
        probe.close()
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    return seconds
