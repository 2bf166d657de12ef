"""One delivery step, shared by the Celery tasks and the plain loop.

    fence check -> publish -> classify -> fenced finalize

* The fence check reloads the rows under the lease versions we were given and
  skips any that are no longer ours, or that have too little lease left for a
  whole publish (those are released at once, attempt refunded).
* Publishing happens outside any transaction; a chunk publishes concurrently
  (bounded) because publishers are I/O bound.
* ``classify`` maps the publisher's result onto an ``Outcome``: done, a
  full-jitter retry written into ``available_at``, or dead.
* One fenced statement finalizes the whole chunk. An id the database did not
  change is a lost lease: someone else holds the row now, and the receiver
  absorbs the duplicate through the idempotency key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import psycopg

from . import store
from .backoff import full_jitter_backoff
from .errors import Defer, PermanentError, RetryableError
from .model import Claimed, LeaseRef, Message
from .model import Outcome
from .table import OutboxTable

__all__ = [
    "Database",
    "DeliveryReport",
    "DirectDatabase",
    "LeaseKeeper",
    "Publisher",
    "Relay",
    "RelayObserver",
    "RetryPolicy",
    "classify",
    "dispatch_once",
]

log = logging.getLogger("outbox_relay.relay")

Publisher = Callable[[Message], Any]
T = TypeVar("T")


class Database(Protocol):
    """Runs a function with a connection. The Celery runtime's version takes
    one from a per-process pool and retries once on a broken connection."""

    def run(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T: ...


class DirectDatabase:
    """A ``Database`` over one connection the caller owns."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def run(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        return fn(self.conn)


def as_database(db: psycopg.Connection[Any] | Database) -> Database:
    return DirectDatabase(db) if isinstance(db, psycopg.Connection) else db


@dataclass(frozen=True)
class RetryPolicy:
    """How failures become database state.

    ``retry_on`` lists extra exception classes treated as transient (the
    Celery layer fills it from a deliver task's ``autoretry_for``). Any other
    unexpected exception is also retried, but logged with its traceback.
    """

    max_attempts: int = 12
    backoff_base: float = 1.0
    backoff_cap: float = 300.0
    jitter: bool = True
    max_defer: timedelta = timedelta(days=1)
    retry_on: tuple[type[BaseException], ...] = ()

    def backoff(self, attempt: int) -> timedelta:
        if self.jitter:
            return full_jitter_backoff(attempt, base=self.backoff_base, cap=self.backoff_cap)
        return timedelta(seconds=min(self.backoff_cap, self.backoff_base * 2.0 ** min(attempt, 64)))


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def classify(
    exc: BaseException | None,
    msg: Claimed,
    policy: RetryPolicy,
    *,
    age_seconds: float = 0.0,
) -> Outcome:
    """Map a publish result onto the fenced write that records it."""
    if exc is None:
        return Outcome.done(msg)
    if isinstance(exc, Defer):
        if age_seconds + exc.delay.total_seconds() > policy.max_defer.total_seconds():
            return Outcome.dead(
                msg,
                error=f"deferred past the maximum defer age ({policy.max_defer}): {exc.reason}",
            )
        return Outcome.retry(
            msg, delay=exc.delay, error=f"deferred: {exc.reason}", refund_attempt=True
        )
    if isinstance(exc, PermanentError):
        return Outcome.dead(msg, error=f"permanent: {_describe(exc)}")
    if isinstance(exc, (RetryableError, *policy.retry_on)):
        prefix = "retryable"
    else:
        prefix = "unexpected"
    if msg.attempts >= policy.max_attempts:
        return Outcome.dead(
            msg,
            error=f"retries exhausted after {msg.attempts} attempts; last: {prefix}: "
            f"{_describe(exc)}",
        )
    delay = policy.backoff(msg.attempts)
    retry_after = getattr(exc, "retry_after", None)
    if isinstance(retry_after, timedelta) and retry_after > delay:
        delay = retry_after
    return Outcome.retry(msg, delay=delay, error=f"{prefix}: {_describe(exc)}")


class RelayObserver(Protocol):
    """Hooks for metrics and task events; every method must be cheap."""

    def published(self, msg: Claimed, outcome: Outcome, seconds: float) -> None: ...
    def finalized(self, msg: Claimed, outcome: Outcome, age_seconds: float) -> None: ...
    def lost_lease(self, ref: LeaseRef, where: str) -> None: ...
    def stale(self, ref: LeaseRef, reason: str) -> None: ...


class _NoObserver:
    def published(self, msg: Claimed, outcome: Outcome, seconds: float) -> None:
        pass

    def finalized(self, msg: Claimed, outcome: Outcome, age_seconds: float) -> None:
        pass

    def lost_lease(self, ref: LeaseRef, where: str) -> None:
        pass

    def stale(self, ref: LeaseRef, reason: str) -> None:
        pass


