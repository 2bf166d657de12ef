"""The relay's hot path: claim, begin, finalize, renew, rescue.

Fenced statements return what they changed; an id missing from the result
means "my lease was lost": the row was rescued, re-claimed or finished.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from ..model import Claimed, LeaseRef, Outcome
from ._base import TableLike, clip, duration, queries, require_connection, statement_tx

__all__ = [
    "Began",
    "ClaimBatch",
    "Rescued",
    "begin",
    "claim",
    "claim_batch",
    "done_and_take_durable",
    "done_under",
    "extend_lease",
    "extend_leases",
    "finalize",
    "finalize_and_take",
    "in_flight",
    "mark_dead",
    "mark_done",
    "next_due",
    "promote",
    "reap",
    "reprobe_parked",
    "reschedule",
    "rescue",
    "take_chunk",
    "take_next",
]


# ---------------------------------------------------------------- rescuing
@dataclass(frozen=True)
class Rescued:
    """What one rescue pass did: ids given back to ``pending``, ids sent ``dead``."""

    released: list[int]
    dead: list[int]
    # Parked rows made due again by a second look (reprobe_parked).
    unparked: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.released) + len(self.dead)


def rescue(
    conn: psycopg.Connection[Any],
    *,
    max_attempts: int,
    batch: int = 1000,
    table: TableLike = None,
    now: datetime | None = None,
) -> Rescued:
    """Free up to ``batch`` expired leases: back to pending, or dead when exhausted."""
    params = {"max_attempts": max_attempts, "batch": batch, "now": now}
    with statement_tx(conn):
        rows = conn.execute(queries(table).rescue, params).fetchall()
    released = sorted(r[0] for r in rows if r[1] == "pending")
    dead = sorted(r[0] for r in rows if r[1] == "dead")
    return Rescued(released, dead)


def reap(
    conn: psycopg.Connection[Any],
    *,
    max_attempts: int,
    batch: int = 1000,
    table: TableLike = None,
    now: datetime | None = None,
) -> list[int]:
    """Rescue expired leases; return the ids that went ``dead`` (the older API)."""
    return rescue(conn, max_attempts=max_attempts, batch=batch, table=table, now=now).dead


# ---------------------------------------------------------------- claiming
def _ordered_params(ordered: bool | Iterable[str]) -> dict[str, Any]:
    # Read ``ordered`` once: a one-shot iterable (a generator) would be empty
    # on a second pass. A lone string is one event type, not its letters.
    if isinstance(ordered, bool):
        return {"all_ordered": ordered, "ordered_types": []}
    types = sorted({ordered} if isinstance(ordered, str) else set(ordered))
    return {"all_ordered": False, "ordered_types": types}


def claim(
    conn: psycopg.Connection[Any],
    *,
    owner: str,
    batch: int,
    lease: timedelta | float,
    max_attempts: int = 12,
    ordered: bool | Iterable[str] = False,
    max_in_flight: int | None = None,
    count_attempt: bool = True,
    rescue_first: bool = True,
    table: TableLike = None,
    now: datetime | None = None,
) -> list[Claimed]:
    """Lease up to ``batch`` due rows in one short transaction; sorted by id.

    The articles' claim: it first rescues expired leases (back to pending, or
    ``dead`` when they used their last attempt), then leases due pending
    rows, bumping ``lease_version`` and (``count_attempt``) ``attempts``.
    Rows their producer marked ordered are claimed strictly in id order per
    aggregate; ``ordered`` adds event types (or ``True``: every row) for rows
    written unmarked. With ``max_in_flight``, live leases never exceed it:
    concurrent claims of the table queue on one advisory lock, so they
    cannot each see room and overshoot together.
    The Celery relay passes ``rescue_first=False`` (its rescuer runs on a
    tick of its own) and ``count_attempt=False`` (the delivery task counts
    the attempt when it begins). ``lease``: a timedelta, or seconds.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ValueError(f"batch must be a number of rows, 0 or more, not {batch!r}")
    return claim_batch(
        conn,
        owner=owner,
        batch=batch,
        lease=duration("lease", lease, positive=True),
        max_attempts=max_attempts,
        ordered=ordered,
        max_in_flight=max_in_flight,
        count_attempt=count_attempt,
        rescue_first=rescue_first,
        table=table,
        now=now,
    ).claimed


