"""The asyncio producers against real PostgreSQL, every form alike.

Four forms run the same scenarios: ``outbox_relay.aio`` on a psycopg
``AsyncConnection`` and on a bare asyncpg connection, and the SQLAlchemy
asyncio integration on ``postgresql+psycopg`` and ``postgresql+asyncpg``.
Each must behave as the sync producer does: the message commits and rolls
back with the business change, an operation key repeated with other content
raises ``OperationKeyConflict``, an ordered message holds its aggregate's
lock until commit, and a refused message leaves the caller's transaction usable.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import outbox_relay
from outbox_relay import InvalidMessage, NewMessage, OperationKeyConflict, aio, store
from outbox_relay.integrations import sqlalchemy_asyncio
from outbox_relay.sql.queries import raw_queries
from outbox_relay.store.aio import asyncpg_query

from .test_producer import backend_waits_on, wait_until

FORMS = ["psycopg", "asyncpg", "sqlalchemy+psycopg", "sqlalchemy+asyncpg"]


def asyncpg_kwargs(dsn: str) -> dict[str, Any]:
    params = conninfo_to_dict(dsn)
    return {
        "host": params.get("host"),
        "port": int(params.get("port") or 5432),
        "user": params.get("user"),
        "password": params.get("password"),
        "database": params.get("dbname"),
    }


class Producer:
    """One form's transaction: business insert, enqueue, commit or rollback, backend pid."""

    def __init__(self, form: str, dsn: str) -> None:
        self.form = form
        self.dsn = dsn
        self._conn: Any = None
        self._tx: Any = None
        self._session: AsyncSession | None = None
        self._engine: Any = None

    async def open(self) -> None:
        if self.form == "psycopg":
            # Not autocommit: psycopg begins the transaction implicitly, and
            # enqueue may be its first statement.
            self._conn = await psycopg.AsyncConnection.connect(self.dsn)
        elif self.form == "asyncpg":
            self._conn = await asyncpg.connect(**asyncpg_kwargs(self.dsn))
            self._tx = self._conn.transaction()
            await self._tx.start()
        else:
            dialect = self.form.split("+")[1]

            async def creator() -> Any:
                if dialect == "psycopg":
                    return await psycopg.AsyncConnection.connect(self.dsn)
                return await asyncpg.connect(**asyncpg_kwargs(self.dsn))

            self._engine = create_async_engine(f"postgresql+{dialect}://", async_creator=creator)
            self._session = AsyncSession(self._engine)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            await self._engine.dispose()
        elif self.form == "psycopg":
            await self._conn.close()
        else:
            await self._conn.close()

    async def enqueue(self, **fields: Any) -> int:
        if self._session is not None:
            return await sqlalchemy_asyncio.enqueue(self._session, **fields)
        return await aio.enqueue(self._conn, **fields)

    async def enqueue_many(self, messages: list[NewMessage]) -> list[int]:
        if self._session is not None:
            return await sqlalchemy_asyncio.enqueue_many(self._session, messages)
        return await aio.enqueue_many(self._conn, messages)

    async def insert_order(self, order: int) -> None:
        if self._session is not None:
            await self._session.execute(text("INSERT INTO orders VALUES (:id)"), {"id": order})
        elif self.form == "psycopg":
            await self._conn.execute("INSERT INTO orders VALUES (%s)", (order,))
        else:
            await self._conn.execute("INSERT INTO orders VALUES ($1)", order)

    async def pid(self) -> int:
        if self._session is not None:
            result = await self._session.execute(text("SELECT pg_backend_pid()"))
            return int(result.scalar_one())
        if self.form == "psycopg":
            return int(self._conn.info.backend_pid)
        return int(self._conn.get_server_pid())

    async def commit(self) -> None:
        if self._session is not None:
            await self._session.commit()
        elif self.form == "psycopg":
            await self._conn.commit()
        else:
            await self._tx.commit()
            self._tx = self._conn.transaction()
            await self._tx.start()

    async def rollback(self) -> None:
        if self._session is not None:
            await self._session.rollback()
        elif self.form == "psycopg":
            await self._conn.rollback()
        else:
            await self._tx.rollback()
            self._tx = self._conn.transaction()
            await self._tx.start()


