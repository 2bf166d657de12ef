"""The rescuer: frees expired leases, whatever the in-flight room.

A lease expires when its delivery task was lost (the broker forgot it, the
task expired unrun, its worker was killed or froze). The rescuer gives such
rows back to ``pending`` for the claimer, or sends them to ``dead`` when
their last attempt began and never finished. It runs on its own tick and
needs no room under the cap, so no loss of delivery tasks can stop the
relay; it is the reason the cap counts live leases only.
"""

from __future__ import annotations

from .. import store
from ..db import Database
from ..store.relay import Rescued
from ..table import OutboxTable

__all__ = ["Rescuer"]


class Rescuer:
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

    def run_once(self) -> Rescued:
        """Rescue in bounded batches until none are left (or ``max_batches``)."""
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
        return Rescued(sorted(released), sorted(dead))