@dataclass(frozen=True)
class ClaimBatch:
    """A claim, and how many rows it was allowed: the batch, or less when the
    in-flight cap left less room. ``capped``: the cap, not the due rows,
    ended it (claim again once deliveries finish)."""

    claimed: list[Claimed]
    limit: int
    batch: int
    # Another claim of the table was in progress and this one did not wait
    # for it (claim_batch's ``contend=False``): nothing was counted or claimed.
    busy: bool = False
    # Ordered rows found waiting behind an unfinished one of their aggregate
    # and parked (queries.sql, claim_parking): walked instead of leased.
    parked: int = 0

    @property
    def taken(self) -> int:
        """The rows this claim walked and took: leased or parked."""
        return len(self.claimed) + self.parked

    @property
    def capped(self) -> bool:
        return not self.busy and self.limit < self.batch and self.taken >= self.limit


def claim_batch(
    conn: psycopg.Connection[Any],
    *,
    owner: str,
    batch: int,
    lease: timedelta,
    max_attempts: int = 12,
    ordered: bool | Iterable[str] = False,
    max_in_flight: int | None = None,
    count_attempt: bool = True,
    rescue_first: bool = True,
    content: bool = True,
    table: TableLike = None,
    now: datetime | None = None,
    contend: bool = True,
    park: bool = False,
    follow_queue: int | None = None,
    hold: timedelta = timedelta(0),
) -> ClaimBatch:
    """``claim``, saying whether the in-flight cap cut it short.

    ``content=False`` leaves each row's payload, created_at, lease_until
    (None) and headers (empty) out, except a durable Celery task's row: for
    a claim whose rows are delivered by ``begin``, which reads them again.
    ``contend=False``: when another claim holds the cap's lock, return at once
    (``busy``) instead of queueing behind it only to find the rows it took.

    ``park=True`` (the relay's claimer; needs ``max_in_flight``, whose lock
    it relies on, and ``ordered=False``): the rows marked ordered that the
    claim finds waiting behind an unfinished row of their aggregate are
    parked, counted in ``parked`` and ``taken``, instead of being walked
    past again by every claim; ``promote`` (run by ``finalize``) makes them
    due again. A claim that parked rows may lease none while more are due.

    ``follow_queue`` (the Celery relay's claimer): a durable task's row that
    its runs would take as they end (its producer marked it) is left in the
    table while its task has that many messages or more sent and not begun,
    for at most ``hold`` after it fell due (queries.sql, frag_held). Such
    rows count as neither taken nor capped: the runs take them, or a later
    claim (a finished run's hint, beat's tick) once the queue runs short or
    the hold is over. None: every due row is claimed.

    Under the cap's lock the live leases are counted first and the claim
    takes at most the room left: a claim that took all of a room smaller
    than its batch was cut short by the cap, one that took less found no
    more due rows. (Telling the two apart after the claim, from the live
    leases and the rows still due, could not be exact: deliveries finish
    and producers commit meanwhile. With a steady stream of new rows every
    short claim then looked cut short, each one started a drain of its
    own, and claims that found nothing took most of the pool.)
    """
    if park and (max_in_flight is None or ordered is not False):
        raise ValueError(
            "park=True needs max_in_flight (its lock orders parking and promote) and "
            "ordered=False (only the producer's mark counts)"
        )
    if batch <= 0:
        return ClaimBatch([], 0, batch)
    q = queries(table)
    limit = batch
    with require_connection(conn).transaction():
        # The claim commits durably (durable_commit); under the cap, in the
        # same round trip as its lock (claim_lock).
        if max_in_flight is None:
            conn.execute(q.durable_commit)
        if rescue_first:
            conn.execute(q.rescue, {"max_attempts": max_attempts, "batch": 1000, "now": now})
        if max_in_flight is not None:
            key = {"key": f"{q.table.lock_key}:claim"}
            if contend:
                conn.execute(q.claim_lock, key)
            else:
                taken = conn.execute(q.try_claim_lock, key).fetchone()
                if not (taken and taken[1]):
                    return ClaimBatch([], batch, batch, busy=True)
            row = conn.execute(q.in_flight, {"now": now}).fetchone()
            limit = max(0, min(batch, max_in_flight - (int(row[0]) if row else 0)))
        if limit == 0:
            return ClaimBatch([], 0, batch)
        params: dict[str, Any] = {
            "owner": owner,
            "batch": limit,
            "lease": lease,
            "max_attempts": max_attempts,
            "count_attempt": 1 if count_attempt else 0,
            "content": content,
            "now": now,
            "follow_queue": follow_queue,
            "hold": hold,
            **_ordered_params(ordered),
        }
        rows = conn.execute(q.claim_parking if park else q.claim, params).fetchall()
    # A parked row comes back with no lease version.
    claimed = [
        _claimed(row, interrupted=row[12], stored_bytes=row[13])
        for row in rows
        if row[1] is not None
    ]
    parked = len(rows) - len(claimed)
    return ClaimBatch(sorted(claimed, key=lambda c: c.id), limit, batch, parked=parked)


