"""Driving the services without Celery: ``dispatch_once`` and ``RelayLoop``.

``dispatch_once`` is the articles' loop, for people who run their own
process: claim, publish each message, one finalize per message. ``RelayLoop``
drives the same services the Celery tasks drive (rescuer, claimer,
deliverer, purger), each on its own interval, in one plain thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Literal

import psycopg

from .. import store
from ..db import DirectDatabase
from ..errors import ConfigError
from ..model import Outcome
from ..store.relay import Began
from ..table import OutboxTable
from ..tracing import PublishTracer
from .claimer import Claimer
from .deliverer import Deliverer, DeliveryReport, Publisher
from .policy import RetryPolicy, classify
from .purger import Purger
from .rescuer import Rescuer

__all__ = ["RelayLoop", "dispatch_once"]

log = logging.getLogger("outbox_relay.loop")


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
    tracer: PublishTracer | Literal["default"] | None = "default",
) -> int:
    """Claim one batch and deliver it in this process, without Celery.

    Messages are published one by one; each is finalized as soon as it is
    published, so a crash mid-batch repeats as little as possible. Returns the
    number of messages claimed (0 means the queue had nothing due). When
    ``policy`` is given, its ``max_attempts`` wins over ``max_attempts``.
    ``tracer``: see ``Deliverer`` (default: OpenTelemetry's global tracer when installed).
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
    deliverer = Deliverer(
        publisher,
        db=DirectDatabase(conn),
        table=table,
        policy=policy,
        publish_timeout=publish_timeout,
        idempotency_key_prefix=idempotency_key_prefix,
        concurrency=1,
        tracer=tracer,
    )
    lease_seconds = lease.total_seconds()
    for msg in claimed:
        # The lease was measured by the database at the claim; the monotonic
        # clock only tells how long ago that was.
        left = lease_seconds - (time.monotonic() - started)
        if left < publish_timeout:
            release = Outcome.release(msg, reason="too little lease left", refund_attempt=True)
            store.finalize(conn, [release], table=table)
            continue
        age = 0.0
        if msg.created_at is not None and msg.lease_until is not None:
            age = max(0.0, (msg.lease_until - msg.created_at).total_seconds() - lease_seconds)
        exc, _ = deliverer.publish_one(Began(msg, left, age))
        outcome = classify(exc, msg, policy, age_seconds=age)
        if not store.finalize(conn, [outcome], table=table):
            log.warning("lost lease on outbox message %s v%s", msg.id, msg.lease_version)
    return len(claimed)


@dataclass
class _Every:
    seconds: float
    last: float = float("-inf")

    def due(self, now: float) -> bool:
        if now - self.last >= self.seconds:
            self.last = now
            return True
        return False


_DUE_MARGIN_SECONDS = 0.02


class RelayLoop:
    """The relay in one thread: rescue, claim, deliver in chunks, purge.

    ``chunk_size``: rows per delivery (default: up to 50, as many as the
    deliverer can publish within the claimer's lease).
    """

    def __init__(
        self,
        *,
        claimer: Claimer,
        deliverer: Deliverer,
        rescuer: Rescuer,
        purger: Purger | None = None,
        chunk_size: int | None = None,
        claim_interval: float = 1.0,
        rescue_interval: float = 5.0,
        purge_interval: float = 3600.0,
    ) -> None:
        lease = claimer.lease.total_seconds()
        if chunk_size is None:
            # Up to 50 rows, as many as fit the lease: with the deliverer's
            # defaults (8 at a time, 10 s each) 50 rows are 7 waves, 70 s,
            # over the default 60 s lease, and the defaults refused to start.
            chunk_size = next(
                (n for n in range(50, 1, -1) if deliverer.worst_seconds(n) < lease), 1
            )
        worst = deliverer.worst_seconds(chunk_size)
        if worst >= lease:
            # Every chunk would be given back unpublished, round after round.
            raise ConfigError(
                f"a chunk of {chunk_size} may publish for {worst:g}s "
                f"({deliverer.concurrency} at a time, {deliverer.publish_timeout:g}s each), "
                f"which does not fit the claim's lease of {lease:g}s"
            )
        self.claimer = claimer
        self.deliverer = deliverer
        self.rescuer = rescuer
        self.purger = purger
        self.chunk_size = max(1, chunk_size)
        self.claim_interval = claim_interval
        self._rescue = _Every(rescue_interval)
        self._purge = _Every(purge_interval)
        # Running counts since the loop was made; not each outcome, which a
        # loop that runs for weeks would keep without end.
        self.report = DeliveryReport()

    def run_once(self) -> int:
        """One round; returns how many rows it claimed or parked (0: nothing
        was due; parked: ordered rows set aside behind their aggregate's
        unfinished one, with maybe more due after them)."""
        now = time.monotonic()
        if self._rescue.due(now):
            self.rescuer.run_once()
        if self.purger is not None and self._purge.due(now):
            self.purger.run_once()
        result = self.claimer.run_once()
        claimed = result.claimed
        for i in range(0, len(claimed), self.chunk_size):
            chunk = claimed[i : i + self.chunk_size]
            self.report.add(replace(self.deliverer.deliver([c.ref for c in chunk]), outcomes=[]))
        return len(claimed) + result.parked

    def run(self, stop: threading.Event) -> None:
        """Until ``stop`` is set; a round that claimed nothing waits a claim
        interval, or until the first waiting row falls due when that is sooner."""
        while not stop.is_set():
            try:
                wait = 0.0 if self.run_once() else self.idle_wait()
            except Exception:
                log.exception("relay round failed; trying again after the claim interval")
                wait = self.claim_interval
            if wait:
                stop.wait(wait)

    def idle_wait(self) -> float:
        """How long an idle loop sleeps: the claim interval, or less when a
        retry's backoff or a delayed message ends sooner (it waited for the
        next round, up to a whole interval past its time)."""
        due = self.claimer.next_due()
        if due is None or due >= self.claim_interval:
            return self.claim_interval
        # A little after: due by the database's clock when the claim runs.
        return max(due, 0.0) + _DUE_MARGIN_SECONDS