def event(order: int, **kw: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "aggregate_type": "order",
        "aggregate_id": order,
        "event_type": "order.created",
        "payload": {"id": order},
    }
    fields.update(kw)
    return fields


@pytest.fixture
def orders_dsn(dsn: str) -> Iterator[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY)")
    yield dsn


def seen(dsn: str) -> tuple[list[int], list[str]]:
    """What another session sees: committed orders and outbox aggregate ids."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        orders = [r[0] for r in conn.execute("SELECT id FROM orders ORDER BY id")]
        outbox = [r[0] for r in conn.execute("SELECT aggregate_id FROM outbox ORDER BY id")]
    return orders, outbox


def run(form: str, dsn: str, scenario: Callable[[Producer], Awaitable[None]]) -> None:
    async def main() -> None:
        producer = Producer(form, dsn)
        await producer.open()
        try:
            await scenario(producer)
        finally:
            await producer.close()

    asyncio.run(main())


@pytest.mark.parametrize("form", FORMS)
def test_commit_makes_the_message_visible_with_the_order(form: str, orders_dsn: str) -> None:
    async def scenario(p: Producer) -> None:
        # The message first, the order after: both in one transaction.
        message_id = await p.enqueue(**event(1))
        await p.insert_order(1)
        assert message_id > 0
        assert seen(orders_dsn) == ([], [])  # nothing visible before the commit
        await p.commit()
        assert seen(orders_dsn) == ([1], ["1"])
        many = await p.enqueue_many([NewMessage(**event(2)), NewMessage(**event(3))])
        await p.commit()
        assert many == sorted(many) and many[0] > message_id

    run(form, orders_dsn, scenario)
    assert seen(orders_dsn) == ([1], ["1", "2", "3"])


@pytest.mark.parametrize("form", FORMS)
def test_rollback_leaves_neither_order_nor_message(form: str, orders_dsn: str) -> None:
    async def scenario(p: Producer) -> None:
        await p.insert_order(5)
        await p.enqueue(**event(5))
        await p.enqueue_many([NewMessage(**event(6))])
        await p.rollback()

    run(form, orders_dsn, scenario)
    assert seen(orders_dsn) == ([], [])


@pytest.mark.parametrize("form", FORMS)
def test_operation_key_rules_as_sync_and_the_transaction_stays_usable(
    form: str, orders_dsn: str
) -> None:
    async def scenario(p: Producer) -> None:
        first = await p.enqueue(**event(7, operation_key="order-7"))
        # The same operation again (under another trace, too): the same id.
        trace = {"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"}
        again = await p.enqueue(**event(7, operation_key="order-7", headers=trace))
        assert again == first
        with pytest.raises(OperationKeyConflict, match="order-7") as caught:
            await p.enqueue(**event(7, operation_key="order-7", payload={"id": 8}))
        assert caught.value.existing_id == first
        # Only the savepoint was rolled back: the business change goes on.
        await p.insert_order(7)
        await p.commit()

    run(form, orders_dsn, scenario)
    assert seen(orders_dsn) == ([7], ["7"])


@pytest.mark.parametrize("form", FORMS)
def test_refused_message_writes_nothing_and_leaves_the_transaction_usable(
    form: str, orders_dsn: str
) -> None:
    async def scenario(p: Producer) -> None:
        await p.insert_order(9)
        with pytest.raises(InvalidMessage, match="payload must be JSON-serializable"):
            await p.enqueue(**event(9, payload={"x": float("nan")}))
        with pytest.raises(InvalidMessage, match="operation_key holds a NUL character"):
            await p.enqueue(**event(9, operation_key="k\x00"))
        with pytest.raises(InvalidMessage, match="operation_key"):
            await p.enqueue(**event(9, operation_key="k\udcff"))
        with pytest.raises(InvalidMessage, match="aggregate_type must not be empty"):
            await p.enqueue_many(
                [NewMessage(**event(10)), NewMessage(**event(11, aggregate_type=""))]
            )
        await p.enqueue(**event(12))
        await p.commit()

    run(form, orders_dsn, scenario)
    assert seen(orders_dsn) == ([9], ["12"])


@pytest.mark.parametrize("form", FORMS)
def test_ordered_message_holds_its_aggregates_lock_until_commit(form: str, orders_dsn: str) -> None:
    """A sync producer of the same ordered aggregate waits for the async one's
    commit, and gets the later id: commit order is id order."""
    later: list[Any] = []

    def second_producer() -> None:
        try:
            with psycopg.connect(orders_dsn) as conn:
                later.append(outbox_relay.enqueue(conn, **event(20, ordered=True)))
        except BaseException as exc:
            later.append(exc)

    async def scenario(p: Producer) -> None:
        first = await p.enqueue(**event(20, ordered=True))
        pid = await p.pid()
        with psycopg.connect(orders_dsn, autocommit=True) as monitor:
            held = monitor.execute(
                "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory'"
                " AND granted",
                (pid,),
            ).fetchone()
            assert held == (1,)
            thread = threading.Thread(target=second_producer)
            thread.start()
            await asyncio.to_thread(
                wait_until,
                lambda: any(backend_waits_on(monitor, o, "advisory") for o in others(monitor, pid)),
                "the second producer waits for the first",
            )
            assert later == []
            await p.commit()
            await asyncio.to_thread(thread.join, 10)
        assert len(later) == 1 and isinstance(later[0], int) and first < later[0]

    run(form, orders_dsn, scenario)


def others(monitor: psycopg.Connection[Any], pid: int) -> list[int]:
    rows = monitor.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> %s"
        " AND pid <> pg_backend_pid()",
        (pid,),
    )
    return [r[0] for r in rows]


@pytest.mark.parametrize("form", FORMS)
def test_notify_arrives_after_commit_only(form: str, orders_dsn: str) -> None:
    channel = outbox_relay.OutboxTable().channel
    with psycopg.connect(orders_dsn, autocommit=True) as listener:
        store.listen(listener)

        async def scenario(p: Producer) -> None:
            await p.enqueue(**event(30))
            assert list(listener.notifies(timeout=0.2, stop_after=1)) == []
            await p.commit()

        run(form, orders_dsn, scenario)
        assert [n.channel for n in listener.notifies(timeout=5, stop_after=1)] == [channel]


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_aio_migrate_creates_the_same_schema_and_is_idempotent(
    driver: str, fresh_database: str, dsn: str
) -> None:
    async def main() -> tuple[list[int], list[int]]:
        if driver == "psycopg":
            conn: Any = await psycopg.AsyncConnection.connect(fresh_database, autocommit=True)
        else:
            conn = await asyncpg.connect(**asyncpg_kwargs(fresh_database))
        try:
            return await aio.migrate(conn), await aio.migrate(conn)
        finally:
            await conn.close()

    applied, again = asyncio.run(main())
    assert applied == list(range(1, len(applied) + 1)) and len(applied) >= 6
    assert again == []

    def columns(target: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(target, autocommit=True) as conn:
            return conn.execute(
                "SELECT table_name, column_name, data_type FROM information_schema.columns"
                " WHERE table_schema = 'public' ORDER BY 1, 2"
            ).fetchall()

    # The same tables and columns as the sync migrate made (the dsn fixture's template).
    assert columns(fresh_database) == columns(dsn)


def test_asyncpg_query_numbers_every_named_parameter_once() -> None:
    text_, names = asyncpg_query(
        "-- %(comment)s is not a parameter\nSELECT %(a)s, %(b)s::int, %(a)s, '100%%', %(c)b"
    )
    # %(c)b: psycopg's binary format (insert_many's text arrays); asyncpg's is always binary.
    assert text_ == "SELECT $1, $2::int, $1, '100%', $3"
    assert names == ("a", "b", "c")
    # Every named query converts: no psycopg placeholder survives.
    for name, query in raw_queries().items():
        converted, names = asyncpg_query(query)
        assert "%(" not in converted and "%s" not in converted, name
        used = {int(n) for n in re.findall(r"\$(\d+)", converted)}
        assert used == set(range(1, len(names) + 1)), name
    with pytest.raises(ValueError, match="named placeholders only"):
        asyncpg_query("SELECT %s")


def test_aio_refuses_a_sync_connection(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(TypeError, match="AsyncConnection or an asyncpg connection"):
        asyncio.run(aio.enqueue(conn, **event(1)))
    # Nothing was written.
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)


def test_outbox_aio_uses_the_outboxs_settings(dsn: str) -> None:
    outbox = outbox_relay.Outbox(ordered_event_types=["order.*"])

    async def main() -> int:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            message_id = await outbox.aio.enqueue(conn, **event(40))
            await conn.commit()
            return message_id

    message_id = asyncio.run(main())
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT ordered FROM outbox WHERE id = %s", (message_id,)).fetchone()
    assert row == (True,)


def test_asyncpg_transaction_begun_by_hand_is_refused_with_a_clear_error(dsn: str) -> None:
    async def main() -> int:
        conn = await asyncpg.connect(**asyncpg_kwargs(dsn))
        try:
            await conn.execute("BEGIN")
            with pytest.raises(TypeError, match=r"async with conn\.transaction\(\)"):
                await aio.enqueue(conn, **event(1))
            await conn.execute("ROLLBACK")
            return int(await conn.fetchval("SELECT count(*) FROM outbox"))
        finally:
            await conn.close()

    assert asyncio.run(main()) == 0


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_aio_apply_async_writes_the_canvas_row_with_the_ids_it_returns(
    driver: str, dsn: str
) -> None:
    from celery import chain

    from .apps import canvas as user

    async def connect() -> Any:
        if driver == "psycopg":
            return await psycopg.AsyncConnection.connect(dsn)
        return await asyncpg.connect(**asyncpg_kwargs(dsn))

    async def write(commit: bool) -> Any:
        conn = await connect()
        try:
            sig = chain(user.step.s(tag="a"), user.step.s(tag="b"))
            if driver == "psycopg":
                async with conn.transaction(force_rollback=not commit):
                    return await aio.apply_async(conn, sig)
            tx = conn.transaction()
            await tx.start()
            result = await outbox_relay.Outbox().aio.apply_async(conn, sig)
            await (tx.commit() if commit else tx.rollback())
            return result
        finally:
            await conn.close()

    kept = asyncio.run(write(commit=True))
    dropped = asyncio.run(write(commit=False))
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT event_type, aggregate_id, payload::text FROM outbox ORDER BY id"
        ).fetchall()
    assert len(rows) == 1, rows  # the rolled-back one left nothing
    event_type, root, payload = rows[0]
    assert event_type == "celery.apply_async"
    # The chain's result is its last task's; its parent is the first: both
    # ids were fixed before the commit and are the ones the row will send.
    assert root == kept.parent.id
    assert kept.id in payload and kept.parent.id in payload
    assert dropped.id not in payload


@pytest.mark.parametrize("dialect", ["psycopg", "asyncpg"])
def test_aio_takes_a_sqlalchemy_async_session(dialect: str, dsn: str) -> None:
    """outbox_relay.aio.apply_async and enqueue on a SQLAlchemy AsyncSession
    (FastAPI's usual handle), as the sync apply_async takes a Session: they
    write on its driver connection, in its transaction."""
    from celery import chain

    from .apps import canvas as user

    async def creator() -> Any:
        if dialect == "psycopg":
            return await psycopg.AsyncConnection.connect(dsn)
        return await asyncpg.connect(**asyncpg_kwargs(dsn))

    async def write(commit: bool) -> tuple[Any, int]:
        engine = create_async_engine(f"postgresql+{dialect}://", async_creator=creator)
        try:
            async with AsyncSession(engine) as session:
                transaction = await session.begin()
                result = await aio.apply_async(
                    session, chain(user.step.s(tag="a"), user.step.s(tag="b"))
                )
                message_id = await aio.enqueue(
                    session, aggregate_type="order", aggregate_id=1, event_type="e", payload={}
                )
                await (transaction.commit() if commit else transaction.rollback())
                return result, message_id
        finally:
            await engine.dispose()

    kept, kept_id = asyncio.run(write(commit=True))
    asyncio.run(write(commit=False))
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT id, event_type, aggregate_id FROM outbox ORDER BY id"
        ).fetchall()
    assert [(r[1], r[2]) for r in rows] == [("celery.apply_async", kept.parent.id), ("e", "1")]
    assert rows[1][0] == kept_id


class AppSession(AsyncSession):
    """An application's own session class (defined outside SQLAlchemy)."""


@pytest.mark.parametrize("dialect", ["psycopg", "asyncpg"])
def test_aio_takes_an_applications_subclass_of_async_session(dialect: str, dsn: str) -> None:
    """It was recognised by its class's module: TypeError "needs a
    psycopg.AsyncConnection or an asyncpg connection, got AppSession"."""

    async def creator() -> Any:
        if dialect == "psycopg":
            return await psycopg.AsyncConnection.connect(dsn)
        return await asyncpg.connect(**asyncpg_kwargs(dsn))

    async def main() -> int:
        engine = create_async_engine(f"postgresql+{dialect}://", async_creator=creator)
        try:
            async with AppSession(engine) as session, session.begin():
                return await aio.enqueue(session, **event(1))
        finally:
            await engine.dispose()

    message_id = asyncio.run(main())
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT id FROM outbox").fetchall() == [(message_id,)]


def test_an_asyncpg_pool_is_named_with_what_to_pass_instead(dsn: str) -> None:
    """It failed with "AttributeError: 'Pool' object has no attribute 'transaction'"."""

    async def main() -> None:
        pool = await asyncpg.create_pool(**asyncpg_kwargs(dsn), min_size=1, max_size=1)
        try:
            with pytest.raises(TypeError, match=r"got an asyncpg Pool: .*pool\.acquire\(\)"):
                await aio.enqueue(pool, **event(1))
        finally:
            await pool.close()

    asyncio.run(main())


def test_a_psycopg_pool_or_an_unentered_connection_is_named_with_what_to_pass(dsn: str) -> None:
    """They failed with "needs a psycopg.AsyncConnection ..., got AsyncConnectionPool
    (for a sync psycopg.Connection use outbox_relay.enqueue)": a hint for another mistake."""
    from psycopg_pool import AsyncConnectionPool

    async def main() -> None:
        pool = AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False)
        await pool.open()
        try:
            with pytest.raises(
                TypeError,
                match=r"got AsyncConnectionPool: `async with pool\.connection\(\) as conn",
            ):
                await aio.enqueue(pool, **event(1))
            with pytest.raises(TypeError, match=r"async context manager not entered"):
                await aio.enqueue(pool.connection(), **event(1))
            async with pool.connection() as conn:
                with pytest.raises(TypeError, match=r"got AsyncCursor: .*cursor\.connection"):
                    await aio.enqueue(conn.cursor(), **event(1))
                # Nothing was written by any of them.
                cur = await conn.execute("SELECT count(*) FROM outbox")
                assert await cur.fetchone() == (0,)
        finally:
            await pool.close()

    asyncio.run(main())


def test_a_failed_async_transaction_says_so_as_the_sync_producer_does(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """psycopg logged "savepoint does not exist" and raised its own
    InFailedSqlTransaction, hiding the statement that failed first."""

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            with pytest.raises(psycopg.errors.DivisionByZero):
                await conn.execute("SELECT 1 / 0")
            with pytest.raises(psycopg.errors.InFailedSqlTransaction, match="already failed"):
                await aio.enqueue(conn, **event(1))
            await conn.rollback()

    asyncio.run(main())
    assert "savepoint" not in caplog.text