def promote(
    conn: psycopg.Connection[Any],
    finished: Sequence[int],
    *,
    table: TableLike = None,
    now: datetime | None = None,
) -> int:
    """Make due again the parked successors of ``finished`` (rows marked
    ordered that just became done), in the caller's transaction; return how
    many. Takes the claim's lock first, so that a claim in progress has
    committed the rows it parked (see claim_parking)."""
    if not finished:
        return 0
    q = queries(table)
    # The lock and the promote in one transaction (the lock is the
    # transaction's): the caller's, or one of their own on an autocommit
    # connection (finalize's done then committed just before: a process that
    # dies in between leaves the successor to the rescuer's reprobe_parked).
    idle = conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE
    with require_connection(conn).transaction() if idle else nullcontext():
        conn.execute(q.advisory_lock, {"key": f"{q.table.lock_key}:claim"})
        return len(conn.execute(q.promote, {"ids": list(finished), "now": now}).fetchall())


def take_next(
    conn: psycopg.Connection[Any],
    finished: Sequence[int],
    *,
    owner: str,
    lease: timedelta,
    max_attempts: int,
    max_in_flight: int | None,
    table: TableLike = None,
    now: datetime | None = None,
) -> list[Began]:
    """Lease and begin the next message of each aggregate of ``finished``
    (ordered rows just done), for the caller to publish at once; sorted by
    id. A claim, as claim_batch's under the cap: the claim's lock, a durable
    commit, the live leases counted (a claim may have taken the room the
    finished rows made); and a begin: the attempt counted. In the caller's
    transaction (the finalize of ``finished``, one commit for both), or one
    of its own on an autocommit connection."""
    if not finished:
        return []
    q = queries(table)
    params: dict[str, Any] = {
        "ids": list(finished),
        "batch": len(finished),
        "owner": owner,
        "lease": lease,
        "max_attempts": max_attempts,
        "now": now,
    }
    idle = conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE
    with require_connection(conn).transaction() if idle else nullcontext():
        conn.execute(q.claim_lock, {"key": f"{q.table.lock_key}:claim"})
        if max_in_flight is not None:
            row = conn.execute(q.in_flight, {"now": now}).fetchone()
            params["batch"] = min(len(finished), max_in_flight - (int(row[0]) if row else 0))
            if params["batch"] <= 0:
                return []
        rows = conn.execute(q.take_next, params).fetchall()
    return sorted((_began(row) for row in rows), key=lambda b: b.claimed.id)


def done_and_take_durable(
    conn: psycopg.Connection[Any],
    ref: LeaseRef,
    *,
    task: str,
    owner: str,
    lease: timedelta,
    options: str,
    max_attempts: int,
    table: TableLike = None,
    now: datetime | None = None,
) -> tuple[bool, Began | None]:
    """The fenced done of a durable task's run and, when it was still the
    run's to finish, the lease and begin of the next due row of task
    ``task``, for the caller's process to run at once: in one statement, in
    the caller's transaction (the run's effect: the done, the effect and the
    take commit together, one lease ending as the next begins). Leased as a
    claim leases it (``lease`` unless the row carries its own). ``options``:
    the JSON of the send options of a plain call of the task, which the row
    must have (``durable.plain_options``). Returns whether the done was
    written, and the row taken: None when none of the first due rows, in the
    claim's order, is such a row of this task's."""
    params: dict[str, Any] = dict(zip(_FINALIZE_ONE_KEYS, _finalize_params(Outcome.done(ref))))
    params.update(
        task=task,
        owner=owner,
        lease=lease,
        options=options,
        max_attempts=max_attempts,
        now=now,
    )
    row = conn.execute(queries(table).done_and_take_durable, params).fetchone()
    if row is None or not row[0]:
        return False, None
    return True, (None if row[1] is None else _began(row[1:]))


