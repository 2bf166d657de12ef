"""The completer: a process's published first attempts marked done together.

A per-message delivery (``outbox_relay.deliver``) used to end with a fenced
``done`` of its own: one statement and one commit per message, on top of the
``begin`` every delivery needs. Those commits, not the publishes, were a fifth
of what a per-message delivery cost (docs/benchmarks-changes.md, item 31). The
completer takes the ``done`` of a message that was published and writes the
process's gathered ``done``\\ s in one fenced statement a few milliseconds later,
from a thread of its own; the delivery task returns as soon as it has handed
its row over. Small chunks hand theirs over too (item 32): a chunk of 20 or 50
wrote a statement per chunk, a few per window in each process, and its task
waited for it before the process could take the next chunk. A chunk of
FULL_ROWS or more writes its own: it fills a statement by itself.

What that changes, and why it is safe:

* The write is the same fenced ``finalize`` (id, lease version, a live lease),
  made on the delivery's behalf by its own process, so a row another worker
  re-claimed meanwhile is left alone (a lost lease, reported as one).
* A process that dies between the publish and the write leaves its row
  leased, as a process killed before its own ``done`` always did; the lease
  lapses, the rescuer frees it and it is delivered again (a duplicate the
  receiver de-duplicates on its idempotency key, never a loss). The window
  is the completer's ``window`` instead of one round trip.
* A write that fails (a terminated connection, a failover, a database that
  refuses writes for a while) is tried again every RETRY_SECONDS until the
  rows' leases end; only past that are they left to the rescuer, and
  delivered again.
* A warm shutdown writes what is gathered before the process exits
  (``Deliverer.close``, called when a pool process or the worker shuts down,
  and at interpreter exit).
* Only the ``done`` of a first attempt is deferred: a retry, a dead letter
  and a release are written by the task, and so is the ``done`` of an
  ordered message (its aggregate's next message may be claimed only once it
  is done) and of a row tried before. A lost ``done`` thus costs its row one
  attempt, never its last. And before a row tried before is published (it
  may be a message that kills its process), the process writes what it
  gathered, so such a crash never spends other messages' attempts: the
  fault suite's poison scenario sent an innocent message ``dead`` before
  this rule (its ``done`` lost to a poison message's crash three times).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .. import store
from ..db import Database
from ..model import Claimed, Outcome
from ..table import OutboxTable
from .observer import Observer, bind, lost_after_publish

__all__ = ["Completer"]

log = logging.getLogger("outbox_relay.completer")

# Written at once when this many are gathered: a statement per hundred rows
# is a hundredth of a round trip a message, and rows finished but not yet
# written still count against OUTBOX_MAX_IN_FLIGHT. Waiting for the window
# with a chunk of 200 in hand made the drain's claims find the cap reached
# and back off (20,231 -> 7,705 a second in alternating rounds).
FULL_ROWS = 100

# After a write that failed, the next one waits this long (a database that
# refuses writes fails at once; without a pause the thread would spin).
RETRY_SECONDS = 0.5


@dataclass(frozen=True)
class _Done:
    claimed: Claimed
    outcome: Outcome
    age_seconds: float
    # When its lease ends, by this process's monotonic clock, as far as the
    # hand-over knew: written again after a failure until then, and given up
    # after (the rescuer frees the row and it is delivered again).
    lease_ends: float
    # Bound to the delivery task that handed it over (observer.bind): a lost
    # lease is reported for that task, which has returned by then.
    observer: Observer
    # A write of it failed before: that write may have committed all the same.
    tried: bool = False


class Completer:
    """Writes the ``done`` of published messages in batches, ``window`` seconds apart at most."""

    def __init__(
        self, db: Database, *, table: OutboxTable, observer: Observer, window: float
    ) -> None:
        self.db = db
        self.table = table
        self.observer = observer
        self.window = window
        self._lock = threading.Lock()
        self._gathered = threading.Condition(self._lock)
        self._pending: list[_Done] = []
        # One writer at a time: the thread, a drain's flush and close().
        self._writing = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._closed = False
        # When the rows of a failed write are written again (monotonic);
        # None while no write has failed since the last one.
        self._retry_at: float | None = None
        # Weakly: a completer nobody uses any more (a test's, a rebuilt
        # installation's) is not kept alive for its exit hook.
        ref = weakref.ref(self)

        def at_exit() -> None:
            completer = ref()
            if completer is not None and completer._pid == os.getpid():
                completer.close()

        atexit.register(at_exit)

    def add(self, handed: Sequence[tuple[Claimed, Outcome, float, float]]) -> None:
        """Hand over published messages' ``done``, each with its age and the
        seconds its lease has left; written within ``window`` seconds, or at
        once when FULL_ROWS are gathered."""
        if not handed:
            return
        now = time.monotonic()
        observer = bind(self.observer)
        batch = [_Done(c, o, age, now + left, observer) for c, o, age, left in handed]
        with self._lock:
            if not self._closed:
                if self._pid != os.getpid():
                    # Forked: the parent's thread is not here, and what it
                    # gathered is the parent's to write.
                    self._pid, self._thread, self._pending = os.getpid(), None, []
                    self._retry_at = None
                # The thread needs waking only to start a window (nothing was
                # gathered) or to end one early (FULL_ROWS reached): a wake-up
                # per hand-over cost a thread switch per delivered message.
                wake = not self._pending or len(self._pending) + len(batch) >= FULL_ROWS
                self._pending.extend(batch)
                if self._thread is None:
                    # Started on first use, in the process that delivers (a
                    # pool process builds its services after the fork).
                    self._thread = threading.Thread(
                        target=self._run, name="outbox-completer", daemon=True
                    )
                    self._thread.start()
                if wake:
                    self._gathered.notify()
                return
        self._write(batch)  # shutting down: write it now rather than never

    def flush(self) -> None:
        """Write everything handed over so far, now (before a claim that needs
        the room, and at shutdown)."""
        with self._lock:
            batch, self._pending = self._pending, []
            self._retry_at = None
        self._write(batch)

    def close(self) -> None:
        """Write what is gathered and stop the thread; later hand-overs are written at once."""
        with self._lock:
            self._closed = True
            self._gathered.notify()
        self.flush()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._gathered.wait()
                # The deliveries that finish meanwhile go into the same
                # statement, up to FULL_ROWS: more would save nothing and keep
                # finished rows counted as in flight (the claims' cap) longer.
                # After a failed write, RETRY_SECONDS later whatever is gathered.
                deadline = time.monotonic() + self.window
                while not self._closed:
                    now = time.monotonic()
                    retry_at = self._retry_at
                    if retry_at is None and len(self._pending) >= FULL_ROWS:
                        break
                    due = deadline if retry_at is None else retry_at
                    if now >= due:
                        break
                    self._gathered.wait(due - now)
                if self._closed:
                    return
            try:
                self.flush()
            except Exception:  # an observer's failure must not end the thread
                log.exception("the completer's write failed; it goes on with the next window")

    def _write(self, batch: Sequence[_Done]) -> None:
        if not batch:
            return
        with self._writing:
            outcomes = [d.outcome for d in batch]
            try:
                changed = self.db.run(lambda conn: store.finalize(conn, outcomes, table=self.table))
            except Exception:
                self._failed(batch)
                return
        written: set[int] = set()
        ours = self._done_before([d for d in batch if d.tried and d.outcome.id not in changed])
        for d in batch:
            if (d.outcome.id in changed or d.outcome.id in ours) and d.outcome.id not in written:
                written.add(d.outcome.id)
                d.observer.finalized(d.claimed, d.outcome, d.age_seconds)
                continue
            # Re-claimed by another worker since the publish (or the same
            # lease delivered twice by a duplicated task): not ours to finish.
            lost_after_publish(d.observer, d.claimed, d.outcome)

    def _done_before(self, unchanged: Sequence[_Done]) -> set[int]:
        """Rows a failed write did finish after all (the connection was cut
        after its COMMIT): done under their own lease version, so theirs, not
        lost leases. Read only after such a failure."""
        if not unchanged:
            return set()
        refs = [d.claimed.ref for d in unchanged]
        try:
            return self.db.run(lambda conn: store.done_under(conn, refs, table=self.table))
        except Exception:  # then they are reported as lost leases, as before
            log.debug("could not read back the rows of a failed write", exc_info=True)
            return set()

    def _failed(self, batch: Sequence[_Done]) -> None:
        """A write that failed (a terminated connection, a failover): its rows
        still hold their leases, so the thread writes them again, every
        RETRY_SECONDS until their leases end (the fence makes a second write
        of a row the first one did finish a no-op; _done_before tells it
        from a lost lease).
        Before, each such write cost its rows a second delivery: 11
        duplicates in the fault suite's terminate scenario."""
        now = time.monotonic()
        with self._lock:
            # Shutting down, no window is left to write them in.
            again = (
                []
                if self._closed
                else [replace(d, tried=True) for d in batch if d.lease_ends > now]
            )
            self._pending[:0] = again
            self._retry_at = now + RETRY_SECONDS if again else None
            self._gathered.notify()
        given_up = len(batch) - len(again)
        kept = {d.outcome.id for d in again}
        for d in batch:
            if d.outcome.id not in kept:
                # Published, and its lease ends before its done could be
                # written: the rescuer frees it and it is delivered again.
                # The receiver sees a duplicate; count it as one
                # (outbox_lost_leases_total, OutboxLostLeases), as a done
                # the fence refused is counted.
                d.observer.lost_lease(d.claimed.ref, "done not written")
        fate = f"written again in {RETRY_SECONDS:g}s"
        if given_up:
            fate = (
                f"{given_up} given up (their leases end: they are delivered again once "
                f"they lapse), the rest {fate}"
            )
        log.warning(
            "could not mark %d published message(s) done; %s", len(batch), fate, exc_info=True
        )
