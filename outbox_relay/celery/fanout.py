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
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from ..config import Settings
from ..db import Database
from ..model import Claimed, Outcome
from ..store import finalize
from .durable_send import DurableSends, declare_queue, is_durable_row, send_durable
from .options import time_limits
from .sender import RoundSender, Route, argsrepr

__all__ = [
    "CHUNK_PAYLOAD_BYTES",
    "DrainPlan",
    "chunk_size_for",
    "chunked",
    "drain_plan",
    "fan_out",
    "release",
]

log = logging.getLogger("outbox_relay.celery")


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


# At most this many bytes of payload, as stored (Claimed.stored_bytes), in one
# delivery task. A task reads its chunk's payloads at once and decodes them
# into Python objects several times their JSON size (more again for JSON
# that compresses well, as stored sizes count it), and with a slow receiver
# all of a chunk's publishes are under way together: chunks of 200 payloads
# of 420 kB (58 kB stored) took a worker from 360 MB to 1.46 GB. Rows of
# the usual few kilobytes fill a chunk of 500 long before this.
CHUNK_PAYLOAD_BYTES = 1 << 20


def chunked(
    claimed: Sequence[Claimed], size: int, budget: int = CHUNK_PAYLOAD_BYTES
) -> list[list[Claimed]]:
    """Split a claim into delivery tasks of up to ``size`` rows, in claim order,
    and of up to ``budget`` bytes of stored payload (one row at least).

    A row whose last delivery was interrupted (its process died or hung
    under it) goes alone: a poison message that kills the process
    publishing it would otherwise take its whole chunk with it every time,
    and its innocent neighbours, whose attempts are counted with the
    chunk's, would reach the attempt limit beside it. A retry whose
    delivery ended with an outcome (a failed publish, classified) is no such
    suspect and is chunked like any row: after a receiver's outage the
    retries go out at chunked speed, not one task each.
    """
    chunks: list[list[Claimed]] = []
    current: list[Claimed] = []
    held = 0
    for row in claimed:
        if row.interrupted and size > 1:
            chunks.append([row])
            continue
        if current and held + row.stored_bytes > budget:
            chunks.append(current)
            current, held = [], 0
        current.append(row)
        held += row.stored_bytes
        if len(current) == size:
            chunks.append(current)
            current, held = [], 0
    if current:
        chunks.append(current)
    return chunks


