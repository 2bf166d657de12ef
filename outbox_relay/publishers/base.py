"""The publisher protocol and the resolution of ``OUTBOX_PUBLISHER``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigError
from ..message import Message

__all__ = ["Publisher", "load_callable", "resolve_publisher"]

Publisher = Callable[[Message], Any]


def load_callable(spec: str, *, setting: str = "OUTBOX_PUBLISHER") -> Publisher:
    """Import ``package.module:attribute`` and check that it is callable."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"{setting}={spec!r} must look like 'package.module:callable'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{setting}={spec!r}: cannot import {module_name!r}: {exc}") from exc
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(
                f"{setting}={spec!r}: module {module_name!r} has no attribute {attribute!r}"
            ) from None
    if not callable(target):
        raise ConfigError(f"{setting}={spec!r} is not callable")
    return target  # type: ignore[no-any-return]


def resolve_publisher(spec: Any, *, setting: str = "OUTBOX_PUBLISHER", **options: Any) -> Publisher:
    """Turn a publisher setting into a callable.

    ``spec`` may be a callable, ``"module:callable"``, or a mapping from
    event-type patterns to publisher specs (routing, see ``Router``).
    ``options`` are passed to URL-based publishers (timeouts and the like).
    """
    if spec is None or spec == "":
        raise ConfigError(
            f"{setting} is not set: name a publisher as 'package.module:callable', "
            "a webhook URL, or a broker URL"
        )
    if isinstance(spec, Mapping):
        from .routing import Router

        return Router.from_config(spec, setting=setting, **options)
    if callable(spec):
        return spec  # type: ignore[no-any-return]
    if not isinstance(spec, str):
        raise ConfigError(f"{setting} must be a string, a callable or a mapping, not {spec!r}")
    if ":" in spec and "://" not in spec:
        return load_callable(spec, setting=setting)
    raise ConfigError(f"{setting}={spec!r} is not a publisher this relay knows")
