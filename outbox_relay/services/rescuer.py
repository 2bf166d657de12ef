"""The rescuer: frees expired leases, whatever the in-flight room.

A lease expires when its delivery task was lost (the broker forgot it, the
task expired unrun, its worker was killed or froze). The rescuer gives such
rows back to ``pending`` for the claimer, or sends them to ``dead`` when
their last attempt began and never finished. It runs on its own tick and
needs no room under the cap, so no loss of delivery tasks can stop the
relay; it is the reason the cap counts live leases only.

A claim in a process that has not rescued for a rescue interval rescues
first (``due``), and a rescue claims after it: either task alone could be
starved. Two relays of different databases that share one queue (a
misconfiguration, but a quiet one) take each other's tasks, and beat's
claim and rescue, sent on the same tick to a queue with two consumers, went
round-robin to one worker each: one relay never rescued again, and its
rows stayed leased for good (or, the other way round, never claimed).

It also takes a second look at ordered rows parked for a minute or more
(``PARK_RECHECK``, then every ``PARK_RECHECK_AGAIN``; see queries.sql,
claim_parking): the write that finishes
the row before a parked one makes it due, and this catches one that no such
write reached (a worker of an earlier release during a rolling upgrade, a
change by hand).
"""

from __future__ import annotations

import time
from datetime import timedelta

from .. import store
from ..db import Database
from ..store.relay import Rescued
from ..table import OutboxTable

__all__ = ["PARK_RECHECK", "PARK_RECHECK_AGAIN", "Rescuer"]

# How long a row stays parked before the rescuer probes it again: the first
# time, and each time after that. Each look is one index probe and, for a row
# that still waits, one write (it is parked anew): 20,000 rows behind a dead
# message for hours are rewritten every 10 minutes, 33 a second, not the
# rescuer's whole batch (1,000) at every run, 200 a second at the default
# 5 s interval. A row stranded by a writer that does not promote waits up to a
# minute when that happens while it is newly parked, up to 10 after that.
PARK_RECHECK = timedelta(seconds=60)
PARK_RECHECK_AGAIN = timedelta(minutes=10)


class Rescuer:
    """Frees expired leases (``run_once``): back to ``pending``, or ``dead``
    when the attempt that expired was the last."""

    def __init__(
        self,
        db: Database,
        *,
        table: OutboxTable,
        max_attempts: int,
        batch_size: int = 1000,
        max_batches: int = 20,
    ) -> None:
        self.db = db
        self.table = table
        self.max_attempts = max_attempts
        self.batch_size = batch_size
        self.max_batches = max_batches
        self._last_run: float | None = None

    def due(self, interval: float) -> bool:
        """Whether this process has not rescued for ``interval`` seconds."""
        return self._last_run is None or time.monotonic() - self._last_run >= interval

    def run_once(self) -> Rescued:
        """Rescue in bounded batches until none are left (or ``max_batches``)."""
        self._last_run = time.monotonic()
        released: list[int] = []
        dead: list[int] = []
        for _ in range(self.max_batches):
            result = self.db.run(
                lambda conn: store.rescue(
                    conn, max_attempts=self.max_attempts, batch=self.batch_size, table=self.table
                )
            )
            released += result.released
            dead += result.dead
            if len(result) < self.batch_size:
                break
        unparked = self.db.run(
            lambda conn: store.reprobe_parked(
                conn,
                after=PARK_RECHECK,
                again=PARK_RECHECK_AGAIN,
                batch=self.batch_size,
                table=self.table,
            )
        )
        return Rescued(sorted(released), sorted(dead), unparked)