def chunk_size_for(limit: int, cap: int | None, processes: int) -> int:
    """The rows per delivery task: ``limit`` (OUTBOX_CHUNK_SIZE), or less, so
    that every pool process can hold a chunk under the in-flight cap.

    A pool process delivers one chunk at a time, and the cap counts every
    leased row. Chunks of 500 under the default cap of 1,000 let two tasks be
    in flight at once: two of four processes stayed idle for a whole drain
    (51% of the pool's time with a no-op publisher, 56% with 20 ms
    publishes). ``processes``: this worker's concurrency (0: unknown, the
    setting stands); a claim's tasks may also go to other workers' pools.
    """
    if limit <= 1 or processes <= 1 or not cap:
        return max(1, limit)
    return max(1, min(limit, cap // processes))


@dataclass(frozen=True)
class DrainPlan:
    """Where a round's next claim goes: queued as a task of its own just before
    delivery task ``queued_at``, or sent by delivery task ``marked`` as it
    starts (``when="start"``) or once its rows are finished (``"end"``)."""

    queued_at: int = -1
    marked: int = -1
    when: str = "start"


def drain_plan(tasks: int, *, prefetched: int, tight: bool, durable: int = 0) -> DrainPlan:
    """The placement ``fan_out`` explains, for a round of ``tasks`` delivery
    tasks sent before ``durable`` durable tasks.

    ``prefetched``: what one worker takes from the queue ahead of time (0:
    unknown, Celery's default multiplier of 4 per CPU is assumed); ``tight``:
    only finished rows make room for the next claim. A durable task is the
    user's and cannot carry the claim: a round of durable tasks only queues
    it among them. (Left to the finished runs' claim hints, at most one per
    process every half second, the drain stopped whenever a round's runs
    all finished within one such half second, until beat's next tick:
    bursts of 200 rows every 5 s on a host that runs 1,000 a second.)
    """
    if tasks == 0:
        return DrainPlan(queued_at=durable // 2) if durable else DrainPlan()
    halfway = tasks // 2
    window = prefetched or 4 * (os.cpu_count() or 1)
    if not tight and tasks > 2 * window:
        return DrainPlan(queued_at=halfway)
    return DrainPlan(marked=halfway, when="end" if tight else "start")


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
    prefetched: int = 0,
    processes: int = 0,
    capped: bool = False,
    headers: dict[str, Any] | None = None,
) -> None:
    """Send the delivery tasks, and with them the drain's next claim (``follow_up``).

    The next claim should run when about half of this round is delivered:
    it then finds room under the in-flight cap, and its deliveries queue up
    behind the other half, so the workers never wait on an empty queue
    between rounds. Where it goes depends on the round's size against what
    a worker takes from the queue ahead of time (``prefetched``, its
    concurrency x ``worker_prefetch_multiplier``):

    * a long round: the claim is queued as a task of its own halfway
      through; it is reached when half the round has been taken;
    * a short round (chunks of 50 from a batch of 500 are 10 tasks): a worker
      prefetches the whole round at once, so a claim queued among them would
      run at once, find the cap reached, and after a few empty rounds stop
      the drain until beat's next tick (seen as 4 s stalls every 5 s). The
      delivery task halfway through sends the claim as it starts instead.
      If that one task is lost, beat's tick starts the drain again;
    * a round the in-flight cap cut short (``capped``), or a cap too tight
      for two whole batches (OUTBOX_MAX_IN_FLIGHT < 2 x OUTBOX_BATCH_SIZE,
      as with the defaults' 1000 and a batch of 1000): only finished rows
      make room, so the delivery task halfway through sends the claim once
      its own rows are finished (sent as it starts, the claim found no room
      and waited for a held-back round: 4 s pauses with chunks of 500).

    Chunks are ``OUTBOX_CHUNK_SIZE`` rows at most, fewer where this worker's
    ``processes`` could not each hold one under the cap (``chunk_size_for``).
    ``headers``: on every delivery task (the relay's identity, celery/identity.py).
    """
    # Durable task rows are sent as their own task (one hop), one message
    # each, after the plain chunks: the drain's plan counts the plain chunks
    # only, so its marked delivery task is never a durable one (a durable
    # run that finishes asks for a claim of its own).
    durable = [c for c in claimed if is_durable_row(c)]
    plain = [c for c in claimed if not is_durable_row(c)] if durable else claimed
    size = chunk_size_for(settings.chunk_size, settings.max_in_flight, processes)
    plain_chunks = chunked(plain, size)
    chunks: list[list[Claimed]] = [*plain_chunks, *([c] for c in durable)]
    sends = DurableSends()
    cap = settings.max_in_flight
    tight = capped or (cap is not None and cap < 2 * settings.batch_size)
    plan = drain_plan(len(plain_chunks), prefetched=prefetched, tight=tight, durable=len(durable))
    if follow_up is None:
        plan = DrainPlan()
    expires = max(1.0, settings.lease_seconds - settings.worst_delivery_seconds)
    soft_limit, hard_limit = time_limits(settings)
    common: dict[str, Any] = {"expires": expires, "serializer": "json"}
    if "time_limit" not in annotated:
        common["time_limit"] = hard_limit
    if "soft_time_limit" not in annotated:
        common["soft_time_limit"] = soft_limit
    # The claim task's lineage, looked up once per round: Celery would look
    # up the current task twice per message sent, and keep a result object
    # for each in the claim's request (add_to_parent) until it returns.
    # Delivery and durable tasks alike.
    lineage: dict[str, Any] = {"add_to_parent": False}
    parent = app.current_worker_task
    if parent is not None and getattr(parent.request, "id", None):
        lineage["parent_id"] = parent.request.id
        lineage["root_id"] = parent.request.root_id or parent.request.id
    common.update(lineage, declare=[])
    try:
        with app.producer_or_acquire() as producer, _batched(producer):
            # Each delivery task this round sends, routed once (RoundSender),
            # and the queue it routes to declared once per round, not per
            # message (see declare_queue); not the other task's.
            sender = RoundSender(app, producer)
            routes: dict[str, Route] = {}
            for task in sorted(
                {deliver if len(c) == 1 else deliver_batch for c in plain_chunks},
                key=lambda t: str(t.name),
            ):
                route = sender.for_task(task, common)
                declare_queue(producer, route.options.get("queue"), sends.declared)
                if headers:
                    # Once per round, not merged into each message's options.
                    route = replace(route, options={**route.options, "headers": headers})
                routes[task.name] = route
            for number, chunk in enumerate(chunks):
                if number == plan.queued_at:
                    assert follow_up is not None
                    follow_up(producer)
                if is_durable_row(chunk[0]):
                    send_durable(sender, settings, chunk[0], sends, lineage)
                    continue
                refs = [c.ref for c in chunk]
                kwargs = {"drain": plan.when} if number == plan.marked else {}
                args: tuple[Any, ...]
                if len(refs) == 1:
                    route = routes[deliver.name]
                    args = (refs[0].id, refs[0].lease_version)
                else:
                    route = routes[deliver_batch.name]
                    args = ([[r.id, r.lease_version] for r in refs],)
                # Both reprs given: Celery would otherwise saferepr() each
                # task's arguments (a twentieth of a per-message fan-out).
                sender.send(route, args, kwargs, argsrepr=argsrepr(refs), kwargsrepr=repr(kwargs))
    except Exception:
        # Some tasks may have reached the broker before the failure (a batch
        # flushes as it fills). Release every row anyway: a task that arrives
        # later finds the row released (or under a newer lease_version) and is
        # turned away by the fence; a row whose task already began is left to
        # it (release's unless_begun).
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
