"""What a delivery reports as it goes: the hooks metrics and task events implement."""

from __future__ import annotations

from typing import Protocol, cast

from ..model import Claimed, LeaseRef, Outcome

__all__ = ["Observer", "bind"]


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
