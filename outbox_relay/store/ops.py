"""What operators run: status, dead letters, retention, metrics gauges, grants.

The statements behind ``outbox-relay`` (the CLI), the metrics exporter, the
purge task and the demo; their SQL is ``sql/operations.sql``. None is on the
delivery hot path. ``outbox_relay.operations`` is the same API under the name
operators import.

Only ``dead`` rows are touched by the dead-letter functions, and none of them
changes ``lease_version``: it is the fencing token and only ever grows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from ..table import OutboxTable
from ._base import MAX_ERROR_LENGTH, TableLike, queries, statement_tx, tableless
from .relay import promote

__all__ = [
    "RATE_WINDOW",
    "STATS_KEYS",
    "DeadFilter",
    "DeadRow",
    "PurgeResult",
    "QueueGauges",
    "RetryingRow",
    "RoleKind",
    "attempts_distribution",
    "create_demo_orders",
    "dead_count",
    "dead_list",
    "dead_retry",
    "dead_skip",
    "done_recently",
    "gauges",
    "get_row",
    "grants",
    "insert_demo_order",
    "outbox_tables",
    "purge",
    "retrying_list",
    "stats",
    "status",
]

RoleKind = Literal["producer", "relay", "operator"]
# The grant query of each kind (sql/operations.sql).
_GRANT_QUERIES = {
    "producer": "op_grant_producer",
    "relay": "op_grant_relay",
    "operator": "op_grant_operator",
}
# status()'s rate: messages done within this long of now.
RATE_WINDOW = timedelta(minutes=1)
STATS_KEYS = (
    "pending",
    "processing",
    "done",
    "dead",
    "oldest_pending_age_seconds",
    "expired_leases",
)


# ---------------------------------------------------------------- status
def _read_stats(
    conn: psycopg.Connection[Any],
    table: OutboxTable,
    now: datetime | None,
    exact_done_below: int | None,
) -> dict[str, Any]:
    params = {
        "now": now,
        "schema": table.schema,
        "name": table.name,
        "exact_done_below": exact_done_below,
    }
    cur = conn.execute(queries(table).op_stats, params)
    row = cur.fetchone()
    assert row is not None  # an aggregate always returns one row
    return dict(zip([d.name for d in cur.description or []], row))


def stats(
    conn: psycopg.Connection[Any], *, table: TableLike = None, now: datetime | None = None
) -> dict[str, Any]:
    """Exact counts per status, ``oldest_pending_age_seconds`` and ``expired_leases``."""
    outbox = OutboxTable.parse(table)
    with statement_tx(conn):
        found = _read_stats(conn, outbox, now, exact_done_below=None)
    return {key: found[key] for key in STATS_KEYS}


def get_row(
    conn: psycopg.Connection[Any], message_id: int, *, table: TableLike = None
) -> dict[str, Any] | None:
    """One row with every column, or None."""
    with statement_tx(conn):
        cur = conn.execute(queries(table).op_get_row, {"id": message_id})
        row = cur.fetchone()
        names = [d.name for d in cur.description or []]
    return dict(zip(names, row)) if row else None


def attempts_distribution(
    conn: psycopg.Connection[Any], *, table: TableLike = None
) -> dict[int, int]:
    """``{attempts: messages}`` over the pending and processing rows."""
    with statement_tx(conn):
        rows = conn.execute(queries(table).op_attempts_distribution).fetchall()
    return {int(attempts): int(n) for attempts, n in rows}


def done_recently(
    conn: psycopg.Connection[Any],
    *,
    within: timedelta = RATE_WINDOW,
    table: TableLike = None,
    now: datetime | None = None,
) -> int:
    """How many messages were finished (``done``, skips included) within ``within`` of now."""
    with statement_tx(conn):
        row = conn.execute(
            queries(table).op_done_recently, {"within": within, "now": now}
        ).fetchone()
    assert row is not None  # an aggregate always returns one row
    return int(row[0])


def status(
    conn: psycopg.Connection[Any], *, table: TableLike = None, now: datetime | None = None
) -> dict[str, Any]:
    """What ``outbox-relay status --json`` prints: ``stats()`` plus ``attempts``
    (an object keyed by the attempt count as a string, as JSON needs),
    ``in_flight`` (processing rows whose lease is live: what the in-flight cap
    counts), ``done_last_minute`` (``done_recently``) and ``parked`` (pending
    ordered rows waiting behind an earlier message of their aggregate).
    ``oldest_pending_age_seconds`` is None when nothing awaits delivery (the
    query's 0; the gauge keeps the 0)."""
    found = stats(conn, table=table, now=now)
    attempts = attempts_distribution(conn, table=table)
    recent = done_recently(conn, table=table, now=now)
    with statement_tx(conn):
        row = conn.execute(queries(table).op_parked, {"now": now}).fetchone()
    return {
        **{key: int(found[key]) for key in ("pending", "processing", "done", "dead")},
        # Of the pending ones, those waiting behind an earlier message of
        # their aggregate (a dead one, or one in flight): nothing to do for
        # them but for that message.
        "parked": int(row[0]) if row else 0,
        "oldest_pending_age_seconds": float(found["oldest_pending_age_seconds"]) or None,
        "expired_leases": int(found["expired_leases"]),
        "in_flight": int(found["processing"]) - int(found["expired_leases"]),
        "done_last_minute": recent,
        "attempts": {str(k): v for k, v in sorted(attempts.items())},
    }


# ---------------------------------------------------------------- dead letters
@dataclass(frozen=True)
class DeadFilter:
    """Which dead rows to act on; ``None`` fields match everything.

    ``older_than`` compares ``created_at``: the table records when a message
    was written, not when it died (no column holds that: a dead row's
    ``done_at`` is NULL), so it selects messages *written* longer ago.
    """

    event_type: str | None = None
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    older_than: timedelta | None = None

    def params(self) -> dict[str, Any]:
        return {
            "event_type": self.event_type,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "older_than": self.older_than,
        }


def _as_json(row: Any) -> dict[str, Any]:
    """A listed row's fields for ``--json``: times in ISO 8601."""
    return {
        name: value.isoformat() if isinstance(value, datetime) else value
        for name, value in asdict(row).items()
    }


@dataclass(frozen=True)
class DeadRow:
    """One dead message as ``dead list`` shows it (payloads stay in the database:
    they may hold personal data, and the id is enough to look one up)."""

    id: int
    aggregate_type: str
    aggregate_id: str
    event_type: str
    attempts: int
    lease_version: int
    created_at: datetime
    last_error: str | None
    operation_key: str | None

    def as_json(self) -> dict[str, Any]:
        return _as_json(self)


def dead_list(
    conn: psycopg.Connection[Any],
    *,
    where: DeadFilter | None = None,
    limit: int = 50,
    table: TableLike = None,
    now: datetime | None = None,
) -> list[DeadRow]:
    """Dead messages matching ``where``, by id, at most ``limit``."""
    params = {**(where or DeadFilter()).params(), "limit": max(0, limit), "now": now}
    with statement_tx(conn):
        rows = conn.execute(queries(table).op_dead_list, params).fetchall()
    return [DeadRow(*row) for row in rows]


@dataclass(frozen=True)
class RetryingRow:
    """One message waiting for its next attempt, as ``retrying`` shows it."""

    id: int
    aggregate_type: str
    aggregate_id: str
    event_type: str
    attempts: int
    created_at: datetime
    # Seconds until the next attempt is due (0 or less: due now).
    due_in_seconds: float
    last_error: str | None

    def as_json(self) -> dict[str, Any]:
        return _as_json(self)


def retrying_list(
    conn: psycopg.Connection[Any],
    *,
    limit: int = 50,
    table: TableLike = None,
    now: datetime | None = None,
) -> list[RetryingRow]:
    """Messages waiting for another attempt after a failed one, the next due first."""
    params = {"limit": max(0, limit), "now": now}
    with statement_tx(conn):
        rows = conn.execute(queries(table).op_retrying_list, params).fetchall()
    return [RetryingRow(*row) for row in rows]


def dead_count(
    conn: psycopg.Connection[Any],
    *,
    where: DeadFilter | None = None,
    table: TableLike = None,
    now: datetime | None = None,
) -> int:
    """How many dead messages match ``where`` (``dead_list`` shows a page of them)."""
    params = {**(where or DeadFilter()).params(), "now": now}
    with statement_tx(conn):
        row = conn.execute(queries(table).op_dead_count, params).fetchone()
    assert row is not None  # an aggregate always returns one row
    return int(row[0])


def _selection(
    verb: str,
    ids: Collection[int] | None,
    all_dead: bool,
    where: DeadFilter | None,
    limit: int | None,
) -> dict[str, Any] | None:
    """The parameters that pick the rows of ``dead_retry`` / ``dead_skip``;
    None when ``ids`` is empty (nothing to do)."""
    if all_dead and ids is not None:
        raise ValueError(f"give dead_{verb} ids or all_dead=True, not both")
    if not all_dead and ids is None:
        raise ValueError(f"give dead_{verb} the ids to {verb}, or all_dead=True")
    if limit is not None and limit <= 0:
        raise ValueError("limit must be greater than 0 (None: no limit)")
    if ids is not None and not ids:
        return None
    return {
        **(where or DeadFilter()).params(),
        "ids": None if ids is None else sorted({int(i) for i in ids}),
        "limit": limit,
    }


def _changed_and_notified(
    conn: psycopg.Connection[Any], query: str, params: dict[str, Any], table: TableLike
) -> list[int]:
    with conn.transaction():
        rows = conn.execute(query, params).fetchall()
        # op_dead_skip says which rows were marked ordered: their successors
        # may be parked (queries.sql, claim_parking).
        promote(
            conn, [r[0] for r in rows if len(r) > 1 and r[1]], table=table, now=params.get("now")
        )
        if rows:
            # Wake LISTENing workers now rather than at the next beat tick:
            # retried rows are due, and a skipped head frees its successors.
            outbox = OutboxTable.parse(table)
            conn.execute(queries(outbox).notify, {"channel": outbox.channel})
    return sorted(int(r[0]) for r in rows)


def dead_retry(
    conn: psycopg.Connection[Any],
    ids: Collection[int] | None = None,
    *,
    all_dead: bool = False,
    where: DeadFilter | None = None,
    limit: int | None = None,
    spread: timedelta = timedelta(0),
    table: TableLike = None,
    now: datetime | None = None,
) -> list[int]:
    """Send dead rows back to ``pending`` with ``attempts`` reset to 0.

    Give ``ids``, or ``all_dead=True`` (every dead row, narrowed by ``where``;
    the oldest ``limit`` of them when given). They are due now, or spread
    evenly over ``spread`` in id order, so a receiver that just recovered is
    not sent the whole backlog at once. ``last_error`` is kept: it says why
    the row died until the next attempt records its own result. Returns the
    ids changed; an id missing from the result was not dead (or does not exist).
    """
    if spread < timedelta(0):
        raise ValueError("spread must not be negative")
    params = _selection("retry", ids, all_dead, where, limit)
    if params is None:
        return []
    params.update(spread=spread, now=now)
    return _changed_and_notified(conn, queries(table).op_dead_retry, params, table)


def dead_skip(
    conn: psycopg.Connection[Any],
    ids: Collection[int] | None = None,
    *,
    all_dead: bool = False,
    where: DeadFilter | None = None,
    limit: int | None = None,
    table: TableLike = None,
    now: datetime | None = None,
) -> list[int]:
    """Mark dead rows ``done`` without delivering them (unblocks an ordered aggregate).

    Give ``ids``, or ``all_dead=True`` (every dead row, narrowed by ``where``;
    the oldest ``limit`` of them when given), as for ``dead_retry``.
    ``last_error`` records that an operator skipped the row; it is never sent.
    Returns the ids changed.
    """
    params = _selection("skip", ids, all_dead, where, limit)
    if params is None:
        return []
    params.update(max_error=MAX_ERROR_LENGTH, now=now)
    return _changed_and_notified(conn, queries(table).op_dead_skip, params, table)


# ---------------------------------------------------------------- retention
@dataclass(frozen=True)
class PurgeResult:
    deleted: int
    batches: int
    cutoff: datetime
    # Stopped by max_batches after a full batch: more old rows may be left.
    more_left: bool = False


def purge(
    conn: psycopg.Connection[Any],
    *,
    older_than: timedelta,
    batch_size: int = 5000,
    max_batches: int | None = None,
    table: TableLike = None,
    now: datetime | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> PurgeResult:
    """Delete ``done`` rows whose ``done_at`` is older than ``older_than``.

    Works in batches of ``batch_size`` rows, each committed on its own, so no
    statement holds many locks or writes a burst of WAL, and concurrent
    purges share the work (SKIP LOCKED). Stops when a batch comes back short,
    or after ``max_batches`` (a periodic task then continues next run).
    ``on_batch`` is called with each batch's count. Only ``done`` rows are
    ever deleted: pending, processing and dead rows are not retention's
    business.

    Needs a connection outside a transaction: inside one, the batches would
    be savepoints of a single long transaction, which defeats the point.
    """
    if batch_size <= 0:
        raise ValueError("batch_size must be greater than 0")
    if older_than < timedelta(0):
        raise ValueError("older_than must not be negative")
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise ValueError("purge commits batch by batch: call it outside a transaction")
    q = queries(table)
    with conn.transaction():
        row = conn.execute(q.op_purge_cutoff, {"now": now, "older_than": older_than}).fetchone()
    assert row is not None
    cutoff: datetime = row[0]
    deleted = batches = 0
    more_left = False
    while max_batches is None or batches < max_batches:
        with conn.transaction():
            cur = conn.execute(q.op_purge_done, {"cutoff": cutoff, "batch": batch_size})
        batches += 1
        count = max(cur.rowcount, 0)
        deleted += count
        if on_batch is not None:
            on_batch(count)
        more_left = count == batch_size
        if not more_left:
            break
    return PurgeResult(deleted=deleted, batches=batches, cutoff=cutoff, more_left=more_left)


# ---------------------------------------------------------------- metrics
@dataclass(frozen=True)
class QueueGauges:
    """The database side of the metrics, read in one scrape."""

    pending: int
    processing: int
    done: int
    dead: int
    expired_leases: int
    oldest_pending_age_seconds: float
    done_estimated: bool


def gauges(
    conn: psycopg.Connection[Any],
    *,
    table: TableLike = None,
    exact_done_below: int = 100_000,
    timeout_ms: int = 5000,
    now: datetime | None = None,
) -> QueueGauges:
    """Counts for a metrics scrape, cheap however many rows are done.

    The same query as ``stats()``, except that ``done`` is counted exactly
    only while the table holds fewer than ``exact_done_below`` rows (by the
    planner's estimate), and above that estimated as ``pg_class.reltuples``
    minus the other statuses, which autovacuum keeps within a few percent.
    """
    outbox = OutboxTable.parse(table)
    with conn.transaction():
        # A scrape must never pile up behind a lock or a slow disk.
        conn.execute(queries(outbox).op_scrape_timeout, {"timeout": f"{int(timeout_ms)}ms"})
        found = _read_stats(conn, outbox, now, exact_done_below=exact_done_below)
    unfinished = int(found["pending"]) + int(found["processing"]) + int(found["dead"])
    estimated = found["done"] is None
    done = max(int(found["reltuples"]) - unfinished, 0) if estimated else int(found["done"])
    return QueueGauges(
        pending=int(found["pending"]),
        processing=int(found["processing"]),
        done=done,
        dead=int(found["dead"]),
        expired_leases=int(found["expired_leases"]),
        oldest_pending_age_seconds=float(found["oldest_pending_age_seconds"]),
        done_estimated=estimated,
    )


# ---------------------------------------------------------------- schema
def outbox_tables(conn: psycopg.Connection[Any]) -> list[str]:
    """``schema.name`` of every outbox table in the database (one that has its
    ``<name>_migrations`` table beside it), sorted; for a mistyped ``--table``."""
    with statement_tx(conn):
        rows = conn.execute(tableless().op_outbox_tables).fetchall()
    return [f"{schema}.{name}" for schema, name in rows]


# ---------------------------------------------------------------- grants
def grants(role: str, kind: RoleKind, *, table: TableLike = None) -> str:
    """The least-privilege GRANT statements for ``role``, as SQL text to review.

    ``producer``: what ``enqueue`` needs, and no payload of another message.
    ``relay``: what workers and beat need; they change only the dispatcher's
    columns. ``operator``: ``status``, ``dead list|retry|skip``, ``purge`` and
    the metrics exporter, without reading message contents. The role is
    quoted as an identifier, so any name is safe to pass. Nothing is executed.
    """
    if kind not in _GRANT_QUERIES:
        raise ValueError(f"kind must be one of {', '.join(_GRANT_QUERIES)}, not {kind!r}")
    if not role:
        raise ValueError("role must not be empty")
    text = getattr(queries(table), _GRANT_QUERIES[kind])
    # The role is filled in by a second pass: the first (the query loader)
    # only knows the table's identifiers and left {role} in place.
    return str(sql.SQL(text).format(role=sql.Identifier(role)).as_string()) + ";\n"


# ---------------------------------------------------------------- demo shop
def create_demo_orders(conn: psycopg.Connection[Any], *, table: TableLike = None) -> str:
    """``outbox-relay demo``: the shop's orders table beside ``table``; returns its name."""
    outbox = OutboxTable.parse(table)
    with statement_tx(conn):
        conn.execute(queries(outbox).op_demo_orders_create)
    return f"{outbox.schema}.demo_orders"


def insert_demo_order(
    conn: psycopg.Connection[Any], *, customer: str, total_cents: int, table: TableLike = None
) -> int:
    """One demo order, in the caller's transaction (with its outbox event); its id."""
    params = {"customer": customer, "total_cents": total_cents}
    row = conn.execute(queries(table).op_demo_order_insert, params).fetchone()
    assert row is not None
    return int(row[0])
