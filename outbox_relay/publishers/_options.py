"""How a publisher reads its options from the relay's option bag.

The relay passes its option bag straight from settings, where a value can be
a Python object (Celery configuration) or text (``OUTBOX_*`` environment
variables). Text is coerced by the same helpers as every setting
(``outbox_relay/_parse.py``); what is particular to publishers is here:
renaming options to constructor keywords, loading ``module:callable``
values, and carving timeouts out of the publish budget.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .protocol import load_callable

__all__ = ["as_callable_or", "constructor_kwargs", "split_budget"]


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
    _refuse_unknown(options, names)
    kwargs: dict[str, Any] = dict(defaults or {})
    for option, kwarg in names.items():
        if options.get(option) is not None:
            kwargs[kwarg] = options[option]
    kwargs.update(overrides or {})
    return kwargs


def _refuse_unknown(options: Mapping[str, Any], names: Mapping[str, str]) -> None:
    """An option of this publisher's kind that it does not know is a mistake:
    a misspelled ``OUTBOX_WEBHOOK_SECERT`` would otherwise send webhooks unsigned."""
    prefixes = tuple({name.split("_", 1)[0] + "_" for name in names})
    unknown = sorted(o for o in options if o.startswith(prefixes) and o not in names)
    if not unknown:
        return
    parts = []
    for option in unknown:
        close = difflib.get_close_matches(option, sorted(names), n=1)
        hint = f" (did you mean OUTBOX_{close[0].upper()}?)" if close else ""
        parts.append(f"OUTBOX_{option.upper()}{hint}")
    known = ", ".join(f"OUTBOX_{n.upper()}" for n in sorted(names))
    raise ConfigError(f"unknown publisher option(s): {', '.join(parts)}; known: {known}")
