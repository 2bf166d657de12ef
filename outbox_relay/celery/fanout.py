"""Sending the delivery tasks of one claim: the Celery side of the claimer.

Fan-out messages carry only ``(id, lease_version)`` pairs and expire before
the lease can no longer fit a whole delivery, so a backlogged task is dropped
instead of publishing late (it costs its row nothing: the attempt is counted
when a delivery begins, and the rescuer frees the lease). No explicit queue:
the user's ``task_routes`` decide, with the relay's own route (the
``outbox`` queue) after them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from ..config import Settings
from ..db import Database
from ..model import Claimed, LeaseRef, Outcome
from ..store import finalize
from .durable_send import DurableSends, is_durable_row, send_durable
from .options import time_limits

__all__ = ["argsrepr", "chunked", "fan_out", "release"]

log = logging.getLogger("outbox_relay.celery")


def argsrepr(refs: Sequence[LeaseRef]) -> str:
    """What Flower shows as the task's arguments: ids, never payloads."""
    if len(refs) == 1:
        return f"(outbox #{refs[0].id} v{refs[0].lease_version})"
    return f"({len(refs)} outbox messages #{refs[0].id}..#{refs[-1].id})"


def release(db: Database, settings: Settings, claimed: Sequence[Claimed], reason: str) -> None:
    """Give rows back at once instead of waiting out their lease (nothing was counted)."""
    if not claimed:
        return
    # unless_begun: a task that did reach a worker and began is publishing
    # under this very lease; taking the row from it would only force a
    # duplicate (docs/model.md, finding 2).
    outcomes = [Outcome.release(c, reason=reason, unless_begun=True) for c in claimed]
    try:
        db.run(lambda conn: finalize(conn, outcomes, table=settings.outbox_table))
    except Exception:
        log.exception("could not release %d claimed rows; their leases will expire", len(claimed))


def chunked(claimed: Sequence[Claimed], size: int) -> list[list[Claimed]]:
    """Split a claim into delivery tasks of up to ``size`` rows, in claim order.

    A row that was attempted before (a publish failed, or its worker died
    mid-delivery) goes alone: a poison message that kills the process
    publishing it would otherwise take its whole chunk with it every time,
    and its innocent neighbours, whose attempts are counted with the
    chunk's, would reach the attempt limit beside it.
    """
    chunks: list[list[Claimed]] = []
    current: list[Claimed] = []
    for row in claimed:
        if row.attempts > 0 and size > 1:
            chunks.append([row])
            continue
        current.append(row)
        if len(current) == size:
            chunks.append(current)
            current = []
    if current:
        chunks.append(current)
    return chunks


def _batched(producer: Any) -> AbstractContextManager[Any]:
    """Group the fan-out into one broker round trip where the transport can.

    kombu >= 5.7 buffers Redis publishes in one pipeline inside
    ``Producer.batch()`` and flushes at the end (AMQP publishes at once). If
    the flush fails, ``fan_out`` releases the rows.
    """
    batch = getattr(producer, "batch", None)
    return batch() if batch is not None else nullcontext()


def fan_out(
    app: Any,
    settings: Settings,
    db: Database,
    claimed: list[Claimed],
    *,
    deliver: Any,
    deliver_batch: Any,
    annotated: dict[str, Any],
    follow_up: Callable[[Any], None] | None = None,
) -> None:
    """Send the delivery tasks; ``follow_up`` (a claim) goes in halfway through.

    A drain's next claim sits in the queue behind half of this round's
    deliveries: it runs while the other half is still queued, so the workers
    never wait on an empty queue between rounds, and the broker holds about
    one round at a time (self-pacing, whatever the workers' speed).
    """
    size = settings.chunk_size
    # Durable task rows are sent as their own task (one hop), one message each.
    durable = [c for c in claimed if is_durable_row(c)]
    plain = [c for c in claimed if not is_durable_row(c)] if durable else claimed
    chunks: list[list[Claimed]] = [*chunked(plain, size), *([c] for c in durable)]
    halfway = len(chunks) // 2
    expires = max(1.0, settings.lease_seconds - settings.worst_delivery_seconds)
    soft_limit, hard_limit = time_limits(settings)
    sends = DurableSends()
    try:
        with app.producer_or_acquire() as producer, _batched(producer):
            for number, chunk in enumerate(chunks):
                if follow_up is not None and number == halfway:
                    follow_up(producer)
                if is_durable_row(chunk[0]):
                    send_durable(app, settings, producer, chunk[0], sends)
                    continue
                refs = [c.ref for c in chunk]
                options: dict[str, Any] = {
                    "expires": expires,
                    "producer": producer,
                    "argsrepr": argsrepr(refs),
                    "serializer": "json",
                }
                if "time_limit" not in annotated:
                    options["time_limit"] = hard_limit
                if "soft_time_limit" not in annotated:
                    options["soft_time_limit"] = soft_limit
                if len(refs) == 1:
                    deliver.apply_async((refs[0].id, refs[0].lease_version), **options)
                else:
                    pairs = [[r.id, r.lease_version] for r in refs]
                    deliver_batch.apply_async((pairs,), **options)
    except Exception:
        # Some tasks may have reached the broker before the failure (a batch
        # flushes as it fills). Release every row anyway: a task that did
        # arrive finds a newer lease_version and is turned away by the fence.
        log.exception("fan-out to the broker failed; releasing %d claimed rows", len(claimed))
        release(db, settings, claimed, "fan-out to the broker failed")
        raise
    outcomes = sends.outcomes()
    if outcomes:
        try:
            db.run(lambda conn: finalize(conn, outcomes, table=settings.outbox_table))
        except Exception:
            # Their leases lapse and they are sent again, with the same task ids.
            log.exception("could not finalize %d handed-off durable rows", len(outcomes))
