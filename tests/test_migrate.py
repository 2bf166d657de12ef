"""Schema migrations and table names: idempotent, concurrent-safe, validated."""

from __future__ import annotations

import re
import threading
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox_relay
from outbox_relay import (
    Deliverer,
    DirectDatabase,
    InvalidIdentifier,
    OutboxTable,
    dispatch_once,
    store,
)
from outbox_relay.model import LeaseRef, Outcome
from outbox_relay.sql.queries import migrations_for

LATEST = max(m.version for m in migrations_for(OutboxTable()))
# The indexes migration 0001 creates besides the primary key.
INDEX_SUFFIXES = ("ready", "leased", "unfinished_agg", "operation_key", "done")


def schema_objects(conn: psycopg.Connection[Any], schema: str, name: str) -> dict[str, Any]:
    """What exists for one outbox table: the table, its indexes, its migration rows."""
    tables = conn.execute(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s AND c.relkind = 'r'",
        (schema, name),
    ).fetchone()
    indexes = conn.execute(
        "SELECT indexname FROM pg_indexes WHERE schemaname = %s AND tablename = %s"
        " ORDER BY indexname",
        (schema, name),
    ).fetchall()
    versions = conn.execute(
        sql.SQL("SELECT version FROM {} ORDER BY version").format(
            sql.Identifier(schema, f"{name}_migrations")
        )
    ).fetchall()
    assert tables is not None
    return {
        "tables": tables[0],
        "indexes": [r[0] for r in indexes],
        "versions": [r[0] for r in versions],
    }


def expected_indexes(name: str) -> list[str]:
    return sorted([f"{name}_pkey", *(f"{name}_{s}" for s in INDEX_SUFFIXES)])


# ---------------------------------------------------------------- idempotence
def test_migrate_applies_everything_once_then_nothing(fresh_database: str) -> None:
    with psycopg.connect(fresh_database, autocommit=True) as conn:
        assert outbox_relay.migrate(conn) == list(range(1, LATEST + 1))
        before = schema_objects(conn, "public", "outbox")
        assert outbox_relay.migrate(conn) == []
        assert outbox_relay.migrate(conn) == []
        after = schema_objects(conn, "public", "outbox")
    assert before == after
    assert after == {
        "tables": 1,
        "indexes": expected_indexes("outbox"),
        "versions": list(range(1, LATEST + 1)),
    }


def test_migrate_on_already_migrated_database_is_a_no_op(conn: psycopg.Connection[Any]) -> None:
    enqueued = outbox_relay.enqueue(
        conn, aggregate_type="order", aggregate_id="1", event_type="created", payload={}
    )
    assert outbox_relay.migrate(conn) == []
    # Existing rows survive a re-run.
    assert store.get_row(conn, enqueued) is not None


def test_migrate_inside_callers_transaction_commits_with_it(fresh_database: str) -> None:
    with psycopg.connect(fresh_database) as conn:
        conn.execute("SELECT 1")  # the caller's transaction is open
        assert outbox_relay.migrate(conn) == list(range(1, LATEST + 1))
        conn.rollback()
        # Rolled back with the caller: nothing exists, and migrate applies again.
        exists = conn.execute("SELECT to_regclass('public.outbox')").fetchone()
        assert exists == (None,)
        assert outbox_relay.migrate(conn) == list(range(1, LATEST + 1))
        conn.commit()
        assert outbox_relay.migrate(conn) == []