def take_chunk(
    conn: psycopg.Connection[Any],
    *,
    batch: int,
    owner: str,
    lease: timedelta,
    max_attempts: int,
    max_in_flight: int | None,
    budget: int,
    table: TableLike = None,
    now: datetime | None = None,
) -> list[Began]:
    """Lease and begin up to ``batch`` due plain rows (not ordered, not a
    durable task's, not interrupted) within the in-flight cap and ``budget``
    bytes of stored payload, for the caller to publish at once; sorted by id.
    A claim (its lock, a durable commit) and a begin (the attempt counted) in
    one transaction of its own: BEGIN, the lock, the take, COMMIT."""
    if batch <= 0:
        return []
    q = queries(table)
    params: dict[str, Any] = {
        "batch": batch,
        # The claim's order, a few chunks deep: the rows it handles itself
        # (ordered, durable, interrupted) are walked past, never taken.
        "walk": 4 * batch,
        "cap": max_in_flight,
        "budget": budget,
        "owner": owner,
        "lease": lease,
        "max_attempts": max_attempts,
        "now": now,
    }
    # In one round trip where the driver can (pipeline mode): the claim's
    # lock is then held for the server's work alone. The caller's thread
    # shares its interpreter with the chunk it is publishing; between round
    # trips it may wait for the GIL, and every other claim and take of the
    # table waited behind the lock it held meanwhile (takes of 96 ms, median,
    # with httpx publishing on 2 busy CPUs).
    idle = conn.info.transaction_status == TransactionStatus.IDLE
    pipelined = psycopg.Pipeline.is_supported() and idle
    with conn.pipeline() if pipelined else nullcontext():
        with require_connection(conn).transaction():
            conn.execute(q.claim_lock, {"key": f"{q.table.lock_key}:claim"})
            cursor = conn.execute(q.take_chunk, params)
        rows = cursor.fetchall()
    return sorted((_began(row) for row in rows), key=lambda b: b.claimed.id)


def reprobe_parked(
    conn: psycopg.Connection[Any],
    *,
    after: timedelta,
    again: timedelta | None = None,
    batch: int = 1000,
    table: TableLike = None,
    now: datetime | None = None,
) -> list[int]:
    """The rescuer's second look at rows parked longer than ``after``: the ids
    made due again (nothing unfinished ahead of them any more); the others
    are parked anew, for another look ``again`` later (default ``after``)."""
    params = {
        "after": after,
        "again": after if again is None else again,
        "batch": batch,
        "now": now,
        **_ordered_params(False),
    }
    with require_connection(conn).transaction():
        rows = conn.execute(queries(table).reprobe_parked, params).fetchall()
    return sorted(int(r[0]) for r in rows if r[1])


# ---------------------------------------------------------------- delivery
@dataclass(frozen=True)
class Began:
    """A row of a delivery chunk still held under the version the task was given."""

    claimed: Claimed
    lease_left_seconds: float
    age_seconds: float
    # False: too little lease was left for the whole delivery; not started.
    started: bool = True


def _claimed(row: Sequence[Any], *, interrupted: bool = False, stored_bytes: int = 0) -> Claimed:
    # Headers come back NULL where the statement leaves them out (empty, or
    # a claim without content).
    return Claimed(
        row[0],
        row[1],
        row[2],
        row[3],
        row[4],
        row[5],
        row[6],
        row[7] or {},
        row[8],
        row[9],
        row[10],
        row[11],
        interrupted=interrupted,
        stored_bytes=stored_bytes or 0,
    )


def _began(row: Sequence[Any]) -> Began:
    return Began(_claimed(row), row[12], row[13], bool(row[14]))


