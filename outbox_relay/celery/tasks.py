"""The relay's Celery tasks: ``outbox_relay.claim``, ``deliver``, ``deliver_batch``.

Rules these tasks follow (each one is a way Celery loses or repeats work):

* Claim, commit, then fan out; never publish inside the claim transaction.
* Fan-out messages carry only ``(id, lease_version)`` and expire before the
  lease ends, so a backlogged task is dropped instead of publishing late.
* No ``Task.retry``, countdown or ETA: a failure is one fenced UPDATE that
  sets ``available_at``; the task itself returns normally.
* The broker message is a hint. If it is lost, the lease expires and the
  row is claimed again; if it arrives twice or late, the fence turns it away.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .. import operations, store
from ..model import Claimed, LeaseRef
from ..relay import DeliveryReport
from ..model import Outcome

if TYPE_CHECKING:
    from .runtime import RelayRuntime

__all__ = ["CLAIM", "DELIVER", "DELIVER_BATCH", "PURGE", "register_tasks", "task_annotations"]

log = logging.getLogger("outbox_relay.celery")

CLAIM = "outbox_relay.claim"
DELIVER = "outbox_relay.deliver"
DELIVER_BATCH = "outbox_relay.deliver_batch"
PURGE = "outbox_relay.purge"
# Consecutive claim rounds that may find the in-flight cap reached before a
# drain stops and leaves the rest to beat.
MAX_HELD_BACK_ROUNDS = 5


def _argsrepr(refs: Sequence[LeaseRef]) -> str:
    if len(refs) == 1:
        return f"(outbox #{refs[0].id} v{refs[0].lease_version})"
    first, last = refs[0].id, refs[-1].id
    return f"({len(refs)} outbox messages #{first}..#{last})"


def register_tasks(app: Any, rt: RelayRuntime) -> dict[str, Any]:
    """Define the relay tasks on ``app``; return them by short name."""

    @app.task(name=DELIVER, bind=True, ignore_result=True, serializer="json", typing=False)  # type: ignore[untyped-decorator]
    def deliver(self: Any, outbox_id: int, lease_version: int) -> dict[str, int]:
        """Deliver one leased message (the default, one task per message)."""
        report = rt.relay().deliver(rt.db(), [LeaseRef(int(outbox_id), int(lease_version))])
        _follow_ordered(rt, report, claim)
        return {"done": report.done, "retried": report.retried, "dead": report.dead}

    @app.task(name=DELIVER_BATCH, bind=True, ignore_result=True, serializer="json", typing=False)  # type: ignore[untyped-decorator]
    def deliver_batch(self: Any, refs: list[list[int]]) -> dict[str, int]:
        """Deliver a chunk: one load, concurrent publishes, one batched finalize."""
        leases = [LeaseRef(int(i), int(v)) for i, v in refs]
        report = rt.relay().deliver(rt.db(), leases)
        _follow_ordered(rt, report, claim)
        return {"done": report.done, "retried": report.retried, "dead": report.dead}

    @app.task(name=CLAIM, bind=True, ignore_result=True, serializer="json")  # type: ignore[untyped-decorator]
    def claim(self: Any, held_back: int = 0) -> dict[str, int]:
        """Claim due rows and fan them out; keep draining while batches come back full.

        ``held_back`` counts the rounds in a row this drain found the
        in-flight cap reached (see ``_claim_and_fan_out``).
        """
        return _claim_and_fan_out(rt, claim, deliver, deliver_batch, int(held_back))

    @app.task(name=PURGE, ignore_result=True, serializer="json")  # type: ignore[untyped-decorator]
    def purge() -> dict[str, int]:
        """Delete done rows older than OUTBOX_PURGE_AFTER_SECONDS, in bounded batches."""
        s = rt.settings
        result = rt.db().run(
            lambda conn: operations.purge(
                conn,
                older_than=timedelta(seconds=s.purge_after_seconds),
                batch_size=5000,
                max_batches=100,
                table=s.outbox_table,
            )
        )
        return {"deleted": result.deleted, "batches": result.batches}

    return {"claim": claim, "deliver": deliver, "deliver_batch": deliver_batch, "purge": purge}


def task_annotations(app: Any, name: str) -> dict[str, Any]:
    """The ``task_annotations`` a user set for one task (dict form, and ``"*"``)."""
    found: dict[str, Any] = {}
    configured = app.conf.get("task_annotations") or {}
    if isinstance(configured, dict):
        for key in ("*", name):
            value = configured.get(key)
            if isinstance(value, dict):
                found.update(value)
    return found


def _follow_ordered(rt: RelayRuntime, report: DeliveryReport, claim: Any) -> None:
    """After an ordered message is done, claim at once: its successor is now due.

    Without this, an aggregate would advance one message per beat tick.
    """
    ordered = rt.settings.ordered_event_types
    if ordered and report.finished_event_types.intersection(ordered):
        try:
            claim.apply_async(queue=rt.settings.queue, serializer="json")
        except Exception:  # the beat tick is the safety net
            log.warning("could not send a follow-up claim", exc_info=True)


def _release(rt: RelayRuntime, claimed: Sequence[Claimed], reason: str) -> None:
    """Give rows back at once (attempt refunded) instead of waiting out their lease."""
    if not claimed:
        return
    outcomes = [
        Outcome.retry(c, delay=timedelta(0), error=reason, refund_attempt=True) for c in claimed
    ]
    table = rt.settings.outbox_table
    try:
        rt.db().run(lambda conn: store.finalize(conn, outcomes, table=table))
    except Exception:
        log.exception("could not release %d claimed rows; their leases will expire", len(claimed))


def _batched(producer: Any) -> AbstractContextManager[Any]:
    """Group the fan-out into one broker round trip where the transport can.

    kombu >= 5.7 buffers Redis publishes in one pipeline inside
    ``Producer.batch()`` and flushes at the end (AMQP publishes at once). If
    the flush fails, the ``except`` in ``_fan_out`` releases the rows.
    """
    batch = getattr(producer, "batch", None)
    return batch() if batch is not None else nullcontext()


def _fan_out(
    rt: RelayRuntime,
    claimed: list[Claimed],
    deliver: Any,
    deliver_batch: Any,
    follow_up: Any = None,
) -> None:
    """Send the delivery tasks; ``follow_up`` (a claim) goes in halfway through.

    A drain's next claim sits in the queue behind half of this round's
    deliveries: it runs while the other half is still queued, so the workers
    never wait on an empty queue between rounds, and the broker holds about
    one round at a time (self-pacing, whatever the workers' speed).
    """
    s = rt.settings
    size = s.chunk_size
    chunks = [claimed[i : i + size] for i in range(0, len(claimed), size)]
    halfway = len(chunks) // 2
    # Expire before the lease does, leaving room for a whole publish: a task
    # that starts later than that would be turned away by the fence anyway.
    expires = max(1.0, s.lease_seconds - s.publish_timeout_seconds)
    soft_limit, hard_limit = rt.time_limits()
    annotated = task_annotations(rt.app, DELIVER_BATCH if size > 1 else DELIVER)
    try:
        with rt.app.producer_or_acquire() as producer, _batched(producer):
            for number, chunk in enumerate(chunks):
                if follow_up is not None and number == halfway:
                    follow_up(producer)
                refs = [c.ref for c in chunk]
                options: dict[str, Any] = {
                    "queue": s.queue,
                    "expires": expires,
                    "producer": producer,
                    "argsrepr": _argsrepr(refs),
                    "serializer": "json",
                }
                if "time_limit" not in annotated:
                    options["time_limit"] = hard_limit
                if "soft_time_limit" not in annotated:
                    options["soft_time_limit"] = soft_limit
                if size == 1:
                    deliver.apply_async((refs[0].id, refs[0].lease_version), **options)
                else:
                    pairs = [[r.id, r.lease_version] for r in refs]
                    deliver_batch.apply_async((pairs,), **options)
    except Exception:
        # Some tasks may have reached the broker before the failure (a batch
        # flushes as it fills). Release every row anyway: a task that did
        # arrive finds a newer lease_version and is turned away by the fence.
        log.exception("fan-out to the broker failed; releasing %d claimed rows", len(claimed))
        _release(rt, claimed, "released unpublished: fan-out to the broker failed")
        raise


def _claim_and_fan_out(
    rt: RelayRuntime, claim: Any, deliver: Any, deliver_batch: Any, held_back: int
) -> dict[str, int]:
    s = rt.settings
    table = s.outbox_table
    db = rt.db()
    in_flight = db.run(lambda conn: store.in_flight(conn, table=table))
    room = min(s.batch_size, s.max_in_flight - in_flight)
    if room <= 0:
        # Backpressure: workers are behind. Look again after the deliveries
        # queued meanwhile; after a few rounds with no progress (leases held
        # by a dead worker, say), stop and leave it to the next beat tick.
        if held_back < MAX_HELD_BACK_ROUNDS:
            claim.apply_async((held_back + 1,), queue=s.queue, serializer="json")
        return {"claimed": 0}

    lease = rt.lease()
    max_attempts = rt.policy().max_attempts

    def take(conn: Any) -> list[Claimed]:
        return store.claim(
            conn,
            owner=rt.owner,
            batch=room,
            lease=lease,
            max_attempts=max_attempts,
            ordered=s.ordered_event_types,
            table=table,
        )

    claimed = db.run(take)

    def follow_up(producer: Any) -> None:
        claim.apply_async(queue=s.queue, serializer="json", producer=producer)

    if claimed:
        # A full batch means more is probably due: the drain continues with a
        # claim queued inside this round, instead of waiting for beat.
        full = len(claimed) == room
        _fan_out(rt, claimed, deliver, deliver_batch, follow_up if full else None)
    return {"claimed": len(claimed)}
