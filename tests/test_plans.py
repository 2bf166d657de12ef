"""Query-plan regression tests for the hot path.

A queue table fills with finished rows; the hot queries must not notice.
These tests read ``EXPLAIN (FORMAT JSON)`` of the exact SQL the store runs
(``queries_for``), with literal parameters bound client-side, and fail when
a plan walks the table or the wrong index:

* claim walks ``outbox_ready`` for due pending rows and counts live leases
  through ``outbox_leased``; the look-up of the next row not due yet
  probes ``outbox_ready`` too; the rescuer walks ``outbox_leased`` for expired
  leases; neither ever walks past the million finished rows;
* the fenced statements (finalize, lease renewal, the fence check before a
  publish) probe the primary key, never a partial index: see the comment on
  ``finalize`` in ``sql/queries.sql`` for the thin-statistics trap.

Timing is reported, never asserted (that belongs in ``benchmarks/``).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import ClientCursor
from psycopg.conninfo import make_conninfo

from outbox_relay import OutboxTable, store
from outbox_relay.model import Outcome
from outbox_relay.sql.queries import queries_for

Q = queries_for(OutboxTable())
FINISHED_ROWS = 1_000_000
PENDING_ROWS = 300
PROCESSING_ROWS = 200
LEASE = timedelta(seconds=60)
PARTIAL_INDEXES = {
    "outbox_ready",
    "outbox_leased",
    "outbox_unfinished_agg",
    "outbox_operation_key",
    "outbox_done",
}


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def big_dsn(pg_admin_dsn: str, pg_template: str) -> Iterator[str]:
    """A migrated database whose outbox holds a million finished rows.

    Built once for the module (one INSERT ... SELECT generate_series, then
    ANALYZE), plus a few hundred pending and processing rows, some of them
    with expired leases.
    """
    name = f"outbox_plans_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_admin_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    dsn = make_conninfo(pg_admin_dsn, dbname=name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            # Keep autovacuum's ANALYZE from changing the statistics mid-module.
            conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
            conn.execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload,"
                " status, available_at, attempts, lease_version, created_at, done_at)"
                " SELECT 'order', (g %% 50000)::text, 'order.paid', '{}'::jsonb, 'done',"
                " now() - interval '1 hour', 1, 1, now() - interval '1 hour', now()"
                " FROM generate_series(1, %s) AS g",
                (FINISHED_ROWS,),
            )
            add_live_rows(conn)
            conn.execute("ANALYZE outbox")
        yield dsn
    finally:
        with psycopg.connect(pg_admin_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def big(big_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(big_dsn, autocommit=True) as conn:
        yield conn


def add_live_rows(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'order', g::text, 'order.paid', '{}'::jsonb FROM generate_series(1, %s) AS g",
        (PENDING_ROWS,),
    )
    # Half of the leases already expired.
    conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status,"
        " lease_owner, lease_until, lease_version, attempts)"
        " SELECT 'order', g::text, 'order.paid', '{}'::jsonb, 'processing', 'w',"
        " now() + (g %% 2 * 2 - 1) * interval '1 minute', 1, 1"
        " FROM generate_series(1, %s) AS g",
        (PROCESSING_ROWS,),
    )


# ---------------------------------------------------------------- plan reading
def explain(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> dict[str, Any]:
    """The JSON plan of ``query`` with ``params`` inlined as literals."""
    with ClientCursor(conn) as cur:
        cur.execute("EXPLAIN (FORMAT JSON) " + query, params)
        row = cur.fetchone()
    assert row is not None
    plan: dict[str, Any] = row[0][0]["Plan"]
    return plan


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def subplan(plan: dict[str, Any], name: str) -> dict[str, Any]:
    for node in nodes(plan):
        if node.get("Subplan Name") == name:
            return node
    raise AssertionError(f"no {name!r} in the plan:\n{describe(plan)}")


def outbox_scans(plan: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(node type, index) of every node that reads the outbox table or its indexes."""
    found = []
    for node in nodes(plan):
        index = node.get("Index Name")
        if node.get("Relation Name") == "outbox" or (index and index.startswith("outbox_")):
            # A Bitmap Heap Scan reads the heap pages its Bitmap Index Scan
            # children chose: those children name the index it walks.
            if node["Node Type"] in ("ModifyTable", "LockRows", "Bitmap Heap Scan"):
                continue
            found.append((node["Node Type"], index))
    return found


