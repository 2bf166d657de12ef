"""The lease keeper: a bounded, fenced heartbeat for long deliveries.

A delivery task registers the rows it is publishing together with the lease
each has left *as the database measured it* (``begin`` returns it). A
daemon thread renews a row when less than half a lease is left, from the
database's answer again, and stops renewing once the delivery has run for
its worst case: a hung publisher then lets its lease lapse, and the rescuer
hands the row to someone else within a lease. The worker's monotonic clock
only measures the time since the database answered; it never decides how
long a lease is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

from .. import store
from ..db import Database
from ..model import LeaseRef
from ..table import OutboxTable

__all__ = ["Hold", "LeaseKeeper", "renewal_period"]

log = logging.getLogger("outbox_relay.keeper")


def renewal_period(lease_seconds: float) -> float:
    """How often a keeper of ``lease_seconds`` leases looks for renewals due."""
    return max(min(lease_seconds / 6.0, 5.0), 0.05)


@dataclass
class _Lease:
    expires: float  # clock() when the lease ends, by the database's last answer
    stop: float  # clock() after which it is no longer renewed
    lost: bool = False


class Hold:
    """The leases of one delivery, as the keeper last knew them."""

    def __init__(self, keeper: LeaseKeeper, leases: dict[LeaseRef, _Lease]) -> None:
        self._keeper = keeper
        self._leases = leases

    def alive(self, ref: LeaseRef, needed: float) -> bool:
        """True while ``ref`` is held with at least ``needed`` seconds left."""
        lease = self._leases.get(ref)
        if lease is None:
            return False
        with self._keeper.lock:
            return not lease.lost and lease.expires - self._keeper.clock() >= needed

    @property
    def lost(self) -> set[LeaseRef]:
        with self._keeper.lock:
            return {ref for ref, lease in self._leases.items() if lease.lost}

    def release(self) -> None:
        self._keeper.release(self)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LeaseKeeper:
    """One per process; a delivery ``hold()``s its rows while it publishes."""

    def __init__(
        self,
        db: Database,
        lease: timedelta,
        *,
        table: OutboxTable,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
    ) -> None:
        self._db = db
        self._lease = lease
        self._table = table
        self.clock = clock
        self._background = background
        self.lock = threading.Lock()
        self._held: dict[LeaseRef, _Lease] = {}
        self._thread: threading.Thread | None = None
        self.renewed = 0
        self.lost = 0

    @property
    def lease_seconds(self) -> float:
        return self._lease.total_seconds()

    @property
    def period(self) -> float:
        return renewal_period(self._lease.total_seconds())

    def hold(self, rows: Iterable[tuple[LeaseRef, float]], *, max_hold: float) -> Hold:
        """Keep ``(ref, lease_left_seconds)`` rows for at most ``max_hold`` seconds."""
        now = self.clock()
        leases = {ref: _Lease(now + left, now + max_hold) for ref, left in rows}
        with self.lock:
            self._held.update(leases)
            if self._background and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(
                    target=self._run, name="outbox-lease-keeper", daemon=True
                )
                self._thread.start()
        return Hold(self, leases)

    def release(self, hold: Hold) -> None:
        with self.lock:
            for ref, lease in hold._leases.items():
                if self._held.get(ref) is lease:
                    del self._held[ref]

    def _run(self) -> None:
        while True:
            time.sleep(self.period)
            try:
                self.renew_due()
            except Exception:  # keep the heartbeat alive through a database blip
                log.exception("lease renewal failed; retrying at the next beat")

    def renew_due(self) -> int:
        """One pass: renew every held lease with less than half a lease left."""
        half = self._lease.total_seconds() / 2.0
        now = self.clock()
        with self.lock:
            due = [
                ref
                for ref, lease in self._held.items()
                if not lease.lost and now < lease.stop and lease.expires - now < half
            ]
        if not due:
            return 0
        asked = self.clock()  # the lease left is counted from before the call
        left = self._db.run(
            lambda conn: store.extend_leases(conn, due, lease=self._lease, table=self._table)
        )
        with self.lock:
            for ref in due:
                lease = self._held.get(ref)
                if lease is None:
                    continue
                if ref.id in left:
                    lease.expires = asked + left[ref.id]
                    self.renewed += 1
                else:
                    lease.lost = True
                    self.lost += 1
        return len(due)