# ---------------------------------------------------------------- concurrency
@pytest.mark.parametrize("table", ["outbox", "shop.events"])
def test_concurrent_migrations_both_succeed_and_create_the_schema_once(
    fresh_database: str, table: str
) -> None:
    outbox = OutboxTable.parse(table)
    runners = 3
    start = threading.Barrier(runners)
    results: list[list[int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            with psycopg.connect(fresh_database, autocommit=True) as c:
                start.wait(timeout=10)
                applied = outbox_relay.migrate(c, table=table)
            with lock:
                results.append(applied)
        except BaseException as exc:  # reported below, with the thread's traceback
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(runners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    # Exactly one runner applied the migrations; the others found them applied.
    assert sorted(results) == [[]] * (runners - 1) + [list(range(1, LATEST + 1))]
    with psycopg.connect(fresh_database, autocommit=True) as c:
        assert schema_objects(c, outbox.schema, outbox.name) == {
            "tables": 1,
            "indexes": expected_indexes(outbox.name),
            "versions": list(range(1, LATEST + 1)),
        }


# ---------------------------------------------------------------- custom table
def test_custom_schema_and_table_work_for_every_query(conn: psycopg.Connection[Any]) -> None:
    table = "app.events"
    assert outbox_relay.migrate(conn, table=table) == list(range(1, LATEST + 1))
    assert outbox_relay.migrate(conn, table=table) == []
    assert schema_objects(conn, "app", "events") == {
        "tables": 1,
        "indexes": expected_indexes("events"),
        "versions": list(range(1, LATEST + 1)),
    }
    lease = timedelta(seconds=30)

    first = outbox_relay.enqueue(
        conn,
        table=table,
        aggregate_type="order",
        aggregate_id="1",
        event_type="order.created",
        payload={"n": 1},
        operation_key="op-1",
    )
    # The operation key's uniqueness works on the custom table too.
    again = outbox_relay.enqueue(
        conn,
        table=table,
        aggregate_type="order",
        aggregate_id="1",
        event_type="order.created",
        payload={"n": 1},
        operation_key="op-1",
    )
    assert again == first
    ids = outbox_relay.enqueue_many(
        conn,
        [
            outbox_relay.NewMessage("order", "1", "order.paid", {"n": 2}),
            outbox_relay.NewMessage("order", "2", "order.created", {"n": 3}),
        ],
        table=table,
    )
    now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    # The default table is untouched.
    assert conn.execute("SELECT count(*) FROM public.outbox").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM app.events").fetchone() == (3,)

    # Ordered claim: only the head of aggregate 1, plus aggregate 2.
    claimed = store.claim(
        conn, owner="w", batch=10, lease=lease, ordered=True, table=table, now=now
    )
    assert [c.id for c in claimed] == [first, ids[1]]
    assert store.mark_done(conn, claimed[0], table=table, now=now)
    assert store.extend_lease(conn, claimed[1], lease=lease, table=table, now=now)
    began = store.begin(conn, [claimed[1].ref], needed=timedelta(0), table=table, now=now)
    assert began.keys() == {ids[1]}
    assert store.reschedule(
        conn, claimed[1], delay=timedelta(0), error="x", refund_attempt=True, table=table, now=now
    )
    claimed = store.claim(conn, owner="w", batch=10, lease=lease, table=table, now=now)
    assert [c.id for c in claimed] == ids
    assert store.mark_dead(conn, claimed[0], error="boom", table=table, now=now)
    assert store.finalize(conn, [Outcome.done(claimed[1])], table=table, now=now) == {ids[1]}
    assert store.in_flight(conn, table=table) == 0
    stats = store.stats(conn, table=table, now=now)
    assert (stats["pending"], stats["processing"], stats["done"], stats["dead"]) == (0, 0, 2, 1)
    assert store.get_row(conn, ids[0], table=table)["status"] == "dead"  # type: ignore[index]
    assert store.reap(conn, max_attempts=1, table=table, now=now) == []

    # The delivery paths take the table too.
    published: list[int] = []
    extra = outbox_relay.enqueue(
        conn, table=table, aggregate_type="a", aggregate_id="9", event_type="e", payload={}
    )
    assert dispatch_once(conn, lambda m: published.append(m.id), owner="d", table=table) == 1
    last = outbox_relay.enqueue(
        conn, table=table, aggregate_type="a", aggregate_id="9", event_type="e", payload={}
    )
    [held] = store.claim(conn, owner="w", batch=1, lease=timedelta(minutes=5), table=table)
    deliverer = Deliverer(lambda m: published.append(m.id), db=DirectDatabase(conn), table=table)
    report = deliverer.deliver([LeaseRef(held.id, held.lease_version)])
    assert report.done == 1
    assert published == [extra, last]
    assert conn.execute("SELECT count(*) FROM public.outbox").fetchone() == (0,)


def test_two_tables_in_one_schema_do_not_clash(conn: psycopg.Connection[Any]) -> None:
    assert outbox_relay.migrate(conn, table="public.outbox_b") == list(range(1, LATEST + 1))
    a = outbox_relay.enqueue(conn, aggregate_type="a", aggregate_id="1", event_type="e", payload=1)
    b = outbox_relay.enqueue(
        conn, table="outbox_b", aggregate_type="a", aggregate_id="1", event_type="e", payload=2
    )
    lease = timedelta(seconds=30)
    [ca] = store.claim(conn, owner="w", batch=5, lease=lease)
    [cb] = store.claim(conn, owner="w", batch=5, lease=lease, table="outbox_b")
    assert (ca.id, ca.payload, cb.id, cb.payload) == (a, 1, b, 2)


# ---------------------------------------------------------------- validation
# (value, the part of it the error message must name)
BAD_TABLES = [
    ("x; drop table", "x; drop table"),
    ("a.b.c", "a.b.c"),
    ("1abc", "1abc"),
    ("t" * 41, "t" * 41),
    ("s" * 64 + ".outbox", "s" * 64),
    ('bad"quote', 'bad"quote'),
    ("sp ace", "sp ace"),
    ("", ""),
]


@pytest.mark.parametrize(("name", "named"), BAD_TABLES)
def test_invalid_table_names_are_rejected_before_touching_the_database(
    dsn: str, name: str, named: str
) -> None:
    # A closed connection: any attempt to use it would raise OperationalError,
    # so getting InvalidIdentifier proves validation happens first.
    closed = psycopg.connect(dsn)
    closed.close()
    pattern = re.escape(repr(named))
    with pytest.raises(InvalidIdentifier, match=pattern):
        outbox_relay.migrate(closed, table=name)
    with pytest.raises(InvalidIdentifier, match=pattern):
        outbox_relay.enqueue(
            closed, table=name, aggregate_type="a", aggregate_id="1", event_type="e", payload={}
        )
    with pytest.raises(InvalidIdentifier, match=pattern):
        store.claim(closed, owner="w", batch=1, lease=timedelta(seconds=1), table=name)
    with pytest.raises(InvalidIdentifier, match=pattern):
        store.finalize(closed, [Outcome.done(LeaseRef(1, 1))], table=name)
    with pytest.raises(InvalidIdentifier, match=pattern):
        store.finalize_and_take(
            closed,
            [Outcome.done(LeaseRef(1, 1))],
            owner="w",
            lease=timedelta(seconds=1),
            max_attempts=1,
            max_in_flight=None,
            table=name,
        )
    with pytest.raises(InvalidIdentifier, match=pattern):
        Deliverer(print, db=DirectDatabase(closed), table=name)


def test_invalid_identifier_is_a_config_error_and_nothing_was_created(
    conn: psycopg.Connection[Any],
) -> None:
    with pytest.raises(outbox_relay.ConfigError):
        outbox_relay.migrate(conn, table="x; drop table")
    # The connection is still usable and nothing new exists.
    schemas = conn.execute(
        "SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg_%%'"
        " AND nspname <> 'information_schema' ORDER BY 1"
    ).fetchall()
    assert schemas == [("public",)]


# ------------------------------------------------------------ page headroom
def _hot_updates(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    # This session's counters reach the statistics views at once only when
    # flushed by hand (PostgreSQL 15 and later flush them at most once a second).
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
        " WHERE relid = 'public.outbox'::regclass"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _begins_in_place(conn: psycopg.Connection[Any]) -> float:
    """Enqueue, claim and begin 400 rows; the share of begins written in place."""
    with conn.transaction():
        for i in range(400):
            outbox_relay.enqueue(
                conn, aggregate_type="order", aggregate_id=str(i), event_type="e", payload={}
            )
    claimed = store.claim(
        conn, owner="t", batch=400, lease=timedelta(seconds=60), count_attempt=False
    )
    assert len(claimed) == 400
    updates, hot = _hot_updates(conn)
    began = store.begin(conn, [c.ref for c in claimed], needed=timedelta(seconds=1))
    assert len(began) == 400
    updates_after, hot_after = _hot_updates(conn)
    assert updates_after - updates == 400
    return (hot_after - hot) / 400


def test_begin_updates_rows_in_place(conn: psycopg.Connection[Any]) -> None:
    # Migration 0007 keeps three tenths of each page free, so that begin
    # (which changes no indexed column) writes heap-only tuples instead of
    # an entry in each of the table's indexes. The control, in the same
    # database: fillfactor=100, pages packed full as before the migration.
    conn.autocommit = True
    with_room = _begins_in_place(conn)
    conn.execute("TRUNCATE outbox")
    conn.execute("ALTER TABLE outbox SET (fillfactor = 100)")
    packed = _begins_in_place(conn)
    # Measured: 0.61 and 0.04 here alone, 0.24 with room in CI beside other
    # tests (how much a page can take depends on pruning, which concurrent
    # snapshots hold back); the control never came near.
    assert with_room >= 0.15, (with_room, packed)
    assert with_room >= 3 * packed, (with_room, packed)


def test_the_last_django_migration_brings_the_last_schema_migration() -> None:
    # A Django project applies the outbox's migrations through its own
    # (manage.py migrate); one that migrated with an earlier release gets a
    # new schema migration only when a new Django migration runs the hook.
    import importlib
    import pkgutil

    from outbox_relay.integrations.django import migrations as package

    brought = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        brought[info.name] = module.OUTBOX_SCHEMA
    last = max(brought)
    assert brought[last] == LATEST, (
        f"schema migration {LATEST} has no Django migration: add one after {last} "
        "that runs outbox_relay.integrations.django.migrate.run"
    )
    assert list(brought.values()) == sorted(brought.values())


def test_migration_8_leaves_old_rows_and_carries_column_grants_over(
    fresh_database: str,
) -> None:
    # A table as migration 0007 left it, with a row in it and roles granted
    # as `outbox-relay grant` did then: 0008 adds waiting_since empty for the
    # old row (it counts as before), new rows get their due time, and each
    # role keeps doing its job without being granted again.
    table = OutboxTable()
    producer, operator = (f"m8_{kind}_{uuid.uuid4().hex[:6]}" for kind in ("p", "o"))
    with psycopg.connect(fresh_database, autocommit=True) as conn:
        outbox_relay.migrate(conn)
        conn.execute("ALTER TABLE outbox DROP COLUMN waiting_since")
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE version = 8").format(table.related("migrations"))
        )
        old = conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
            " VALUES ('o', '1', 'e', '{}') RETURNING id"
        ).fetchone()[0]  # type: ignore[index]
        for role in (producer, operator):
            conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        # The grants of 0.x before this migration, as `outbox-relay grant` wrote them.
        conn.execute(
            sql.SQL(
                "GRANT INSERT (aggregate_type, aggregate_id, event_type, payload, headers,"
                " operation_key, ordered, available_at, content_hash) ON outbox TO {}"
            ).format(sql.Identifier(producer))
        )
        conn.execute(
            sql.SQL(
                "GRANT SELECT (id, status, available_at, attempts), UPDATE (status, available_at,"
                " attempts) ON outbox TO {}"
            ).format(sql.Identifier(operator))
        )
        try:
            assert outbox_relay.migrate(conn) == [8]
            new = outbox_relay.enqueue(
                conn, aggregate_type="o", aggregate_id="2", event_type="e", payload={},
                delay=timedelta(minutes=5),
            )  # fmt: skip
            rows = dict(
                conn.execute("SELECT id, waiting_since = available_at FROM outbox").fetchall()
            )
            privileges = {
                (role, kind): conn.execute(
                    "SELECT has_column_privilege(%s, 'outbox', 'waiting_since', %s)", (role, kind)
                ).fetchone()[0]  # type: ignore[index]
                for role in (producer, operator)
                for kind in ("INSERT", "SELECT", "UPDATE")
            }
        finally:
            for role in (producer, operator):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    assert rows == {old: None, new: True}
    assert privileges == {
        (producer, "INSERT"): True,
        (producer, "SELECT"): False,
        (producer, "UPDATE"): False,
        (operator, "INSERT"): False,
        (operator, "SELECT"): True,
        (operator, "UPDATE"): True,
    }
