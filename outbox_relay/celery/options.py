"""Celery's own task options, read the way Celery reads them.

The deliver task's retry options (``max_retries``, ``retry_backoff``,
``retry_backoff_max``, ``retry_jitter``, ``autoretry_for``) and time limits
are not used by Celery here (the relay never calls ``Task.retry``): they
are read as the relay's policy, from ``install(task_options=...)`` and then
``task_annotations`` in every form Celery accepts (a dict, a list of dicts,
objects with ``annotate(task)``, or their import paths).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from celery.app.annotations import prepare, resolve_all

from ..config import Settings
from ..errors import ConfigError
from ..services.policy import RetryPolicy

__all__ = ["annotations_for", "check_task_options", "retry_policy", "time_limits"]

# What an annotation may set for the relay's tasks; anything else is Celery's.
_READ = (
    "max_retries",
    "retry_backoff",
    "retry_backoff_max",
    "retry_jitter",
    "autoretry_for",
    "default_retry_delay",
    "time_limit",
    "soft_time_limit",
)


class _Named:
    """Stands in for a task in annotation lookups (they only read ``name``)."""

    def __init__(self, name: str) -> None:
        self.name = name


def annotations_for(app: Any, name: str) -> dict[str, Any]:
    """The ``task_annotations`` a user set for task ``name`` ("*" first, then by name)."""
    found: dict[str, Any] = {}
    prepared = prepare(app.conf.get("task_annotations"))
    task = app.tasks.get(name) or _Named(name)
    # resolve_all yields the by-name match before the "*" one; apply "*" first.
    for annotation in reversed(list(resolve_all(prepared, task))):
        if isinstance(annotation, Mapping):
            found.update(annotation)
    return {k: v for k, v in found.items() if k in _READ}


def check_task_options(options: Mapping[str, Any]) -> None:
    """Refuse an ``install(task_options=...)`` key the relay does not read: a
    misspelled ``max_retrys`` would leave the relay's own limit in force."""
    unknown = sorted(set(options) - set(_READ))
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, _READ, n=1)
        parts.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    raise ConfigError(
        f"install(task_options=...): unknown option(s) {', '.join(parts)}; the relay reads "
        f"{', '.join(_READ)}"
    )


def retry_policy(
    settings: Settings, task_options: Mapping[str, Any], annotations: Mapping[str, Any]
) -> RetryPolicy:
    """The relay's retry policy from Celery retry options (annotations win).

    ``max_retries`` -> attempts (max_retries + 1; None: no limit),
    ``retry_backoff`` -> Celery's schedule: the first retry waits (up to)
    that many seconds, then twice as long each time (False: a constant
    ``default_retry_delay``), ``retry_backoff_max`` -> cap, ``retry_jitter``
    -> full jitter on or off, ``autoretry_for`` -> classes treated as transient.
    """
    options = {**task_options, **annotations}
    max_attempts = settings.max_attempts
    if "max_retries" in options:
        max_retries = options["max_retries"]
        max_attempts = 2**31 - 1 if max_retries is None else int(max_retries) + 1
    cap = _seconds(options, "retry_backoff_max", settings.backoff_cap_seconds)
    jitter = bool(options.get("retry_jitter", True))
    backoff = options.get("retry_backoff", settings.backoff_base_seconds)
    if "retry_backoff" in options and not backoff:
        # Celery without backoff (False, None, or 0: Celery tests it for
        # truth) retries after a constant default_retry_delay. A 0 read as a
        # factor retried at once, every attempt spent in milliseconds.
        base = _seconds(options, "default_retry_delay", 180)
        cap = base
        jitter = bool(options.get("retry_jitter", False))
    elif "retry_backoff" in options:
        # Celery waits factor * 2**retries, retries counted from 0 at the
        # first retry; the relay's backoff is base * 2**attempts, attempts
        # counted from 1 after the first failure: the same schedule at half
        # the factor (retry_backoff=2: 2 s, 4 s, 8 s, as Celery would).
        base = (1.0 if backoff is True else _seconds(options, "retry_backoff", 1.0)) / 2.0
    else:
        base = float(backoff)  # the relay's own backoff_base_seconds
    return RetryPolicy(
        max_attempts=max_attempts,
        backoff_base=base,
        backoff_cap=cap,
        jitter=jitter,
        max_defer=timedelta(seconds=settings.max_defer_seconds),
        retry_on=tuple(options.get("autoretry_for", ()) or ()),
    )


def _seconds(options: Mapping[str, Any], name: str, default: float) -> float:
    """A retry option in seconds, refused when it is not a number >= 0: a
    negative one was accepted at start and crashed every delivery that
    failed (ValueError in the backoff), its row waiting out a lease each time."""
    value = options.get(name, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0:
        raise ConfigError(f"task option {name} must be a number of seconds >= 0, got {value!r}")
    return seconds


def time_limits(settings: Settings) -> tuple[float, float]:
    """(soft, hard) limits for delivery tasks: after the worst publish, before the lease ends."""
    worst = settings.worst_delivery_seconds
    spare = settings.lease_seconds - worst
    return worst + 0.25 * spare, worst + 0.5 * spare
