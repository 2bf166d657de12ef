"""Coercion of setting values that may arrive as text or as Python objects.

A value comes from ``install(app, ...)`` keywords or the Celery configuration
(a Python object) or from an ``OUTBOX_*`` environment variable (text). Every
helper accepts both and names the setting when the value is wrong, so the
settings and every publisher parse alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .errors import ConfigError

__all__ = ["as_bool", "as_mapping", "as_names", "as_number", "bool_or_same"]

N = TypeVar("N", int, float)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def bool_or_same(value: Any) -> Any:
    """``"true"``/``"false"`` (and friends) as booleans; anything else unchanged."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    return value


def as_bool(name: str, value: Any) -> bool:
    """A boolean, or ConfigError naming ``name``."""
    result = bool_or_same(value)
    if isinstance(result, bool):
        return result
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def as_number(kind: Callable[[Any], N], name: str, value: Any) -> N:
    """An int or float (``kind``), or ConfigError naming ``name``."""
    wanted = "a whole number" if kind is int else "a number"
    # bool is an int to Python, never to a person; and int() would cut 2.5
    # to 2 without a word.
    if isinstance(value, bool) or (
        kind is int and isinstance(value, float) and not value.is_integer()
    ):
        raise ConfigError(f"{name} must be {wanted}, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name} must be {wanted}, got {value!r}") from None


def as_names(name: str, value: Any) -> tuple[str, ...]:
    """A comma-separated list (or a sequence) as a sorted tuple without blanks."""
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = [str(part).strip() for part in value]
    else:
        raise ConfigError(f"{name} must be a comma-separated list, got {value!r}")
    return tuple(sorted({item for item in items if item}))


def as_mapping(name: str, value: Any) -> dict[str, Any]:
    """A mapping, or a JSON object given as text."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise ConfigError(f"{name} must be a JSON object") from None
    if not isinstance(value, Mapping):
        # No value in the message: a mapping may hold a secret (headers, transport options).
        raise ConfigError(
            f"{name} must be a mapping (or a JSON object), got {type(value).__name__}"
        )
    return dict(value)
