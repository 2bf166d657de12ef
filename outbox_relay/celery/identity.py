"""Telling this relay's Celery tasks from another relay's on one queue.

The relay's tasks carry only ``(id, lease_version)``. Two relays whose
workers consume one broker queue (two services on one Redis database, both
with the default queue ``outbox``) take each other's tasks: a delivery that
lands on the other relay matches no lease there and is skipped as stale, and
its row waits out its lease, lease after lease (seen: nine leases in a row).

Every delivery task and claim hint the relay sends carries its identity in a
message header (``ORIGIN_HEADER``): the database's name, the table, and a
digest of when the table's first migration was applied, so that every DSN
of one database agrees and another database of the same name does not. A
worker that receives another relay's task runs none of it: it sends the
task back to the queue, where that relay's workers may take it, at most
``MAX_HOPS`` times, and logs an error naming the fix at most once a minute.
A task without the header (beat's ticks, an older release's, or one sent
before the identity could be read) is anyone's, as before.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable
from typing import Any

from .._throttle import Throttle
from ..table import OutboxTable

__all__ = [
    "HOPS_HEADER",
    "MAX_HOPS",
    "ORIGIN_HEADER",
    "hold_back",
    "identity_of",
    "origin_headers",
    "send_back_if_foreign",
]

log = logging.getLogger("outbox_relay.celery")

ORIGIN_HEADER = "outbox_relay_origin"
HOPS_HEADER = "outbox_relay_hops"
# Sends back per task; a delivery task's own expiry (before its lease ends)
# comes first. After the last, the task is dropped and its row waits out its
# lease, as it would without any of this.
MAX_HOPS = 60
# The error a misconfiguration earns, at most this often per process.
REPORT_EVERY_SECONDS = 60.0


def identity_of(database: str, table: OutboxTable, first_migration_at: str) -> str:
    """``database/schema.table/digest``: readable in a log, unique per table."""
    key = f"{database}\0{table.qualified}\0{first_migration_at}".encode()
    return f"{database}/{table.qualified}/{hashlib.sha256(key).hexdigest()[:12]}"


def hold_back(hops: int) -> float:
    """Seconds a task sent back ``hops`` times before waits in the worker that
    takes it next: none for the first two sends (the other relay's workers
    usually take it), then 50 ms doubling up to 1 s, half of it random.

    While the other relay's workers are all busy, their prefetch full, only
    this relay's workers take from the queue: sent back at once, the task
    came straight back to them, ten times in 100 ms. Held, it takes no pool
    process here (Celery keeps a task that is not yet due aside). Random,
    because RabbitMQ hands messages to its consumers in turn: two relays
    sending back one task of the other's each, on the same fixed beat, were
    each handed their own back every time, until the delivery expired."""
    if hops < 2:
        return 0.0
    ceiling = min(1.0, 0.05 * 2.0 ** (hops - 2))
    return ceiling / 2 + random.uniform(0.0, ceiling / 2)  # noqa: S311 (timing, no secret)


def origin_headers(own: str | None) -> dict[str, Any]:
    """The headers a relay task is sent with (none while the identity is unknown)."""
    return {ORIGIN_HEADER: own} if own else {}


# Foreign tasks taken: one error line a while, with the count.
_reports = Throttle(REPORT_EVERY_SECONDS)


def send_back_if_foreign(task: Any, own: str | None, queue: Callable[[], str]) -> bool:
    """Whether ``task`` (a relay task, running) was sent by another relay.

    If so it is sent back to the queue with its arguments, expiry and time
    limits (or dropped after ``MAX_HOPS``), and the caller must run none of
    it. ``own``: this relay's identity (None: unknown, every task is ours).
    """
    origin = task.request.get(ORIGIN_HEADER)
    if not origin or own is None or origin == own:
        return False
    try:
        hops = int(task.request.get(HOPS_HEADER) or 0)
    except (TypeError, ValueError):
        hops = MAX_HOPS
    if hops < MAX_HOPS:
        hard, soft = task.request.timelimit or (None, None)
        try:
            task.apply_async(
                task.request.args,
                task.request.kwargs,
                countdown=hold_back(hops),
                # The same id, as Task.retry sends it: one task in Flower.
                task_id=task.request.id,
                headers={ORIGIN_HEADER: origin, HOPS_HEADER: hops + 1},
                expires=task.request.expires,
                time_limit=hard,
                soft_time_limit=soft,
                serializer="json",
            )
        except Exception:
            # Its row waits out its lease, as if the task were lost.
            log.warning("could not send back another relay's task", exc_info=True)
    _report(str(origin), own, queue, task.name)
    return True


def _report(origin: str, own: str, queue: Callable[[], str], name: str) -> None:
    due = _reports.hit()
    if due is None:
        return
    log.error(
        "outbox-relay: this worker took %d task(s) of another relay (%s, the first %s) from "
        "queue %r, which this relay (%s) consumes: two relays share one queue, and each "
        "delays the other's deliveries by a lease or more. Give each relay a queue of its "
        "own (OUTBOX_QUEUE, or install(app, queue=...)), or a vhost or Redis database of its "
        "own. Such tasks are sent back to the queue, up to %d times each, and never run here",
        due.count,
        origin,
        name,
        queue(),
        own,
        MAX_HOPS,
    )
