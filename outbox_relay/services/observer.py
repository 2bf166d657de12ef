"""What a delivery reports as it goes: the hooks metrics and task events implement."""

from __future__ import annotations

import logging
from typing import Protocol, cast

from ..model import Claimed, LeaseRef, Outcome

__all__ = ["Observer", "bind", "lost_after_publish"]

log = logging.getLogger("outbox_relay.deliverer")


class Observer(Protocol):
    """Hooks for metrics and task events; every method must be cheap."""

    def published(self, msg: Claimed, outcome: Outcome, seconds: float) -> None: ...
    def finalized(self, msg: Claimed, outcome: Outcome, age_seconds: float) -> None: ...
    def lost_lease(self, ref: LeaseRef, where: str) -> None: ...
    def stale(self, ref: LeaseRef, reason: str) -> None: ...


def bind(observer: Observer) -> Observer:
    """``observer`` for reports made later, from another thread, about work
    done in this one: its ``bound()`` where it has one (Celery's task events
    name the task running here), else itself."""
    bound = getattr(observer, "bound", None)
    return cast(Observer, bound()) if callable(bound) else observer


def lost_after_publish(observer: Observer, msg: Claimed, outcome: Outcome) -> None:
    """Report a published row whose fenced finalize matched nothing (the
    same words from the task and the completer). Which of the causes it was
    the write cannot tell: it matched no row."""
    observer.lost_lease(msg.ref, "finalize")
    log.warning(
        "lost lease on outbox message %s v%s: it was published (%s) but the row is no "
        "longer held under this lease (it expired and was freed or re-claimed, or a "
        "duplicate of this task finished it); the receiver de-duplicates on its "
        "idempotency key",
        msg.id,
        msg.lease_version,
        outcome.status,
    )
