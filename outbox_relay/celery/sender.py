"""Sending a round of tasks: what Celery works out per message, worked out once.

``Task.apply_async`` and ``Celery.send_task`` read the task's options, route
the message, look up settings in the app's configuration (9 us each when
the app was configured from a module), read the clock for the expiry and
make a result object, for every message. For the fan-out's delivery tasks
that was 153 us per message sent, two thirds of it the same for every
message of a round (one process against Redis, 3,000 sends in a batch,
medians of 5: 153 against 50 us); a durable row's ``send_task`` was a fifth
of the pool's time in a durable-task run, three times the publish itself.

``RoundSender`` reads the round's constants once (clock, configuration,
origin); ``for_task`` works out a delivery task's options once per round,
``for_name`` a durable row's (each row has its own task, options and
routing: a user's router may read its arguments). ``send`` hands each
message to Celery's own ``create_task_message`` and ``send_task_message``,
which build the protocol's message and publish it (``before_task_publish``
/ ``after_task_publish`` signals, the task-sent event, the retry policy)
exactly as ``apply_async`` and ``send_task`` would. Options a relay send
never carries (countdown, eta, links, stamps) are not worked out here.

A delivery task's round is routed once, without the message's arguments
(ids and lease versions): the user's ``task_routes`` and the task's own
options decide, and the fan-out declares the queue this route names
(``options["queue"]``) once per round. The expiry is fixed when the round
starts; its sends take milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery.utils.nodenames import anon_nodename
from celery.utils.time import maybe_make_aware
from kombu.utils.uuid import uuid

from ..model import LeaseRef

__all__ = ["RoundSender", "Route", "argsrepr", "kwargsrepr"]


def argsrepr(refs: Sequence[LeaseRef]) -> str:
    """What Flower, events and worker logs show as a task's arguments: the
    outbox rows, never their payloads (they may hold personal data)."""
    if len(refs) == 1:
        return f"(outbox #{refs[0].id} v{refs[0].lease_version})"
    return f"({len(refs)} outbox messages #{refs[0].id}..#{refs[-1].id})"


def kwargsrepr(names: Iterable[str]) -> str:
    """What they show as its keyword arguments: the names alone."""
    return "{" + ", ".join(f"{k!r}: ..." for k in names) + "}"


@dataclass(frozen=True)
class Route:
    """One task's options for a send, split as Celery splits them: the routed
    ``options`` (queue, exchange, priority, serializer, the broker's TTL ...)
    go to ``send_task_message``, the rest into the message's headers."""

    name: str
    options: dict[str, Any]
    time_limit: Any = None
    soft_time_limit: Any = None
    # None: not given (``send_task``'s default, written as such in the headers).
    ignore_result: bool | None = None
    expires: str | None = None
    root_id: str | None = None
    parent_id: str | None = None


class RoundSender:
    """Sends one round's messages on ``producer`` as ``apply_async`` / ``send_task`` would."""

    def __init__(self, app: Any, producer: Any) -> None:
        self.app = app
        self.producer = producer
        self.now = app.now()
        self.sent_event = bool(app.conf.task_send_sent_event)
        self.reply_to = app.thread_oid
        self.origin = anon_nodename()
        # Per task name: the registered task and its own options (for_name).
        self._registered: dict[str, tuple[Any, dict[str, Any]]] = {}

    def for_task(self, task: Any, options: dict[str, Any]) -> Route:
        """``task.apply_async(**options)``'s options: the task's own
        execution options (its annotations' queue, priority, time limits
        ...) under the caller's, routed without the message's arguments."""
        # Task's own cached reader of them, the one apply_async calls (since Celery 4).
        merged: dict[str, Any] = {**task._get_exec_options(), **options}
        merged.setdefault("ignore_result", task.ignore_result)
        return self._route(task.name, merged, (), {}, task)

    def for_name(
        self, name: str, options: dict[str, Any], args: Any = (), kwargs: Any = None
    ) -> Route:
        """``app.send_task(name, args, kwargs, **options)``'s options: those
        of the task if it is registered here (not None), under the caller's;
        routed with the message's arguments, as ``send_task`` routes."""
        found = self._registered.get(name)
        if found is None:
            task = self.app._tasks.get(name)
            own = task._get_exec_options() if task is not None else {}
            found = self._registered[name] = (
                task,
                {k: v for k, v in own.items() if v is not None},
            )
        task, own = found
        return self._route(name, {**own, **options}, args, kwargs or {}, task)

    def _route(self, name: str, merged: dict[str, Any], args: Any, kwargs: Any, task: Any) -> Route:
        merged.pop("add_to_parent", None)  # never a result object to add
        time_limit = merged.pop("time_limit", None)
        soft_time_limit = merged.pop("soft_time_limit", None)
        ignore_result = merged.pop("ignore_result", None)
        root_id = merged.pop("root_id", None)
        parent_id = merged.pop("parent_id", None)
        seconds = merged.pop("expires", None)
        expires: str | None = None
        if seconds is not None:
            seconds = max(0.0, float(seconds))
            # The header Celery checks in the worker (in the app's time zone,
            # as Celery writes it), and the broker's TTL.
            at = maybe_make_aware(self.now + timedelta(seconds=seconds), tz=self.app.timezone)
            expires = at.isoformat()
            merged["expiration"] = seconds
        return Route(
            name=name,
            options=self.app.amqp.router.route(merged, name, args, kwargs, task),
            time_limit=time_limit,
            soft_time_limit=soft_time_limit,
            ignore_result=None if ignore_result is None else bool(ignore_result),
            expires=expires,
            root_id=root_id,
            parent_id=parent_id,
        )

    def send(
        self,
        route: Route,
        args: tuple[Any, ...] | list[Any],
        kwargs: dict[str, Any] | None,
        *,
        argsrepr: str,
        kwargsrepr: str,
        task_id: str | None = None,
        headers: dict[str, Any] | None = None,
        chain: list[Any] | None = None,
    ) -> str:
        """Send one message; return its task id (a new one unless given)."""
        amqp = self.app.amqp
        task_id = task_id or uuid()
        message = amqp.create_task_message(
            task_id,
            route.name,
            args,
            kwargs or {},
            expires=route.expires,
            reply_to=self.reply_to,
            time_limit=route.time_limit,
            soft_time_limit=route.soft_time_limit,
            create_sent_event=self.sent_event,
            root_id=route.root_id,
            parent_id=route.parent_id,
            chain=chain,
            origin=self.origin,
            ignore_result=route.ignore_result,
            argsrepr=argsrepr,
            kwargsrepr=kwargsrepr,
            **route.options,
        )
        if not route.ignore_result:
            # A result backend that wants to know (the relay's tasks ignore
            # their results unless annotated otherwise).
            self.app.backend.on_task_call(self.producer, task_id)
        if headers:
            route_options = {**route.options, "headers": headers}
        else:
            route_options = route.options
        amqp.send_task_message(self.producer, route.name, message, **route_options)
        return task_id
