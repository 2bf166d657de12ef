"""The relay's side of durable tasks: a claimed ``celery.durable`` row is sent
as the task itself (one hop), not as an ``outbox_relay.deliver`` task.

The message carries the row's fixed task id, ``(outbox id, lease_version)``
in its headers, the routing options stored on the row, and ``expires`` once
the lease left is too short for the run to begin (a backlogged task is
dropped, never run late; its lease then lapses and the row is sent again).
Flower and worker logs show ``(outbox #id vN)`` instead of the arguments.

A hand-off row (a non-durable step of a durable chain) is sent the same way
and marked done once the broker has it; the rest of its chain travels in
the message as Celery's own chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kombu.common import Broadcast
from kombu.entity import Queue

from ..config import Settings
from ..model import Claimed, Outcome
from .durable import DURABLE_EVENT, HEADER_ID, HEADER_LEASE_VERSION, row_lease
from .durable_run import begin_margin
from .sender import RoundSender, argsrepr, kwargsrepr

__all__ = [
    "DurableSends",
    "declare_queue",
    "is_durable_row",
    "send_durable",
]


def is_durable_row(row: Claimed) -> bool:
    return row.event_type == DURABLE_EVENT


@dataclass
class DurableSends:
    """What the fan-out must finalize after sending durable rows, and the
    queues its round has declared."""

    handed_off: list[Claimed] = field(default_factory=list)
    broken: list[Outcome] = field(default_factory=list)
    # Queues this round has declared, with their bindings (declare_queue).
    declared: set[tuple[str, str, str]] = field(default_factory=set)

    def outcomes(self) -> list[Outcome]:
        return [Outcome.done(row) for row in self.handed_off] + self.broken


def _chain_option(app: Any, chain: Sequence[Any]) -> list[Any] | None:
    if not chain:
        return None
    from celery import signature

    # Celery's message protocol carries the rest of a chain last step first.
    return [signature(dict(step), app=app) for step in reversed(chain)]


def declare_queue(producer: Any, queue: Any, declared: set[tuple[str, str, str]]) -> None:
    """Declare a routed ``queue`` on ``producer``'s connection, once per round.

    Celery declares a task's queue with every message it sends (kombu
    caches the declaration per connection, but binds a fresh copy of the
    queue each time: a fifth of a per-message fan-out, a quarter of a
    durable task's send). Declared here on this producer's connection unless
    ``declared`` (the round's) already holds it; the message then goes with
    ``declare=[]``. Each round declares again, so a broker that lost its
    queue has it back before the round is sent, and RabbitMQ never drops a
    message for a queue no worker has declared yet.
    """
    # Celery never declares a broadcast queue for a sent task either.
    if not isinstance(queue, Queue) or isinstance(queue, Broadcast):
        return
    exchange = queue.exchange.name if queue.exchange is not None else ""
    key = (queue.name, exchange, queue.routing_key)
    if key not in declared:
        producer.maybe_declare(queue)
        declared.add(key)


def send_durable(
    sender: RoundSender,
    settings: Settings,
    row: Claimed,
    sends: DurableSends,
    lineage: dict[str, Any],
) -> None:
    """Send one claimed durable row's task; note what must be finalized.

    ``lineage``: the claim task's ``parent_id``/``root_id``, looked up once
    per round by the fan-out (``add_to_parent`` off, as for its deliveries).
    Sent as ``app.send_task`` would send it (``RoundSender.for_name``), never
    run inline (``task_always_eager``), and the task need not be registered
    in the relay's process.
    """
    payload = row.payload if isinstance(row.payload, dict) else {}
    try:
        name = str(payload["task"])
        task_id = str(payload["id"])
        args = list(payload.get("args") or [])
        kwargs = dict(payload.get("kwargs") or {})
        options = dict(payload.get("options") or {})
        track = bool(payload.get("track", True))
        chain = list(payload.get("chain") or [])
    except (KeyError, TypeError, ValueError) as exc:
        # Written by hand or by a version that knew another layout: nothing
        # can run it, and it must not block the rest of the claim.
        sends.broken.append(
            Outcome.dead(row, error=f"not a durable task row ({type(exc).__name__}: {exc})")
        )
        return
    send: dict[str, Any] = {**options, **lineage, "declare": [], "serializer": "json"}
    headers: dict[str, Any] | None = None
    if track:
        headers = {HEADER_ID: row.id, HEADER_LEASE_VERSION: row.lease_version}
        lease = row_lease(row.headers, settings.lease_seconds)
        send["expires"] = max(1.0, lease - begin_margin(lease))
    # Routed once, with the row's arguments (a user's router may read them);
    # its queue declared once per round.
    route = sender.for_name(name, send, args, kwargs)
    declare_queue(sender.producer, route.options.get("queue"), sends.declared)
    sender.send(
        route,
        args,
        kwargs,
        task_id=task_id,
        argsrepr=argsrepr([row.ref]),
        kwargsrepr=kwargsrepr(kwargs),
        headers=headers,
        # The rest of the chain continues as Celery's own (see the module doc).
        chain=None if track else _chain_option(sender.app, chain),
    )
    if not track:
        sends.handed_off.append(row)
