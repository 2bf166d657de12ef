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
from .durable import DURABLE_EVENT, HEADER_ID, HEADER_LEASE_VERSION
from .durable_run import begin_margin

__all__ = [
    "DurableSends",
    "declare_queue",
    "declare_routed_queue",
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
    # Queues this round has declared, with their bindings (declare_routed_queue).
    declared: set[tuple[str, str, str]] = field(default_factory=set)

    def outcomes(self) -> list[Outcome]:
        return [Outcome.done(row) for row in self.handed_off] + self.broken


def _lease(row: Claimed, settings: Settings) -> float:
    value = (row.headers or {}).get("lease_seconds")
    return float(value) if isinstance(value, (int, float)) else settings.lease_seconds


def _chain_option(app: Any, chain: Sequence[Any]) -> list[Any] | None:
    if not chain:
        return None
    from celery import signature

    # Celery's message protocol carries the rest of a chain last step first.
    return [signature(dict(step), app=app) for step in reversed(chain)]


def declare_routed_queue(
    app: Any,
    producer: Any,
    name: str,
    declared: set[tuple[str, str, str]],
    options: dict[str, Any] | None = None,
    args: Any = (),
    kwargs: Any = None,
) -> None:
    """Declare the queue Celery will route this task to, once per round.

    Celery declares a task's queue with every message it sends (kombu
    caches the declaration per connection, but binds a fresh copy of the
    queue each time: a fifth of a per-message fan-out, a quarter of a
    durable task's send). Routed here as Celery routes it (a route may
    depend on the options or arguments) and declared on this producer's
    connection unless ``declared`` (the round's) already holds it; the
    message then goes with ``declare=[]``. Each round declares again, so a
    broker that lost its queue has it back before the round is sent, and
    RabbitMQ never drops a message for a queue no worker has declared yet.
    """
    queue = app.amqp.router.route(dict(options or {}), name, args, kwargs or {}).get("queue")
    declare_queue(producer, queue, declared)


def declare_queue(producer: Any, queue: Any, declared: set[tuple[str, str, str]]) -> None:
    """Declare a routed ``queue`` on ``producer``'s connection unless the round's
    ``declared`` holds it already (see ``declare_routed_queue``)."""
    # Celery never declares a broadcast queue for a sent task either.
    if not isinstance(queue, Queue) or isinstance(queue, Broadcast):
        return
    exchange = queue.exchange.name if queue.exchange is not None else ""
    key = (queue.name, exchange, queue.routing_key)
    if key not in declared:
        producer.maybe_declare(queue)
        declared.add(key)


def send_durable(
    app: Any,
    settings: Settings,
    producer: Any,
    row: Claimed,
    sends: DurableSends,
    lineage: dict[str, Any],
) -> None:
    """Send one claimed durable row's task; note what must be finalized.

    ``lineage``: the claim task's ``parent_id``/``root_id``, looked up once
    per round by the fan-out (``add_to_parent`` off, as for its deliveries).
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
    lease = _lease(row, settings)
    row_label = f"(outbox #{row.id} v{row.lease_version})"
    declare_routed_queue(app, producer, name, sends.declared, options, args, kwargs)
    send: dict[str, Any] = {
        **options,
        **lineage,
        "declare": [],
        "task_id": task_id,
        "producer": producer,
        "serializer": "json",
        "argsrepr": row_label,
        "kwargsrepr": "{" + ", ".join(f"{k!r}: ..." for k in kwargs) + "}" if kwargs else "{}",
    }
    if track:
        send["headers"] = {HEADER_ID: row.id, HEADER_LEASE_VERSION: row.lease_version}
        send["expires"] = max(1.0, lease - begin_margin(lease))
    else:
        # The rest of the chain continues as Celery's own (see the module doc).
        send["chain"] = _chain_option(app, chain)
    # send_task, not Task.apply_async: never run inline (task_always_eager),
    # and no need for the task to be registered in the relay's process.
    app.send_task(name, args=args, kwargs=kwargs, **send)
    if not track:
        sends.handed_off.append(row)
