"""Route messages to publishers by event type.

Patterns are shell-style (``order.*``); the most specific match wins (exact
names before patterns, longer patterns before shorter), and ``"*"`` or a
``default`` catches the rest. An event type with no route is a
``PermanentError`` at publish time, and ``Router.check`` lets start-up code
fail early for the event types it knows. ``timeout_seconds`` is the slowest
route's, so the relay's lease check covers every route.

A routing table in configuration (``{pattern: spec}``) becomes a Router in
``resolve.router_from_config``, which resolves each route's spec.
"""

from __future__ import annotations

import asyncio
import fnmatch
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

from ..errors import ConfigError, PermanentError
from ..model import Message
from .protocol import Publisher, is_async_publisher, publisher_timeout

__all__ = ["Router"]


class Router:
    """A publisher that hands each message to the publisher of its event type."""

    def __init__(self, routes: Mapping[str, Publisher], default: Publisher | None = None) -> None:
        if not routes and default is None:
            raise ConfigError("a publisher routing table needs at least one route")
        self._exact = {k: v for k, v in routes.items() if not _is_pattern(k)}
        # Longest pattern first: "order.paid.*" beats "order.*" beats "*".
        self._patterns = sorted(
            ((k, v) for k, v in routes.items() if _is_pattern(k)),
            key=lambda kv: (-len(kv[0].replace("*", "")), kv[0]),
        )
        self._default = default
        self._lookup = lru_cache(maxsize=1024)(self._find)
        # The relay awaits a coroutine publisher on an event loop and calls a
        # plain one in a thread. A table with a coroutine route is awaited; its
        # plain routes (the Celery relay's canvas route, say) then run in a
        # thread of their own (asyncio.to_thread), never on the loop.
        plain = [p for p in self.publishers if not is_async_publisher(p)]
        self.is_async = len(plain) < len(self.publishers)
        self._threaded = {id(p) for p in plain} if self.is_async else set()

    @property
    def publishers(self) -> list[Publisher]:
        """Every distinct publisher this router can hand a message to."""
        found: list[Publisher] = []
        candidates = [*self._exact.values(), *(p for _, p in self._patterns)]
        if self._default is not None:
            candidates.append(self._default)
        for publisher in candidates:
            if not any(publisher is seen for seen in found):
                found.append(publisher)
        return found

    @property
    def timeout_seconds(self) -> float | None:
        """The slowest route's worst case, for the relay's lease check (None: unknown)."""
        timeouts = [t for t in map(publisher_timeout, self.publishers) if t is not None]
        return max(timeouts) if timeouts else None

    def close(self) -> None:
        for publisher in self.publishers:
            close = getattr(publisher, "close", None)
            if callable(close):
                close()

    def _find(self, event_type: str) -> Publisher | None:
        if event_type in self._exact:
            return self._exact[event_type]
        for pattern, publisher in self._patterns:
            if fnmatch.fnmatchcase(event_type, pattern):
                return publisher
        return self._default

    def route(self, event_type: str) -> Publisher | None:
        return self._lookup(event_type)

    def check(self, event_types: Iterable[str]) -> None:
        """Raise ConfigError naming every event type that has no route."""
        missing = sorted({e for e in event_types if self.route(e) is None})
        if missing:
            raise ConfigError(f"no publisher route for event type(s): {', '.join(missing)}")

    def __call__(self, message: Message) -> Any:
        publisher = self.route(message.event_type)
        if publisher is None:
            raise PermanentError(f"no publisher route for event type {message.event_type!r}")
        if id(publisher) in self._threaded:
            return asyncio.to_thread(publisher, message)
        return publisher(message)


def _is_pattern(key: str) -> bool:
    return any(ch in key for ch in "*?[")
