"""The ORM integrations against real PostgreSQL: the message commits and rolls
back with the business change.

SQLAlchemy runs in-process; Django, whose settings are process-global, runs
in a subprocess (tests/apps/django_check.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from outbox_relay import NewMessage
from outbox_relay.integrations.sqlalchemy import enqueue, enqueue_many

from .apps import kit

ROOT = Path(__file__).resolve().parent.parent


def event(order: int) -> dict[str, Any]:
    return {
        "aggregate_type": "order",
        "aggregate_id": order,
        "event_type": "order.created",
        "payload": {"id": order},
    }


@pytest.fixture
def engine(dsn: str) -> Iterator[Engine]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY, total int)")
    # creator: the fixture's DSN may be a unix-socket conninfo; an application
    # would write create_engine("postgresql+psycopg://user:pw@host/db").
    made = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
    yield made
    made.dispose()


def rows(dsn: str) -> tuple[list[int], list[str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        orders = [r[0] for r in conn.execute("SELECT id FROM orders ORDER BY id")]
        outbox = [r[0] for r in conn.execute("SELECT aggregate_id FROM outbox ORDER BY id")]
    return orders, outbox


def test_sqlalchemy_session_commit_keeps_order_and_message(engine: Engine, dsn: str) -> None:
    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO orders VALUES (1, 10)"))
        message_id = enqueue(session, **event(1))
        assert message_id > 0
        # Not visible to anyone else before the commit.
        assert rows(dsn) == ([], [])
    assert rows(dsn) == ([1], ["1"])


def test_sqlalchemy_session_rollback_drops_both(engine: Engine, dsn: str) -> None:
    with Session(engine) as session:
        session.execute(text("INSERT INTO orders VALUES (2, 20)"))
        enqueue(session, **event(2))
        session.rollback()
    assert rows(dsn) == ([], [])


def test_sqlalchemy_message_first_then_order(engine: Engine, dsn: str) -> None:
    # enqueue may be the transaction's first statement (autobegin), and a
    # failure after it still takes the message back.
    with (
        pytest.raises(Exception, match="duplicate key"),
        Session(engine) as session,
        session.begin(),
    ):
        enqueue(session, **event(3))
        session.execute(text("INSERT INTO orders VALUES (3, 30), (3, 30)"))
    assert rows(dsn) == ([], [])


def test_sqlalchemy_connection_commit_and_rollback(engine: Engine, dsn: str) -> None:
    with engine.connect() as conn:
        # No statement before enqueue: it must begin SQLAlchemy's transaction,
        # or commit() below would have nothing to commit.
        enqueue(conn, **event(4))
        conn.commit()
        enqueue_many(conn, [NewMessage(**event(5)), NewMessage(**event(6))])
        conn.execute(text("INSERT INTO orders VALUES (5, 50)"))
        conn.rollback()
    assert rows(dsn) == ([], ["4"])


def test_the_core_api_given_a_session_names_the_call_that_takes_one(engine: Engine) -> None:
    """outbox_relay.enqueue(session, ...) failed with "'Session' object has no
    attribute 'autocommit'"; apply_async takes a Session, so people try."""
    import outbox_relay
    from outbox_relay.integrations.sqlalchemy import psycopg_connection

    with Session(engine) as session, session.begin():
        with pytest.raises(
            outbox_relay.InvalidMessage,
            match=r"outbox_relay.enqueue needs a psycopg 3 connection, not Session; .*"
            r"outbox_relay.integrations.sqlalchemy.enqueue\(session",
        ):
            outbox_relay.enqueue(session, **event(1))
        with pytest.raises(outbox_relay.InvalidMessage, match=r"psycopg_connection\(session\)"):
            outbox_relay.migrate(session)
        # What the message says works.
        assert outbox_relay.migrate(psycopg_connection(session)) == []
        assert outbox_relay.enqueue(psycopg_connection(session), **event(1)) > 0


def test_sqlalchemy_rejects_other_drivers() -> None:
    sqlite = create_engine("sqlite://")
    with Session(sqlite) as session, pytest.raises(TypeError, match=r"postgresql\+psycopg"):
        enqueue(session, **event(1))
    with pytest.raises(TypeError, match="Session or Connection"):
        enqueue(object(), **event(1))  # type: ignore[arg-type]


def test_django_atomic_commit_and_rollback(dsn: str) -> None:
    found = kit.module_json("tests.apps.django_check", dsn)
    # The rolled-back order 2 and its message are both gone.
    assert found["orders"] == [1]
    assert sorted(found["outbox"].values()) == ["1", "3", "4", "5"]
    assert str(found["committed"]) in found["outbox"]
    assert str(found["rolled_back"]) not in found["outbox"]
    assert str(found["alone"]) in found["outbox"]
    assert len(found["many"]) == 2
    assert found["in_atomic_after"] is False
    # enqueue without using= writes where the relay reads (OUTBOX_DATABASE):
    # rolled back with that alias's transaction.
    assert str(found["unnamed"]) not in found["outbox"]
    # The relay connects with the alias's libpq OPTIONS (sslmode was dropped:
    # a silent downgrade from sslmode=require), not Django's own.
    assert found["relay_dsn"]["sslmode"] == "prefer"
    assert found["relay_dsn"]["application_name"] == "shop-other"
    assert "isolation_level" not in found["relay_dsn"]
    # install(beat=False, task_options=...) as outbox_relay.install takes them.
    assert found["task_options"] == {"max_retries": 3}
    assert found["beat_entries"] == []
