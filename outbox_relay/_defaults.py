"""The process-wide default outbox configuration, for the module-level API.

``outbox_relay.enqueue`` (and the integrations) use the producer settings of
the default outbox: the one ``outbox_relay.configure(...)`` or the first
``install(app, ...)`` in this process registered, else settings read from
the environment. A holder of its own keeps ``producer`` free of an import of
``outbox`` (which imports ``producer``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .config import ProducerSettings

__all__ = ["producer_settings", "register", "registered"]

_lock = threading.Lock()
_source: Callable[[], ProducerSettings] | None = None
_explicit = False
_from_env: ProducerSettings | None = None


def register(source: Callable[[], ProducerSettings], *, explicit: bool) -> bool:
    """Make ``source`` the default; an explicit one is replaced only by another.

    Returns whether ``source`` became the default.
    """
    global _source, _explicit
    with _lock:
        # configure() always wins; of several install()s the first one does
        # (a process that installs two apps passes each its own Outbox).
        if _source is None or explicit:
            _source, _explicit = source, explicit
            return True
        return False


def registered() -> bool:
    return _source is not None


def reset() -> None:
    """Forget the registered default (tests)."""
    global _source, _explicit, _from_env
    with _lock:
        _source, _explicit, _from_env = None, False, None


def producer_settings() -> ProducerSettings:
    global _from_env
    source = _source
    if source is not None:
        return source()
    if _from_env is None:
        # Producers usually configure nothing; OUTBOX_TABLE, OUTBOX_MAX_PAYLOAD_BYTES
        # and OUTBOX_ORDERED_EVENT_TYPES still apply when set.
        _from_env = ProducerSettings.load()
    return _from_env