@dataclass
class DeliveryReport:
    done: int = 0
    retried: int = 0
    dead: int = 0
    stale: int = 0
    released: int = 0
    lost: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    # Event types of the messages this step finished as done: an ordered
    # aggregate's next message may have become claimable.
    finished_event_types: set[str] = field(default_factory=set)

    def add(self, other: DeliveryReport) -> None:
        for name in ("done", "retried", "dead", "stale", "released", "lost"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.outcomes.extend(other.outcomes)
        self.finished_event_types |= other.finished_event_types


class LeaseKeeper:
    """Renews the leases of publishes that run long (a fenced heartbeat).

    One daemon thread per process; a delivery registers its refs while it
    publishes. Every ``lease / 6`` it renews the refs held for more than a
    third of the lease, so a slow but healthy publish keeps its row.
    """

    def __init__(self, db: Database, lease: timedelta, *, table: OutboxTable):
        self._db = db
        self._lease = lease
        self._table = table
        self._held: dict[LeaseRef, float] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewed = 0
        self.lost: set[LeaseRef] = set()

    def hold(self, refs: Iterable[LeaseRef]) -> None:
        now = time.monotonic()
        with self._lock:
            for ref in refs:
                self._held[ref] = now
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="outbox-lease-keeper", daemon=True
                )
                self._thread.start()

    def release(self, refs: Iterable[LeaseRef]) -> None:
        with self._lock:
            for ref in refs:
                self._held.pop(ref, None)
                self.lost.discard(ref)

    def _run(self) -> None:
        period = max(self._lease.total_seconds() / 6.0, 0.05)
        while True:
            self._wake.wait(period)
            self._wake.clear()
            try:
                self.renew_due()
            except Exception:  # keep the heartbeat alive through a database blip
                log.exception("lease renewal failed; retrying at the next beat")

    def renew_due(self) -> None:
        threshold = time.monotonic() - self._lease.total_seconds() / 3.0
        with self._lock:
            due = [ref for ref, since in self._held.items() if since <= threshold]
        if not due:
            return
        kept = self._db.run(
            lambda conn: store.extend_leases(conn, due, lease=self._lease, table=self._table)
        )
        now = time.monotonic()
        with self._lock:
            for ref in due:
                if ref not in self._held:
                    continue
                if ref.id in kept:
                    self._held[ref] = now
                    self.renewed += 1
                else:
                    self._held.pop(ref, None)
                    self.lost.add(ref)


