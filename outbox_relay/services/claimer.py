"""The claimer: leases due rows under the in-flight cap, in one short transaction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

from .. import store
from ..db import Database
from ..model import Claimed, Outcome
from ..store.relay import Began
from ..table import OutboxTable

__all__ = ["ClaimResult", "Claimer"]


@dataclass(frozen=True)
class ClaimResult:
    claimed: list[Claimed]
    # A full batch: more is probably due, keep draining.
    full: bool
    # The in-flight cap held the claim back: claim again once deliveries finish.
    capped: bool
    # Another claim was in progress (``contend=False``): it takes the due rows.
    busy: bool = False
    # Ordered rows parked (walked, waiting behind their aggregate's unfinished
    # row): counted in ``full`` and ``capped`` as rows taken.
    parked: int = 0

    @property
    def parked_only(self) -> bool:
        """Nothing leased, a whole batch (or all the cap's room) parked: more
        may be due behind them, and no delivery will carry the drain on."""
        return not self.claimed and self.parked > 0 and (self.full or self.capped)


class Claimer:
    """Claims for delivery tasks that count their attempt when they begin.

    Expired leases are not its business (the rescuer's), so a full cap never
    stops them from being freed. Live leases never exceed ``max_in_flight``:
    the claim counts them and takes only the room left, under a lock that
    serializes concurrent claims of the table for that one statement.
    """

    def __init__(
        self,
        db: Database,
        *,
        table: OutboxTable,
        owner: Callable[[], str],
        batch_size: int,
        max_in_flight: int | None,
        lease: timedelta,
        max_attempts: int,
        follow_queue: int | None = None,
        hold: timedelta = timedelta(0),
    ) -> None:
        self.db = db
        self.table = table
        self.owner = owner
        self.batch_size = batch_size
        self.max_in_flight = max_in_flight
        self.lease = lease
        self.max_attempts = max_attempts
        # Durable tasks' rows left for their runs to take (store.claim_batch).
        self.follow_queue = follow_queue
        self.hold = hold

    def run_once(self, *, min_room: int = 0, contend: bool = True) -> ClaimResult:
        """One claim. ``min_room``: skip it (one count, no lock, no commit) when
        the cap leaves fewer free leases, so a hint that arrives as each task
        finishes does not pay a whole claim for one row at a time.
        ``contend=False``: skip it too when another claim is in progress; that
        claim takes the due rows, and drains on if it comes back full or
        capped (a hint that waited for it found nothing: under a steady
        stream, a third of the pool's time went to such claims)."""
        if min_room > 0 and self.max_in_flight is not None:
            live = self.db.run(lambda conn: store.in_flight(conn, table=self.table))
            if self.max_in_flight - live < min_room:
                return ClaimResult([], False, True)
        batch = self.db.run(
            lambda conn: store.claim_batch(
                conn,
                owner=self.owner(),
                batch=self.batch_size,
                lease=self.lease,
                max_attempts=self.max_attempts,
                max_in_flight=self.max_in_flight,
                count_attempt=False,
                rescue_first=False,
                # The delivery reads each row as it begins; the claim needs
                # only the leases (and a durable task's row, sent as itself).
                content=False,
                table=self.table,
                contend=contend,
                # Under the cap: ordered rows that wait are set aside once.
                park=self.max_in_flight is not None,
                follow_queue=self.follow_queue,
                hold=self.hold,
            ),
            # Never repeat a claim whose COMMIT may have reached the server:
            # the first batch would sit leased with no task to deliver it.
            retry=False,
        )
        # Rows parked count as taken: the rows after them may be due.
        full = batch.taken >= self.batch_size
        return ClaimResult(batch.claimed, full, batch.capped, batch.busy, batch.parked)

    def finish_and_take(
        self, conn: psycopg.Connection[Any], outcomes: list[Outcome]
    ) -> tuple[set[int], list[Began]]:
        """Finalize ``outcomes`` and, in the same transaction, lease and begin
        the next message of each ordered aggregate they made done, for the
        delivery to publish at once instead of leaving it to the next claim
        (store.finalize_and_take): the ids changed and the rows taken."""
        return store.finalize_and_take(
            conn,
            outcomes,
            owner=self.owner(),
            lease=self.lease,
            max_attempts=self.max_attempts,
            max_in_flight=self.max_in_flight,
            table=self.table,
        )

    def take_chunk(self, size: int, budget: int) -> list[Began]:
        """Lease and begin up to ``size`` due plain rows for the delivery
        task that asks, to publish beside the chunk under way
        (store.take_chunk; Deliverer._pipeline): a claim under the cap."""
        return self.db.run(
            lambda conn: store.take_chunk(
                conn,
                batch=size,
                owner=self.owner(),
                lease=self.lease,
                max_attempts=self.max_attempts,
                max_in_flight=self.max_in_flight,
                budget=budget,
                table=self.table,
            ),
            # As a claim: repeated after a COMMIT that reached the server,
            # the first rows would sit leased and begun with no task.
            retry=False,
        )

    def next_due(self) -> float | None:
        """Seconds until the first row that waits for its time (a retry's
        backoff, a delayed message) falls due, or one left for its task's
        runs waits its hold out; None when none waits."""
        return self.db.run(
            lambda conn: store.next_due(
                conn, table=self.table, follow_queue=self.follow_queue, hold=self.hold
            )
        )
