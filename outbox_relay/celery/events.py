"""Observers the Celery relay attaches: task events for Flower, and a fan-out."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..model import Claimed, LeaseRef, Outcome
from ..services.observer import Observer, bind

__all__ = ["Observers", "TaskEvents"]

log = logging.getLogger("outbox_relay.celery")


class TaskEvents:
    """Emits Celery task events (shown in Flower) for dead letters, stale and lost leases.

    Custom event types ``task-outbox-dead``, ``task-outbox-lost-lease`` and
    ``task-outbox-stale``, sent on behalf of the delivery task running in
    this thread. They carry ids, versions and reasons, never payloads.
    """

    def __init__(self, table: str = "") -> None:
        # The outbox the messages are in, for the log: two services on one
        # log stream (or one worker's two apps) tell their dead letters apart.
        self.table = table

    def _task(self) -> _Task | None:
        """The delivery task the events are sent for: the one running in this thread."""
        from celery import current_task

        # The proxy looks the task up on every use: once here. None outside
        # a task (a deliverer run directly).
        task = current_task._get_current_object()
        if task is None:
            return None
        request = task.request
        task_id = getattr(request, "id", None)
        if not task_id:
            return None
        return _Task(task.app, str(task_id), getattr(request, "hostname", None))

    def _send(self, kind: str, **fields: Any) -> None:
        task = self._task()
        if task is None:
            return
        try:
            # What Task.send_event does, for a task that may have returned.
            with task.app.events.default_dispatcher(hostname=task.hostname) as dispatcher:
                dispatcher.send(
                    kind,
                    uuid=task.id,
                    retry=True,
                    retry_policy=task.app.conf.task_publish_retry_policy,
                    **fields,
                )
        except Exception:  # events are best effort; never fail a delivery for one
            log.debug("could not send task event %s", kind, exc_info=True)

    def bound(self) -> TaskEvents:
        """These events for the task running here now, sent later from any
        thread: the completer finds a lost lease after the task returned."""
        task = self._task()
        return self if task is None else _TaskEventsFor(task, self.table)

    def published(self, msg: Claimed, outcome: Outcome, seconds: float) -> None:
        pass

    def finalized(self, msg: Claimed, outcome: Outcome, age_seconds: float) -> None:
        if outcome.status != "dead":
            return
        # A dead letter needs a person. The delivery task itself returns
        # normally (its retry lives in the database), so Flower would show
        # SUCCESS: say it above INFO, and as an event monitors can count.
        reason = _short(outcome.error)
        log.error(
            "outbox message %s v%s (%s) is dead after %s attempt(s)%s: %s",
            msg.id,
            msg.lease_version,
            msg.event_type,
            msg.attempts,
            f" in {self.table}" if self.table else "",
            reason,
        )
        self._send(
            "task-outbox-dead",
            outbox_id=msg.id,
            lease_version=msg.lease_version,
            event_type=msg.event_type,
            attempts=msg.attempts,
            reason=reason,
        )

    def lost_lease(self, ref: LeaseRef, where: str) -> None:
        self._send("task-outbox-lost-lease", outbox_id=ref.id, lease_version=ref.lease_version)

    def stale(self, ref: LeaseRef, reason: str) -> None:
        self._send(
            "task-outbox-stale", outbox_id=ref.id, lease_version=ref.lease_version, reason=reason
        )


@dataclass(frozen=True)
class _Task:
    app: Any
    id: str
    hostname: str | None


class _TaskEventsFor(TaskEvents):
    """``TaskEvents`` on behalf of one task, whichever thread sends them."""

    def __init__(self, task: _Task, table: str = "") -> None:
        super().__init__(table)
        self.task = task

    def _task(self) -> _Task | None:
        return self.task


def _short(text: str | None, limit: int = 500) -> str:
    """A reason short enough for an event (``last_error`` keeps the whole text)."""
    text = text or "unknown"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Observers:
    """Calls several observers; one failing observer never breaks delivery."""

    def __init__(self, observers: list[Observer]) -> None:
        self.observers = observers

    def _each(self, name: str, *args: Any) -> None:
        for observer in self.observers:
            try:
                getattr(observer, name)(*args)
            except Exception:
                log.debug("observer %r failed in %s", observer, name, exc_info=True)

    def published(self, msg: Claimed, outcome: Outcome, seconds: float) -> None:
        self._each("published", msg, outcome, seconds)

    def finalized(self, msg: Claimed, outcome: Outcome, age_seconds: float) -> None:
        self._each("finalized", msg, outcome, age_seconds)

    def lost_lease(self, ref: LeaseRef, where: str) -> None:
        self._each("lost_lease", ref, where)

    def stale(self, ref: LeaseRef, reason: str) -> None:
        self._each("stale", ref, reason)

    def bound(self) -> Observers:
        """The same observers, those that speak for the running task
        (``TaskEvents``) bound to it: for reports made after it returned."""
        return Observers([bind(o) for o in self.observers])