def describe(plan: dict[str, Any], depth: int = 0) -> str:
    """A compact text rendering of a JSON plan, for failure messages."""
    parts = [plan["Node Type"]]
    for key in ("Subplan Name", "Relation Name", "Index Name", "Index Cond", "Filter"):
        if key in plan:
            parts.append(f"{key}={plan[key]}")
    lines = ["  " * depth + " ".join(parts)]
    for child in plan.get("Plans", []):
        lines.append(describe(child, depth + 1))
    return "\n".join(lines)


def without_initplans(plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` minus its InitPlans (the claim's live-lease count in its LIMIT)."""
    children = [
        without_initplans(child)
        for child in plan.get("Plans", [])
        if not child.get("Subplan Name", "").startswith("InitPlan")
    ]
    return {**plan, "Plans": children}


def assert_walks_only(plan: dict[str, Any], branch: str, index: str) -> None:
    """The CTE ``branch`` reads the table only through ``index``."""
    scans = outbox_scans(without_initplans(subplan(plan, branch)))
    assert scans, f"{branch} reads no outbox index:\n{describe(plan)}"
    # The first scan is the branch's own; any later ones are NOT EXISTS probes.
    kind, used = scans[0]
    assert kind in ("Index Scan", "Index Only Scan"), describe(plan)
    assert used == index, f"{branch} walks {used}, not {index}:\n{describe(plan)}"


def assert_probes_primary_key(plan: dict[str, Any]) -> None:
    scans = outbox_scans(plan)
    assert scans, describe(plan)
    for kind, index in scans:
        assert kind in ("Index Scan", "Index Only Scan") and index == "outbox_pkey", (
            f"fenced statement reads the outbox with {kind} {index or ''}, "
            f"not the primary key:\n{describe(plan)}"
        )


# ---------------------------------------------------------------- parameters
def claim_params(ordered: bool | list[str] = False) -> dict[str, Any]:
    return {
        "owner": "w",
        "batch": 50,
        "lease": LEASE,
        "max_attempts": 12,
        "count_attempt": 0,
        "content": False,
        "now": None,
        "all_ordered": ordered is True,
        "ordered_types": [] if isinstance(ordered, bool) else ordered,
        "follow_queue": None,
        "hold": timedelta(seconds=2),
    }


def one_params(message_id: int) -> dict[str, Any]:
    """Parameters of the single-message statements (finalize_one, begin_one)."""
    return {
        "id": message_id,
        "version": 1,
        "needed": timedelta(seconds=10),
        "count_attempt": 1,
        "chain_only": False,
        "status": "done",
        "delay": timedelta(0),
        "refund": 0,
        "error": None,
        "unless_begun": False,
        "now": None,
    }


def finalize_params(ids: list[int]) -> dict[str, Any]:
    n = len(ids)
    return {
        "ids": ids,
        "versions": [1] * n,
        "statuses": ["done"] * n,
        "delays": [timedelta(0)] * n,
        "refunds": [0] * n,
        "errors": [None] * n,
        "unless_begun": [False] * n,
        "now": None,
    }


def fence_params(ids: list[int]) -> dict[str, Any]:
    return {"ids": ids, "versions": [1] * len(ids), "lease": LEASE, "now": None}


def live_ids(conn: psycopg.Connection[Any], n: int) -> list[int]:
    rows = conn.execute(
        "SELECT id FROM outbox WHERE status = 'processing' ORDER BY id LIMIT %s", (n,)
    ).fetchall()
    return [r[0] for r in rows]


# ---------------------------------------------------------------- a million finished rows
def test_fixture_holds_a_million_finished_rows(big: psycopg.Connection[Any]) -> None:
    row = big.execute(
        "SELECT reltuples FROM pg_class WHERE oid = 'public.outbox'::regclass"
    ).fetchone()
    assert row is not None and row[0] >= FINISHED_ROWS


def test_claim_walks_the_ready_index(big: psycopg.Connection[Any]) -> None:
    # The in-flight count the claim is limited by (store.claim_batch) is
    # in_flight's, on the leased index: test_in_flight_count_walks_the_leased_index.
    plan = explain(big, Q.claim, claim_params())
    assert_walks_only(plan, "CTE ready", "outbox_ready")
    assert "Seq Scan" not in {kind for kind, _ in outbox_scans(plan)}, describe(plan)


@pytest.mark.parametrize("name", ["claim", "claim_parking"])
def test_a_claim_that_leaves_rows_for_durable_runs_walks_the_live_indexes(
    big: psycopg.Connection[Any], name: str
) -> None:
    """The Celery relay's claim (follow_queue set, queries.sql frag_held):
    its walk is the ready index still; what it picks to send of a following
    task's young rows walks the ready index from the hold's start, and its
    count of queued messages the leased index."""
    plan = explain(big, getattr(Q, name), {**claim_params(), "follow_queue": 16})
    assert_walks_only(plan, "CTE ready" if name == "claim" else "CTE walked", "outbox_ready")
    scans = outbox_scans(plan)
    live = {"outbox_ready", "outbox_leased", "outbox_pkey", "outbox_unfinished_agg"}
    assert {index for _, index in scans} <= live, describe(plan)
    assert {kind for kind, _ in scans} <= {"Index Scan", "Index Only Scan"}, describe(plan)
    assert "outbox_leased" in {index for _, index in scans}, describe(plan)


@pytest.mark.parametrize("ordered", [True, ["order.paid"]], ids=["all-types", "listed"])
def test_ordered_claim_walks_the_same_indexes_and_probes_unfinished_rows(
    big: psycopg.Connection[Any], ordered: bool | list[str]
) -> None:
    plan = explain(big, Q.claim, claim_params(ordered))
    assert_walks_only(plan, "CTE ready", "outbox_ready")
    scans = outbox_scans(plan)
    assert "Seq Scan" not in {kind for kind, _ in scans}, describe(plan)
    # The "earlier unfinished message?" probe uses the per-aggregate index,
    # which holds no finished rows.
    assert "outbox_unfinished_agg" in {index for _, index in scans}, describe(plan)


def test_rescue_walks_the_leased_index(big: psycopg.Connection[Any]) -> None:
    plan = explain(big, Q.rescue, {"max_attempts": 12, "batch": 1000, "now": None})
    scans = outbox_scans(plan)
    assert scans[0] == ("Index Scan", "outbox_leased"), describe(plan)
    assert "Seq Scan" not in {kind for kind, _ in scans}, describe(plan)


def test_in_flight_count_walks_the_leased_index(big: psycopg.Connection[Any]) -> None:
    plan = explain(big, Q.in_flight, {"now": None})
    assert {index for _, index in outbox_scans(plan)} == {"outbox_leased"}, describe(plan)


def test_next_due_probes_the_ready_index(big: psycopg.Connection[Any]) -> None:
    """The look-up after a claim that was not full (celery/wake.py)."""
    for follow_queue in (None, 16):
        params = {"now": None, "follow_queue": follow_queue, "hold": timedelta(seconds=2)}
        plan = explain(big, Q.next_due, params)
        assert {index for _, index in outbox_scans(plan)} == {"outbox_ready"}, describe(plan)


def test_dead_list_reads_the_dead_rows_not_the_table(big: psycopg.Connection[Any]) -> None:
    """`outbox-relay dead list` during an incident: with dead rows a fraction
    of a percent of the table and fresh statistics, "ORDER BY id LIMIT 50"
    on the table walked the primary key from the oldest id and filtered out
    every finished row before it found the dead ones (2.8 million rows, 1.1 s
    in a walkthrough; 6 s before a vacuum)."""
    big.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status,"
        " last_error, attempts) SELECT 'order', g::text, 'order.paid', '{}'::jsonb, 'dead',"
        " 'receiver down', 12 FROM generate_series(1, 8000) AS g"
    )
    big.execute("ANALYZE outbox")
    try:
        params = {
            "event_type": None,
            "aggregate_type": None,
            "aggregate_id": None,
            "older_than": None,
            "now": None,
            "limit": 50,
        }
        plan = explain(big, Q.op_dead_list, params)
        scans = outbox_scans(plan)
        assert scans and all(index != "outbox_pkey" for _, index in scans), describe(plan)
        assert "Seq Scan" not in {kind for kind, _ in scans}, describe(plan)
    finally:
        big.execute("DELETE FROM outbox WHERE status = 'dead'")
        big.execute("ANALYZE outbox")


@pytest.mark.parametrize("batch", [1, 50])
def test_fenced_statements_probe_the_primary_key(big: psycopg.Connection[Any], batch: int) -> None:
    ids = live_ids(big, batch)
    assert_probes_primary_key(explain(big, Q.finalize, finalize_params(ids)))
    assert_probes_primary_key(explain(big, Q.finalize_done, fence_params(ids)))
    assert_probes_primary_key(explain(big, Q.extend_lease, fence_params(ids)))
    begin = {
        "ids": ids,
        "versions": [1] * batch,
        "needed": timedelta(seconds=10),
        "count_attempt": 1,
        "chain_only": False,
        "now": None,
    }
    assert_probes_primary_key(explain(big, Q.begin, begin))
    # The per-message deliver task's own statements.
    assert_probes_primary_key(explain(big, Q.finalize_one, one_params(ids[0])))
    assert_probes_primary_key(explain(big, Q.begin_one, one_params(ids[0])))


def test_following_ordered_aggregates_probes_keys_not_finished_rows(
    big: psycopg.Connection[Any],
) -> None:
    """The delivery task's lease of the next messages of the ordered
    aggregates it has just finished (take_next), and the promote in the done
    before it: each row by its primary key, each aggregate's next row through
    outbox_unfinished_agg; never a walk of the finished rows, nor of the done
    index (a "status = 'done'" on the given ids let the planner choose it)."""
    rows = big.execute(
        "SELECT id FROM outbox WHERE status = 'done' ORDER BY id DESC LIMIT 50"
    ).fetchall()
    ids = [r[0] for r in rows]
    follow = {"ids": ids, "batch": 50, "owner": "w", "lease": LEASE, "max_attempts": 12}
    for query, params in ((Q.take_next, follow), (Q.promote, {"ids": ids})):
        plan = explain(big, query, {**params, "now": None})
        scans = outbox_scans(plan)
        assert {index for _, index in scans} == {"outbox_pkey", "outbox_unfinished_agg"}, describe(
            plan
        )
        assert {kind for kind, _ in scans} <= {"Index Scan", "Index Only Scan"}, describe(plan)


def take_params() -> dict[str, Any]:
    return {
        "batch": 50,
        "walk": 200,
        "cap": 1000,
        "budget": 1 << 20,
        "owner": "w",
        "lease": LEASE,
        "max_attempts": 12,
        "now": None,
    }


def assert_takes_through_the_live_indexes(plan: dict[str, Any]) -> None:
    """take_chunk: the walk on the ready index, the rows locked by their
    primary key, the live leases counted on the leased index."""
    scans = outbox_scans(plan)
    assert ("Index Scan", "outbox_ready") in scans, describe(plan)
    assert {index for _, index in scans} == {"outbox_ready", "outbox_pkey", "outbox_leased"}, (
        describe(plan)
    )
    # The live-lease count may be a bitmap scan of outbox_leased, as
    # in_flight's own plan may (test_in_flight_count_walks_the_leased_index;
    # relay sessions turn bitmap scans off, a pooler's do not): under a
    # generic plan the planner picks either. Everything else walks an index.
    for kind, index in scans:
        assert kind in ("Index Scan", "Index Only Scan") or (
            kind == "Bitmap Index Scan" and index == "outbox_leased"
        ), describe(plan)


def test_a_delivery_takes_its_next_chunk_without_walking_finished_rows(
    big: psycopg.Connection[Any],
) -> None:
    """A delivery task's own claim and begin of its next chunk (take_chunk,
    with a publisher that waits)."""
    assert_takes_through_the_live_indexes(explain(big, Q.take_chunk, take_params()))


def durable_params(message_id: int) -> dict[str, Any]:
    """done_and_take_durable's: a durable run's done and the take of its next row."""
    return {
        **one_params(message_id),
        "task": "shop.charge",
        "owner": "w",
        "lease": LEASE,
        "options": "{}",
        "max_attempts": 12,
    }


def assert_done_and_take_through_the_live_indexes(plan: dict[str, Any]) -> None:
    """The done by its primary key; the take's walk on the ready index and
    the row it locks by its primary key: no finished row read."""
    scans = outbox_scans(plan)
    assert ("Index Scan", "outbox_ready") in scans, describe(plan)
    for kind, index in scans:
        assert kind in ("Index Scan", "Index Only Scan"), describe(plan)
        assert index in ("outbox_ready", "outbox_pkey"), describe(plan)


def test_a_durable_run_takes_its_next_row_without_walking_finished_rows(
    big: psycopg.Connection[Any],
) -> None:
    """A durable task's run that follows its task: its done and its take."""
    [message_id] = live_ids(big, 1)
    plan = explain(big, Q.done_and_take_durable, durable_params(message_id))
    assert_done_and_take_through_the_live_indexes(plan)


def _to_positional(query: str) -> tuple[str, list[str]]:
    """``%(name)s`` (and binary ``%(name)b``) placeholders as ``$n``, for a server-side PREPARE."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)[sb]", number, query), names


def test_generic_plans_keep_the_same_paths(big: psycopg.Connection[Any]) -> None:
    # psycopg prepares a statement server-side once it ran a few times, and
    # PostgreSQL may then reuse a generic plan made without the parameter
    # values. Those plans must take the same paths.
    big.execute("SET plan_cache_mode = force_generic_plan")
    literals = {
        "ids": "'{1,2,3}'::bigint[]",
        "versions": "'{1,1,1}'::bigint[]",
        "statuses": "'{done,done,done}'::text[]",
        "delays": "'{0,0,0}'::interval[]",
        "refunds": "'{0,0,0}'::int[]",
        "errors": "'{NULL,NULL,NULL}'::text[]",
        "unless_begun": "'{f,f,f}'::bool[]",
        "now": "NULL::timestamptz",
        "owner": "'w'",
        "batch": "50",
        "lease": "'60 seconds'::interval",
        "max_attempts": "12",
        "count_attempt": "0",
        "chain_only": "false",
        "content": "false",
        "all_ordered": "false",
        "ordered_types": "'{}'::text[]",
        "follow_queue": "16",
        "hold": "'2 seconds'::interval",
        "needed": "'10 seconds'::interval",
        "walk": "200",
        "cap": "1000",
        "budget": "1048576",
        "id": "1",
        "version": "1",
        "status": "'done'",
        "delay": "'0 seconds'::interval",
        "refund": "0",
        "error": "NULL::text",
        "task": "'shop.charge'",
        "options": "'{}'",
    }
    plans = {}
    try:
        statements = ("finalize", "finalize_done", "extend_lease", "begin", "claim", "in_flight")
        for name in (*statements, "take_chunk", "done_and_take_durable"):
            text, names = _to_positional(getattr(Q, name))
            big.execute(f"PREPARE plan_{name} AS {text}")
            # The single-message statements take a flag, not finalize's array.
            scalar = {"unless_begun": "false"} if name == "done_and_take_durable" else {}
            args = ", ".join(scalar.get(n, literals[n]) for n in names)
            row = big.execute(f"EXPLAIN (FORMAT JSON) EXECUTE plan_{name}({args})").fetchone()
            assert row is not None
            plans[name] = row[0][0]["Plan"]
    finally:
        big.execute("DEALLOCATE ALL")
        big.execute("RESET plan_cache_mode")
    assert_probes_primary_key(plans["finalize"])
    assert_probes_primary_key(plans["finalize_done"])
    assert_probes_primary_key(plans["extend_lease"])
    assert_probes_primary_key(plans["begin"])
    assert_walks_only(plans["claim"], "CTE ready", "outbox_ready")
    assert {index for _, index in outbox_scans(plans["in_flight"])} == {"outbox_leased"}
    assert_takes_through_the_live_indexes(plans["take_chunk"])
    assert_done_and_take_through_the_live_indexes(plans["done_and_take_durable"])


# ---------------------------------------------------------------- thin statistics
def test_finalize_probes_the_primary_key_when_statistics_are_thin(
    conn: psycopg.Connection[Any],
) -> None:
    # The table was ANALYZEd while almost empty (nothing processing), then a
    # burst leased thousands of rows before the next ANALYZE. Statistics now
    # say "nothing is processing": a fence written as status = 'processing'
    # implies the partial indexes' predicates, and the planner then scans the
    # whole outbox_leased index on every finalize.
    conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
    conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status,"
        " done_at) SELECT 'o', g::text, 'e', '{}', 'done', now() FROM generate_series(1, 100) g"
    )
    conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'o', g::text, 'e', '{}' FROM generate_series(1, 3) g"
    )
    conn.execute("ANALYZE outbox")

    # Almost empty: a one-page table may be read whole, but never through a
    # partial index.
    tiny = explain(conn, Q.finalize, finalize_params([101]))
    used = {index for _, index in outbox_scans(tiny)}
    assert not used & PARTIAL_INDEXES, describe(tiny)

    conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status,"
        " lease_owner, lease_until, lease_version, attempts)"
        " SELECT 'o', g::text, 'e', '{}', 'processing', 'w', now() + interval '1 minute', 1, 1"
        " FROM generate_series(1, 10000) g"
    )
    ids = live_ids(conn, 10)
    for batch in (ids[:1], ids):
        assert_probes_primary_key(explain(conn, Q.finalize, finalize_params(batch)))
        assert_probes_primary_key(explain(conn, Q.finalize_done, fence_params(batch)))
        assert_probes_primary_key(explain(conn, Q.extend_lease, fence_params(batch)))
    assert_probes_primary_key(explain(conn, Q.finalize_one, one_params(ids[0])))

    # Control: the same statement fenced on status walks outbox_leased here,
    # so this set-up does reproduce the trap the test guards against.
    on_status = Q.finalize.replace("o.lease_until IS NOT NULL", "o.status = 'processing'")
    assert on_status != Q.finalize
    control = explain(conn, on_status, finalize_params(ids[:1]))
    assert "outbox_leased" in {index for _, index in outbox_scans(control)}, describe(control)


# ---------------------------------------------------------------- timing report
def _time_claim_finalize(conn: psycopg.Connection[Any], rounds: int, batch: int) -> float:
    """Seconds per claim + finalize round over freshly added pending rows."""
    conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)"
        " SELECT 'timing', g::text, 'e', '{}' FROM generate_series(1, %s) g",
        (rounds * batch,),
    )
    # Warm up (and let psycopg prepare the statements) before measuring.
    for _ in range(2):
        claimed = store.claim(conn, owner="t", batch=1, lease=LEASE)
        store.finalize(conn, [Outcome.done(m) for m in claimed])
    started = time.perf_counter()
    done = 0
    for _ in range(rounds - 1):
        claimed = store.claim(conn, owner="t", batch=batch, lease=LEASE)
        done += len(store.finalize(conn, [Outcome.done(m) for m in claimed]))
    elapsed = time.perf_counter() - started
    assert done == (rounds - 1) * batch
    return elapsed / (rounds - 1)


def test_report_claim_and_finalize_time_with_a_million_finished_rows(
    big: psycopg.Connection[Any],
    conn: psycopg.Connection[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    rounds, batch = 40, 10
    full = _time_claim_finalize(big, rounds, batch)
    empty = _time_claim_finalize(conn, rounds, batch)
    with capsys.disabled():
        print(
            f"\n[plans] claim+finalize of {batch} rows: {full * 1000:.2f} ms with "
            f"{FINISHED_ROWS:,} finished rows vs {empty * 1000:.2f} ms on an empty table "
            f"(x{full / empty:.2f})"
        )


def test_every_query_is_sent_without_its_comments_and_short_enough_to_cache() -> None:
    # psycopg converts a query's %(name)s placeholders to $n once and caches
    # it, for queries up to 4 KB (psycopg._queries.MAX_CACHED_STATEMENT_LENGTH).
    # The claim with its comments was 4.5 KB, converted anew on every claim.
    from psycopg import _queries

    from outbox_relay.sql.queries import raw_queries

    limit = getattr(_queries, "MAX_CACHED_STATEMENT_LENGTH", 4096)
    for name in raw_queries():
        text = getattr(Q, name)
        assert not re.search(r"^\s*--", text, re.MULTILINE), name
        assert len(text.encode()) <= limit, (name, len(text))
    # The comment lines go; the statement stays whole.
    assert "LIMIT %(batch)s::int" in Q.claim and "FOR UPDATE SKIP LOCKED" in Q.claim
