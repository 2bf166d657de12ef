"""The only module that talks to the outbox table.

Each function runs one named query from ``sql/queries.sql`` in its own short
transaction (a savepoint when the caller already has one open), takes an
optional ``table`` (default ``public.outbox``) and, where time matters, an
optional ``now`` so tests can move the clock; production passes no ``now``
and the database's ``now()`` decides.

Fenced statements return what they changed; an id missing from the result
means "my lease was lost": someone re-claimed the row, or it was finished.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import psycopg
from psycopg.pq import TransactionStatus

from ..model import Claimed, LeaseRef
from ..sql.queries import migrations_for, queries_for
from ..table import OutboxTable

__all__ = [
    "MAX_ERROR_LENGTH",
    "Leased",
    "Outcome",
    "claim",
    "extend_lease",
    "extend_leases",
    "finalize",
    "get_row",
    "in_flight",
    "load_leased",
    "mark_dead",
    "mark_done",
    "migrate",
    "reap",
    "reschedule",
    "stats",
]

MAX_ERROR_LENGTH = 2000
Status = Literal["done", "pending", "dead"]
TableLike = OutboxTable | str | None


def _queries(table: TableLike) -> Any:
    return queries_for(OutboxTable.parse(table))


def statement_tx(conn: psycopg.Connection[Any]) -> AbstractContextManager[Any]:
    """A transaction for one store call.

    On an autocommit connection outside any transaction a single statement is
    already atomic, and skipping BEGIN/COMMIT saves two round trips on the
    hot path. Otherwise use a (possibly nested) transaction block, so the
    call commits, or joins the caller's transaction as a savepoint.
    """
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        return nullcontext()
    return conn.transaction()


def _clip(error: str | None) -> str | None:
    if error is None:
        return None
    return error if len(error) <= MAX_ERROR_LENGTH else error[: MAX_ERROR_LENGTH - 3] + "..."


# ---------------------------------------------------------------- migrations
_MIGRATE_LOCK = "outbox_relay:migrate"


def migrate(conn: psycopg.Connection[Any], *, table: TableLike = None) -> list[int]:
    """Apply the migrations this table lacks; return the versions applied.

    Idempotent, and safe when several processes run it at once: they queue on
    one advisory lock, and each applies what is still missing when it gets it.
    """
    outbox = OutboxTable.parse(table)
    q = queries_for(outbox)
    applied: list[int] = []
    with conn.transaction():
        conn.execute(q.advisory_lock, {"key": _MIGRATE_LOCK})
        conn.execute(q.create_schema)
        conn.execute(q.create_migrations_table)
        done = {row[0] for row in conn.execute(q.applied_migrations)}
        for migration in migrations_for(outbox):
            if migration.version in done:
                continue
            conn.execute(migration.sql.encode())
            conn.execute(q.record_migration, {"version": migration.version, "name": migration.name})
            applied.append(migration.version)
    return applied


# ---------------------------------------------------------------- claiming
def reap(
    conn: psycopg.Connection[Any],
    *,
    max_attempts: int,
    batch: int = 1000,
    table: TableLike = None,
    now: datetime | None = None,
) -> list[int]:
    """Send expired leases that used their last attempt to ``dead``."""
    q = _queries(table)
    with statement_tx(conn):
        rows = conn.execute(
            q.reap, {"max_attempts": max_attempts, "batch": batch, "now": now}
        ).fetchall()
    return sorted(r[0] for r in rows)


def claim(
    conn: psycopg.Connection[Any],
    *,
    owner: str,
    batch: int,
    lease: timedelta,
    max_attempts: int = 12,
    ordered: bool | Iterable[str] = False,
    table: TableLike = None,
    now: datetime | None = None,
) -> list[Claimed]:
    """Lease up to ``batch`` due rows in one short transaction; sorted by id.

    Takes pending rows whose ``available_at`` has come and processing rows
    whose lease expired with attempts left, bumping ``lease_version`` and
    ``attempts``. Expired leases with no attempts left go to ``dead`` first.
    ``ordered`` is ``True`` (every event type), or the event types whose
    messages are claimed strictly in id order per aggregate.
    """
    if batch <= 0:
        return []
    q = _queries(table)
    params: dict[str, Any] = {
        "owner": owner,
        "batch": batch,
        "lease": lease,
        "max_attempts": max_attempts,
        "now": now,
    }
    # Read ``ordered`` once: a one-shot iterable (a generator) would be empty
    # on a second pass and silently turn the claim unordered. A lone string
    # is one event type, not an iterable of one-letter types.
    types = (
        []
        if isinstance(ordered, bool)
        else sorted({ordered} if isinstance(ordered, str) else set(ordered))
    )
    if ordered is True or types:
        query = q.claim_ordered
        params["all_ordered"] = ordered is True
        params["ordered_types"] = types
    else:
        query = q.claim
    with conn.transaction():
        conn.execute(q.durable_commit)
        conn.execute(q.reap, {"max_attempts": max_attempts, "batch": 1000, "now": now})
        rows = conn.execute(query, params).fetchall()
    return sorted((Claimed(*row) for row in rows), key=lambda c: c.id)


# ---------------------------------------------------------------- delivery
@dataclass(frozen=True)
class Leased:
    """A row still held under the lease a delivery task was given."""

    claimed: Claimed
    lease_left_seconds: float
    age_seconds: float


def load_leased(
    conn: psycopg.Connection[Any],
    refs: Sequence[LeaseRef],
    *,
    table: TableLike = None,
    now: datetime | None = None,
) -> dict[int, Leased]:
    """The rows among ``refs`` still held under their version, by id."""
    if not refs:
        return {}
    q = _queries(table)
    if len(refs) == 1:
        one = {"id": refs[0].id, "version": refs[0].lease_version, "now": now}
        with statement_tx(conn):
            rows = conn.execute(q.load_leased_one, one).fetchall()
        return {row[0]: Leased(Claimed(*row[:11]), row[11], row[12]) for row in rows}
    params = {
        "ids": [r.id for r in refs],
        "versions": [r.lease_version for r in refs],
        "now": now,
    }
    with statement_tx(conn):
        rows = conn.execute(q.load_leased, params).fetchall()
    return {row[0]: Leased(Claimed(*row[:11]), row[11], row[12]) for row in rows}


@dataclass(frozen=True)
class Outcome:
    """How one delivery ended, as the fenced finalize will write it."""

    id: int
    lease_version: int
    status: Status
    delay: timedelta = timedelta(0)
    refund_attempt: bool = False
    error: str | None = None

    @classmethod
    def done(cls, ref: LeaseRef | Claimed) -> Outcome:
        return cls(ref.id, ref.lease_version, "done")

    @classmethod
    def retry(
        cls,
        ref: LeaseRef | Claimed,
        *,
        delay: timedelta,
        error: str | None,
        refund_attempt: bool = False,
    ) -> Outcome:
        return cls(ref.id, ref.lease_version, "pending", delay, refund_attempt, error)

    @classmethod
    def dead(cls, ref: LeaseRef | Claimed, *, error: str) -> Outcome:
        return cls(ref.id, ref.lease_version, "dead", error=error)


def finalize(
    conn: psycopg.Connection[Any],
    outcomes: Sequence[Outcome],
    *,
    table: TableLike = None,
    now: datetime | None = None,
) -> set[int]:
    """Write many outcomes in one fenced statement; return the ids that changed."""
    if not outcomes:
        return set()
    q = _queries(table)
    if len(outcomes) == 1:
        o = outcomes[0]
        one = {
            "id": o.id,
            "version": o.lease_version,
            "status": o.status,
            "delay": max(o.delay, timedelta(0)),
            "refund": 1 if o.refund_attempt else 0,
            "error": _clip(o.error),
            "now": now,
        }
        with statement_tx(conn):
            rows = conn.execute(q.finalize_one, one).fetchall()
        return {r[0] for r in rows}
    params = {
        "ids": [o.id for o in outcomes],
        "versions": [o.lease_version for o in outcomes],
        "statuses": [o.status for o in outcomes],
        "delays": [max(o.delay, timedelta(0)) for o in outcomes],
        "refunds": [1 if o.refund_attempt else 0 for o in outcomes],
        "errors": [_clip(o.error) for o in outcomes],
        "now": now,
    }
    with statement_tx(conn):
        rows = conn.execute(q.finalize, params).fetchall()
    return {r[0] for r in rows}


def _finalize_one(
    conn: psycopg.Connection[Any], outcome: Outcome, table: TableLike, now: datetime | None
) -> bool:
    return outcome.id in finalize(conn, [outcome], table=table, now=now)


def mark_done(
    conn: psycopg.Connection[Any],
    msg: Claimed | LeaseRef,
    *,
    table: TableLike = None,
    now: datetime | None = None,
) -> bool:
    """``processing -> done``; False when the lease was lost."""
    return _finalize_one(conn, Outcome.done(msg), table, now)


def reschedule(
    conn: psycopg.Connection[Any],
    msg: Claimed | LeaseRef,
    *,
    delay: timedelta,
    error: str | None,
    refund_attempt: bool,
    table: TableLike = None,
    now: datetime | None = None,
) -> bool:
    """``processing -> pending`` due after ``delay``; False when the lease was lost."""
    outcome = Outcome.retry(msg, delay=delay, error=error, refund_attempt=refund_attempt)
    return _finalize_one(conn, outcome, table, now)


def mark_dead(
    conn: psycopg.Connection[Any],
    msg: Claimed | LeaseRef,
    *,
    error: str,
    table: TableLike = None,
    now: datetime | None = None,
) -> bool:
    """``processing -> dead`` for a person to look at; False when the lease was lost."""
    return _finalize_one(conn, Outcome.dead(msg, error=error), table, now)


def extend_leases(
    conn: psycopg.Connection[Any],
    refs: Sequence[LeaseRef | Claimed],
    *,
    lease: timedelta,
    table: TableLike = None,
    now: datetime | None = None,
) -> set[int]:
    """Renew leases (fenced on the same version); return the ids still held."""
    if not refs:
        return set()
    q = _queries(table)
    params = {
        "ids": [r.id for r in refs],
        "versions": [r.lease_version for r in refs],
        "lease": lease,
        "now": now,
    }
    with statement_tx(conn):
        rows = conn.execute(q.extend_lease, params).fetchall()
    return {r[0] for r in rows}


def extend_lease(
    conn: psycopg.Connection[Any],
    msg: LeaseRef | Claimed,
    *,
    lease: timedelta,
    table: TableLike = None,
    now: datetime | None = None,
) -> bool:
    """Renew one lease; False when it was lost."""
    return msg.id in extend_leases(conn, [msg], lease=lease, table=table, now=now)


# ---------------------------------------------------------------- inspection
def in_flight(conn: psycopg.Connection[Any], *, table: TableLike = None) -> int:
    """Rows leased and not yet finished (the backpressure measure)."""
    with statement_tx(conn):
        row = conn.execute(_queries(table).in_flight).fetchone()
    return int(row[0]) if row else 0


def stats(
    conn: psycopg.Connection[Any], *, table: TableLike = None, now: datetime | None = None
) -> dict[str, Any]:
    """Queue depth per status, oldest pending age and expired leases."""
    with conn.transaction():
        cur = conn.execute(_queries(table).stats, {"now": now})
        row = cur.fetchone()
        names = [d.name for d in cur.description or []]
    assert row is not None
    return dict(zip(names, row))


def get_row(
    conn: psycopg.Connection[Any], message_id: int, *, table: TableLike = None
) -> dict[str, Any] | None:
    """One row with every column, or None."""
    with conn.transaction():
        cur = conn.execute(_queries(table).get, {"id": message_id})
        row = cur.fetchone()
        names = [d.name for d in cur.description or []]
    return dict(zip(names, row)) if row else None
