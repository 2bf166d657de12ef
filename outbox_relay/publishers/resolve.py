"""Turn a publisher setting (``OUTBOX_PUBLISHER``) into a publisher: the scheme dispatch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from .._redact import invalid_url
from ..errors import ConfigError
from .broker import BROKER_SCHEMES, BrokerPublisher
from .celery_task import CeleryTaskPublisher, is_celery_target
from .protocol import Publisher, load_callable
from .routing import Router
from .webhook import WebhookPublisher

__all__ = ["resolve_publisher", "router_from_config"]


def _scheme(spec: str) -> str:
    return spec.split("://", 1)[0].lower() if "://" in spec else ""


def _from_target(
    target: str, setting: str, options: Mapping[str, Any], overrides: Mapping[str, Any]
) -> Publisher:
    """A URL or ``celery:task.name``, with per-route constructor overrides."""
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
    except (ValueError, httpx.InvalidURL) as exc:
        # A URL urllib, kombu or httpx cannot read (a port that is not a
        # number, an unclosed "["): a bad setting, named, and never quoting
        # what may be the password ("Port could not be cast ... 'Zx9k'").
        raise ConfigError(f"{setting}: {invalid_url(exc, target)}") from None
    raise ConfigError(
        f"{setting}: unsupported publisher URL scheme {scheme + '://' if scheme else target!r}; "
        "use http(s)://, amqp(s)://, redis(s)://, celery:task.name or package.module:callable"
    )


def _celery_target(target: Any, setting: str, options: Mapping[str, Any]) -> Publisher:
    """A Celery ``Task`` or ``Signature`` given as the publisher: send it, never call it.

    Both are callable, and calling one runs the task's body right here, in
    the relay's worker (a Signature called with the message fails outright).
    """
    try:
        return CeleryTaskPublisher.from_options(target, options)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{setting}: {exc}") from None


def router_from_config(
    config: Mapping[str, Any],
    *,
    setting: str = "OUTBOX_PUBLISHER",
    default: Any = None,
    **options: Any,
) -> Router:
    """A ``Router`` from ``{pattern: spec}``; ``default`` (or the key ``"default"``)
    is the publisher spec for event types no pattern matches."""
    routes: dict[str, Publisher] = {}
    fallback: Publisher | None = None
    if default is not None:
        if "default" in config:
            raise ConfigError(
                f"{setting}: the default route is given twice (a 'default' key and default=)"
            )
        fallback = resolve_publisher(default, setting=f"{setting}[default]", **options)
    for pattern, spec in config.items():
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{setting}: route keys must be event-type patterns")
        publisher = resolve_publisher(spec, setting=f"{setting}[{pattern!r}]", **options)
        if pattern == "default":
            fallback = publisher
        else:
            routes[pattern] = publisher
    return Router(routes, fallback)


def resolve_publisher(spec: Any, *, setting: str = "OUTBOX_PUBLISHER", **options: Any) -> Publisher:
    """Turn a publisher setting into a callable.

    ``spec`` may be:

    * a callable, or ``"package.module:callable"``; a Celery ``Task`` or
      ``Signature`` (given, or imported that way) is sent to the broker as
      ``CeleryTaskPublisher`` does, never called;
    * an ``http(s)://`` URL (``WebhookPublisher``);
    * an ``amqp://``, ``amqps://``, ``redis://``, ``rediss://`` or
      ``redis+socket://`` URL (``BrokerPublisher``);
    * ``"celery:task.name"`` (``CeleryTaskPublisher``);
    * a mapping with ``"url"`` or ``"task"``: one of the above with
      per-publisher constructor arguments, e.g. ``{"url": "https://...",
      "secret": "whsec_..."}`` or ``{"task": "billing.charge", "queue": "billing"}``;
    * any other mapping: event-type patterns to publisher specs (``Router``).

    ``options`` is the relay's option bag (``publish_timeout_seconds``,
    ``webhook_secret``, ``kombu_exchange`` ...; see docs/publishers.md);
    each publisher reads its own names and ignores the rest.
    """
    if spec is None or spec == "":
        raise ConfigError(
            f"{setting} is not set: name a publisher as 'package.module:callable', "
            "a webhook URL, a broker URL or celery:task.name"
        )
    if is_celery_target(spec):
        # Before the mapping case: a Signature is a dict (with a "task" key).
        return _celery_target(spec, setting, options)
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
        return router_from_config(spec, setting=setting, **options)
    if callable(spec):
        return spec  # type: ignore[no-any-return]
    if not isinstance(spec, str):
        raise ConfigError(f"{setting} must be a string, a callable or a mapping, not {spec!r}")
    spec = spec.strip()
    if "://" in spec or spec.startswith("celery:"):
        return _from_target(spec, setting, options, {})
    if ":" in spec:
        loaded = load_callable(spec, setting=setting)
        if is_celery_target(loaded):
            return _celery_target(loaded, setting, options)
        return loaded
    raise ConfigError(f"{setting}={spec!r} is not a publisher this relay knows")