def begin(
    conn: psycopg.Connection[Any],
    refs: Sequence[LeaseRef],
    *,
    needed: timedelta,
    count_attempt: bool = True,
    chain_only: bool = False,
    table: TableLike = None,
    now: datetime | None = None,
) -> dict[int, Began]:
    """Fence-check a chunk and start it: the rows still ours, by id.

    A row with at least ``needed`` lease left is started, its attempt counted
    (``count_attempt``); one with less comes back with ``started=False``.
    ``chain_only``: each row's ``payload`` is only ``{"chain": ...}`` (a
    durable task's run takes its arguments from its Celery message).
    """
    if not refs:
        return {}
    q = queries(table)
    count = 1 if count_attempt else 0
    if len(refs) == 1:
        one = {
            "id": refs[0].id,
            "version": refs[0].lease_version,
            "needed": needed,
            "count_attempt": count,
            "chain_only": chain_only,
            "now": now,
        }
        with statement_tx(conn):
            rows = conn.execute(q.begin_one, one).fetchall()
    else:
        params = {
            "ids": [r.id for r in refs],
            "versions": [r.lease_version for r in refs],
            "needed": needed,
            "count_attempt": count,
            "chain_only": chain_only,
            "now": now,
        }
        with statement_tx(conn):
            rows = conn.execute(q.begin, params).fetchall()
    return {row[0]: _began(row) for row in rows}


# finalize_one's parameters, in _finalize_params's order.
_FINALIZE_ONE_KEYS = ("id", "version", "status", "delay", "refund", "error", "unless_begun")


def _finalize_params(o: Outcome) -> tuple[Any, ...]:
    return (
        o.id,
        o.lease_version,
        o.status,
        max(o.delay, timedelta(0)),
        1 if o.refund_attempt else 0,
        clip(o.error),
        o.unless_begun,
    )


def finalize(
    conn: psycopg.Connection[Any],
    outcomes: Sequence[Outcome],
    *,
    table: TableLike = None,
    now: datetime | None = None,
    savepoint: bool = True,
) -> set[int]:
    """Write many outcomes in one fenced statement; return the ids that changed.

    ``savepoint=False`` inside a transaction the caller commits or rolls back
    as a whole (a durable task's effect and its done): no savepoint around
    the statement, two round trips fewer.
    """
    if not outcomes:
        return set()
    queries(table)  # a bad table name is refused before the connection is used
    with statement_tx(conn) if savepoint else nullcontext():
        rows = _finalize_rows(conn, outcomes, table=table, now=now)
        # An ordered row done: the next of its aggregate may be parked, and
        # becomes due in the same transaction as this done.
        promote(conn, [r[0] for r in rows if r[1]], table=table, now=now)
    return {r[0] for r in rows}


def _finalize_rows(
    conn: psycopg.Connection[Any],
    outcomes: Sequence[Outcome],
    *,
    table: TableLike,
    now: datetime | None,
) -> list[tuple[int, bool]]:
    """The fenced write of ``finalize``: (id, ordered and now done) of each row changed."""
    q = queries(table)
    if len(outcomes) == 1:
        params = dict(zip(_FINALIZE_ONE_KEYS, _finalize_params(outcomes[0])), now=now)
        query = q.finalize_one
    elif all(o.plainly_done for o in outcomes):
        ids, versions = [o.id for o in outcomes], [o.lease_version for o in outcomes]
        query, params = q.finalize_done, {"ids": ids, "versions": versions, "now": now}
    else:
        columns = list(zip(*(_finalize_params(o) for o in outcomes)))
        keys = ("ids", "versions", "statuses", "delays", "refunds", "errors", "unless_begun")
        query, params = q.finalize, dict(zip(keys, (list(c) for c in columns)), now=now)
    return [(int(r[0]), bool(r[1])) for r in conn.execute(query, params).fetchall()]


def finalize_and_take(
    conn: psycopg.Connection[Any],
    outcomes: Sequence[Outcome],
    *,
    owner: str,
    lease: timedelta,
    max_attempts: int,
    max_in_flight: int | None,
    table: TableLike = None,
    now: datetime | None = None,
) -> tuple[set[int], list[Began]]:
    """``finalize``, and ``take_next`` for the ordered rows it made done, in
    one transaction (the caller's, or one of its own on an autocommit
    connection): the ids changed and the rows taken. A delivery that follows
    its aggregates (Deliverer.deliver's ``follow``) writes each round so.

    The promote that ``finalize`` runs is needed only for an aggregate whose
    next row was not taken (``take_next`` takes a parked one as it is): it
    runs only then, for them all (a taken row is no longer pending, so the
    promote passes it over). Two round trips fewer a message for one busy
    aggregate, of eight."""
    queries(table)  # a bad table name is refused before the connection is used
    idle = conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE
    with require_connection(conn).transaction() if idle else nullcontext():
        rows = _finalize_rows(conn, outcomes, table=table, now=now)
        done = [i for i, ordered_done in rows if ordered_done]
        taken = take_next(
            conn,
            done,
            owner=owner,
            lease=lease,
            max_attempts=max_attempts,
            max_in_flight=max_in_flight,
            table=table,
            now=now,
        )
        if len(taken) < len(done):
            promote(conn, done, table=table, now=now)
    return {i for i, _ in rows}, taken