class Relay:
    """Delivers leased messages: the step every delivery path shares."""

    def __init__(
        self,
        publisher: Publisher,
        *,
        table: OutboxTable | str | None = None,
        policy: RetryPolicy | None = None,
        publish_timeout: float = 10.0,
        idempotency_key_prefix: str = "outbox-",
        concurrency: int = 8,
        observer: RelayObserver | None = None,
        keeper: LeaseKeeper | None = None,
    ) -> None:
        self.publisher = publisher
        self.table = OutboxTable.parse(table)
        self.policy = policy or RetryPolicy()
        self.publish_timeout = publish_timeout
        self.prefix = idempotency_key_prefix
        self.concurrency = max(1, concurrency)
        self.observer: RelayObserver = observer or _NoObserver()
        self.keeper = keeper
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    # ------------------------------------------------------------ publishing
    def _publish(self, leased: store.Leased) -> tuple[BaseException | None, float]:
        msg = leased.claimed
        started = time.perf_counter()
        try:
            self.publisher(msg.to_message(self.prefix))
        except Exception as exc:
            if not isinstance(exc, (RetryableError, PermanentError, Defer, *self.policy.retry_on)):
                log.error(
                    "publisher raised an unclassified error for outbox message %s; "
                    "retrying it as transient",
                    msg.id,
                    exc_info=exc,
                )
            return exc, time.perf_counter() - started
        return None, time.perf_counter() - started

    def _pool(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.concurrency, thread_name_prefix="outbox-publish"
                )
            return self._executor

    def _publish_all(
        self, rows: Sequence[store.Leased]
    ) -> list[tuple[BaseException | None, float]]:
        if len(rows) == 1 or self.concurrency == 1:
            return [self._publish(row) for row in rows]
        return list(self._pool().map(self._publish, rows))

    # -------------------------------------------------------------- delivery
    def deliver(
        self, db: psycopg.Connection[Any] | Database, refs: Sequence[LeaseRef]
    ) -> DeliveryReport:
        """Fence-check, publish, classify and finalize one chunk of leased messages."""
        database = as_database(db)
        report = DeliveryReport()
        loaded = database.run(lambda conn: store.load_leased(conn, refs, table=self.table))
        ready: list[store.Leased] = []
        released: list[Outcome] = []
        for ref in refs:
            leased = loaded.get(ref.id)
            if leased is not None and leased.claimed.lease_version != ref.lease_version:
                leased = None  # the same id twice in one chunk: only the current lease counts
            if leased is None:
                report.stale += 1
                self.observer.stale(ref, "not held under this lease version")
                log.info("skipping outbox message %s v%s: lease no longer ours", *_ref(ref))
            elif leased.lease_left_seconds < self.publish_timeout:
                # Not enough lease left for a whole publish: give the row back
                # now rather than publish into a lease that may expire midway.
                released.append(
                    Outcome.retry(
                        ref,
                        delay=timedelta(0),
                        error="released unpublished: too little lease left to publish",
                        refund_attempt=True,
                    )
                )
                self.observer.stale(ref, "too little lease left")
            else:
                ready.append(leased)

        held = [row.claimed.ref for row in ready]
        if self.keeper is not None and held:
            self.keeper.hold(held)
        try:
            results = self._publish_all(ready)
        finally:
            if self.keeper is not None and held:
                self.keeper.release(held)

        outcomes = [
            classify(exc, row.claimed, self.policy, age_seconds=row.age_seconds)
            for row, (exc, _) in zip(ready, results)
        ]
        writes = outcomes + released
        changed = database.run(lambda conn: store.finalize(conn, writes, table=self.table))
        report.released = sum(1 for o in released if o.id in changed)
        for row, outcome, (_, seconds) in zip(ready, outcomes, results):
            self.observer.published(row.claimed, outcome, seconds)
            if outcome.id not in changed:
                report.lost += 1
                self.observer.lost_lease(row.claimed.ref, "finalize")
                log.warning(
                    "lost lease on outbox message %s v%s: it was published (%s) but another "
                    "worker holds it now; the receiver de-duplicates on its idempotency key",
                    row.claimed.id,
                    row.claimed.lease_version,
                    outcome.status,
                )
                continue
            self.observer.finalized(row.claimed, outcome, row.age_seconds + seconds)
            report.outcomes.append(outcome)
            if outcome.status == "done":
                report.done += 1
                report.finished_event_types.add(row.claimed.event_type)
            elif outcome.status == "dead":
                report.dead += 1
            else:
                report.retried += 1
        return report

    def close(self) -> None:
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def _ref(ref: LeaseRef) -> tuple[int, int]:
    return ref.id, ref.lease_version


def dispatch_once(
    conn: psycopg.Connection[Any],
    publisher: Publisher,
    *,
    owner: str,
    batch: int = 50,
    lease: timedelta = timedelta(seconds=60),
    max_attempts: int = 12,
    ordered: bool | Iterable[str] = False,
    table: OutboxTable | str | None = None,
    policy: RetryPolicy | None = None,
    publish_timeout: float = 10.0,
    idempotency_key_prefix: str = "outbox-",
) -> int:
    """Claim one batch and deliver it in this process, without Celery.

    Messages are published one by one; each is finalized as soon as it is
    published, so a crash mid-batch repeats as little as possible. Returns the
    number of messages claimed (0 means the queue had nothing due). When
    ``policy`` is given, its ``max_attempts`` wins over ``max_attempts``.
    """
    policy = policy or RetryPolicy(max_attempts=max_attempts)
    started = time.monotonic()
    claimed = store.claim(
        conn,
        owner=owner,
        batch=batch,
        lease=lease,
        max_attempts=policy.max_attempts,
        ordered=ordered,
        table=table,
    )
    relay = Relay(
        publisher,
        table=table,
        policy=policy,
        publish_timeout=publish_timeout,
        idempotency_key_prefix=idempotency_key_prefix,
        concurrency=1,
    )
    lease_seconds = lease.total_seconds()
    for msg in claimed:
        # The lease was measured from the claim; our monotonic clock tells how
        # much of it is left without trusting this machine's wall clock.
        left = lease_seconds - (time.monotonic() - started)
        if left < publish_timeout:
            store.reschedule(
                conn,
                msg,
                delay=timedelta(0),
                error="released unpublished: too little lease left to publish",
                refund_attempt=True,
                table=table,
            )
            continue
        age = 0.0
        if msg.created_at is not None and msg.lease_until is not None:
            age = max(0.0, (msg.lease_until - msg.created_at).total_seconds() - lease_seconds)
        exc, _ = relay._publish(store.Leased(msg, left, age))
        outcome = classify(exc, msg, policy, age_seconds=age)
        if not store.finalize(conn, [outcome], table=table):
            log.warning("lost lease on outbox message %s v%s", msg.id, msg.lease_version)
    return len(claimed)
