"""What a publisher is, and what the relay asks of one.

A publisher is any callable ``publish(message) -> None`` that raises
``RetryableError``, ``PermanentError`` or ``Defer`` on failure. The concrete
publishers (webhook, broker, celery_task, routing) import only this module;
``resolve.py`` imports them, so no cycle runs through here.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._redact import mask_spec, scrub
from ..errors import ConfigError
from ..model import Message

__all__ = [
    "Publisher",
    "import_object",
    "is_async_publisher",
    "load_callable",
    "publisher_timeout",
]

Publisher = Callable[[Message], Any]


def import_object(spec: str, *, setting: str, what: str = "name", dotted: bool = False) -> Any:
    """Import ``package.module:attribute`` (also ``package.module.attribute`` when
    ``dotted``); errors name ``setting``. One importer for every setting that
    names Python code (publishers, routing keys, argument builders, apps)."""
    # A mistyped URL (amqp//user:pw@host//) reads as a module spec: whatever
    # is shown of it, its password is not.
    shown = mask_spec(spec)
    module_name, sep, attribute = spec.partition(":")
    if not sep and dotted:
        module_name, sep, attribute = spec.rpartition(".")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"{setting}={shown!r} must look like 'package.module:{what}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{setting}={shown!r}: cannot import {module_name!r}: {scrub(str(exc), spec)}"
            f"{_path_hint(module_name)}"
        ) from exc
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(
                f"{setting}={shown!r}: module {module_name!r} has no attribute "
                f"{scrub(repr(attribute), spec)}"
            ) from None
    return target


def _path_hint(module_name: str) -> str:
    """Why a module in the current directory is not found: Celery imports the
    -A app and its config module from there, but the worker's import path
    does not hold it, and a publisher next to them was "No module named"."""
    top = module_name.split(".")[0]
    here = Path.cwd()
    if (here / f"{top}.py").exists() or (here / top / "__init__.py").exists():
        return (
            f" ({top!r} is in the current directory, which is not on the import path: "
            "run with PYTHONPATH=. or install it)"
        )
    return ""


def load_callable(spec: str, *, setting: str = "OUTBOX_PUBLISHER") -> Publisher:
    """Import ``package.module:attribute`` and check that it is callable."""
    target = import_object(spec, setting=setting, what="callable")
    if not callable(target):
        raise ConfigError(f"{setting}={mask_spec(spec)!r} is not callable")
    return target  # type: ignore[no-any-return]


def publisher_timeout(publisher: Publisher) -> float | None:
    """The worst-case duration of one publish, when the publisher declares it.

    URL-based publishers expose ``timeout_seconds`` (a ``Router``: the largest
    of its routes'); a plain callable declares nothing and returns None. The
    relay's start-up check compares this with the lease.
    """
    value = getattr(publisher, "timeout_seconds", None)
    return float(value) if isinstance(value, (int, float)) else None


def is_async_publisher(publisher: Publisher) -> bool:
    """Whether ``publisher`` is a coroutine function (``async def publish(message)``,
    or an object whose ``__call__`` is one): the relay then awaits each
    publish on an event loop of its own instead of calling it in a thread."""
    flag = getattr(publisher, "is_async", None)
    if isinstance(flag, bool):
        return flag  # a Router says for its routes
    return inspect.iscoroutinefunction(publisher) or inspect.iscoroutinefunction(
        getattr(publisher, "__call__", None)  # noqa: B004 - the method, not callable()
    )