def done_under(
    conn: psycopg.Connection[Any], refs: Sequence[LeaseRef], *, table: TableLike = None
) -> set[int]:
    """The ids of ``refs`` that are ``done`` under that very lease version."""
    if not refs:
        return set()
    params = {"ids": [r.id for r in refs], "versions": [r.lease_version for r in refs]}
    return {row[0] for row in conn.execute(queries(table).done_under, params).fetchall()}


def mark_done(
    conn: psycopg.Connection[Any],
    msg: Claimed | LeaseRef,
    *,
    table: TableLike = None,
    now: datetime | None = None,
) -> bool:
    """``processing -> done``; False when the lease was lost."""
    return msg.id in finalize(conn, [Outcome.done(msg)], table=table, now=now)


def reschedule(
    conn: psycopg.Connection[Any],
    msg: Claimed | LeaseRef,
    *,
    delay: timedelta | float,
    error: str | None,
    refund_attempt: bool,
    table: TableLike = None,
    now: datetime | None = None,
) -> bool:
    """``processing -> pending`` due after ``delay`` (a timedelta, or seconds);
    False when the lease was lost."""
    delay = duration("delay", delay, positive=False)
    outcome = Outcome.retry(msg, delay=delay, error=error, refund_attempt=refund_attempt)
    return msg.id in finalize(conn, [outcome], table=table, now=now)


def mark_dead(
    conn: psycopg.Connection[Any],
    msg: Claimed | LeaseRef,
    *,
    error: str,
    table: TableLike = None,
    now: datetime | None = None,
) -> bool:
    """``processing -> dead`` for a person to look at; False when the lease was lost."""
    return msg.id in finalize(conn, [Outcome.dead(msg, error=error)], table=table, now=now)


def extend_leases(
    conn: psycopg.Connection[Any],
    refs: Sequence[LeaseRef | Claimed],
    *,
    lease: timedelta | float,
    table: TableLike = None,
    now: datetime | None = None,
) -> dict[int, float]:
    """Renew leases (fenced on the same version): held id -> seconds of lease now left.
    ``lease``: a timedelta, or seconds."""
    lease = duration("lease", lease, positive=True)
    if not refs:
        return {}
    params = {
        "ids": [r.id for r in refs],
        "versions": [r.lease_version for r in refs],
        "lease": lease,
        "now": now,
    }
    with statement_tx(conn):
        rows = conn.execute(queries(table).extend_lease, params).fetchall()
    return {r[0]: float(r[1]) for r in rows}


def extend_lease(
    conn: psycopg.Connection[Any],
    msg: LeaseRef | Claimed,
    *,
    lease: timedelta | float,
    table: TableLike = None,
    now: datetime | None = None,
) -> bool:
    """Renew one lease; False when it was lost."""
    return msg.id in extend_leases(conn, [msg], lease=lease, table=table, now=now)


def in_flight(
    conn: psycopg.Connection[Any], *, table: TableLike = None, now: datetime | None = None
) -> int:
    """Live leases (the backpressure measure); expired ones do not count."""
    with statement_tx(conn):
        row = conn.execute(queries(table).in_flight, {"now": now}).fetchone()
    return int(row[0]) if row else 0


def next_due(
    conn: psycopg.Connection[Any],
    *,
    table: TableLike = None,
    now: datetime | None = None,
    follow_queue: int | None = None,
    hold: timedelta = timedelta(0),
) -> float | None:
    """Seconds until the first pending row that is not due yet falls due, or
    None. With ``follow_queue`` (as ``claim_batch`` was given it), also until
    the first row a claim may have left for its task's runs waits out its
    ``hold``."""
    params = {"now": now, "follow_queue": follow_queue, "hold": hold}
    with statement_tx(conn):
        row = conn.execute(queries(table).next_due, params).fetchone()
    return float(row[0]) if row and row[0] is not None else None
