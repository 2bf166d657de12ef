"""The publisher protocol and the resolution of ``OUTBOX_PUBLISHER``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigError
from ..model import Message

__all__ = ["Publisher", "load_callable", "publisher_timeout", "resolve_publisher"]

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


def publisher_timeout(publisher: Publisher) -> float | None:
    """The worst-case duration of one publish, when the publisher declares it.

    URL-based publishers expose ``timeout_seconds`` (a ``Router``: the largest
    of its routes'); a plain callable declares nothing and returns None. The
    relay's start-up check compares this with the lease.
    """
    value = getattr(publisher, "timeout_seconds", None)
    return float(value) if isinstance(value, (int, float)) else None


def _scheme(spec: str) -> str:
    return spec.split("://", 1)[0].lower() if "://" in spec else ""


def _from_target(
    target: str, setting: str, options: Mapping[str, Any], overrides: Mapping[str, Any]
) -> Publisher:
    """A URL or ``celery:task.name``, with per-route constructor overrides."""
    # Imported here: each module pulls in its client library (httpx, kombu).
    from .broker import BROKER_SCHEMES, BrokerPublisher
    from .celery_task import CeleryTaskPublisher
    from .webhook import WebhookPublisher

    scheme = _scheme(target)
    try:
        if scheme in ("http", "https"):
            return WebhookPublisher.from_options(target, options, overrides)
        if scheme in BROKER_SCHEMES:
            return BrokerPublisher.from_options(target, options, overrides)
        if target.startswith("celery:"):
            return CeleryTaskPublisher.from_options(target[len("celery:") :], options, overrides)
    except ConfigError as exc:
        raise ConfigError(f"{setting}: {exc}") from None
    except TypeError as exc:  # an unknown or misspelled option in a route mapping
        raise ConfigError(f"{setting}: {exc}") from None
    raise ConfigError(
        f"{setting}: unsupported publisher URL scheme {scheme + '://' if scheme else target!r}; "
        "use http(s)://, amqp(s)://, redis(s)://, celery:task.name or package.module:callable"
    )


def resolve_publisher(spec: Any, *, setting: str = "OUTBOX_PUBLISHER", **options: Any) -> Publisher:
    """Turn a publisher setting into a callable.

    ``spec`` may be:

    * a callable, or ``"package.module:callable"``;
    * an ``http(s)://`` URL (``WebhookPublisher``);
    * an ``amqp://``, ``amqps://``, ``redis://``, ``rediss://`` or
      ``redis+socket://`` URL (``BrokerPublisher``);
    * ``"celery:task.name"`` (``CeleryTaskPublisher``);
    * a mapping with ``"url"`` or ``"task"``: one of the above with
      per-publisher constructor arguments, e.g. ``{"url": "https://...",
      "secret": "whsec_..."}`` or ``{"task": "billing.charge", "queue": "billing"}``;
    * any other mapping: event-type patterns to publisher specs (``Router``).

    ``options`` is the relay's option bag (``publish_timeout_seconds``,
    ``webhook_secret``, ``broker_exchange`` ...; see docs/publishers.md);
    each publisher reads its own names and ignores the rest.
    """
    if spec is None or spec == "":
        raise ConfigError(
            f"{setting} is not set: name a publisher as 'package.module:callable', "
            "a webhook URL, a broker URL or celery:task.name"
        )
    if isinstance(spec, Mapping):
        if "url" in spec or "task" in spec:
            overrides = {str(k): v for k, v in spec.items() if k not in ("url", "task")}
            if "url" in spec and "task" in spec:
                raise ConfigError(f"{setting}: give a publisher a 'url' or a 'task', not both")
            target = spec.get("url")
            if target is None:
                target = f"celery:{spec['task']}"
            if not isinstance(target, str):
                raise ConfigError(f"{setting}: 'url' and 'task' must be strings")
            return _from_target(target, setting, options, overrides)
        from .routing import Router

        return Router.from_config(spec, setting=setting, **options)
    if callable(spec):
        return spec  # type: ignore[no-any-return]
    if not isinstance(spec, str):
        raise ConfigError(f"{setting} must be a string, a callable or a mapping, not {spec!r}")
    spec = spec.strip()
    if "://" in spec or spec.startswith("celery:"):
        return _from_target(spec, setting, options, {})
    if ":" in spec:
        return load_callable(spec, setting=setting)
    raise ConfigError(f"{setting}={spec!r} is not a publisher this relay knows")
