"""Coercion of publisher options that may arrive as environment strings.

The relay passes its option bag straight from settings, where a value can be
a Python object (Celery configuration) or text (``OUTBOX_*`` environment
variables). These helpers accept both and name the option when text is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .base import load_callable

__all__ = ["as_bool", "as_callable_or", "as_mapping", "constructor_kwargs", "split_budget"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def as_bool(option: str, value: Any) -> Any:
    """``"true"``/``"false"`` (and friends) as booleans; anything else unchanged."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    return value


def as_mapping(option: str, value: Any) -> Any:
    """A JSON object given as text, as a dict; a mapping unchanged."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"{option} must be a JSON object") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{option} must be a mapping (or a JSON object)")
    return value


def as_callable_or(option: str, value: Any, keywords: tuple[str, ...]) -> Any:
    """One of ``keywords``, a callable, or ``"module:callable"`` loaded."""
    if isinstance(value, str) and value not in keywords and ":" in value:
        return load_callable(value, setting=option)
    return value


def split_budget(options: Mapping[str, Any], last: str) -> dict[str, float]:
    """Timeouts carved out of ``publish_timeout_seconds`` so a whole publish fits.

    Connect and write get a fifth each (at most 5 s); ``last`` (the read, or
    the broker's confirm) gets the rest.
    """
    budget = options.get("publish_timeout_seconds")
    if budget is None:
        return {}
    total = float(budget)
    connect = min(5.0, total / 5.0)
    return {"connect_timeout": connect, "write_timeout": connect, last: total - 2 * connect}


def constructor_kwargs(
    options: Mapping[str, Any],
    overrides: Mapping[str, Any] | None,
    names: Mapping[str, str],
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A publisher's keywords: ``defaults``, then the relay's options renamed by
    ``names`` (``{"webhook_secret": "secret"}``), then per-route ``overrides``."""
    kwargs: dict[str, Any] = dict(defaults or {})
    for option, kwarg in names.items():
        if options.get(option) is not None:
            kwargs[kwarg] = options[option]
    kwargs.update(overrides or {})
    return kwargs
