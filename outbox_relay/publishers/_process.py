"""Per-process resources for publishers (HTTP clients, broker connections).

A relay worker forks (Celery's prefork pool): a socket opened in the parent
and used by two children interleaves their bytes on one connection, and a
TLS session shared that way is corrupted. So a publisher keeps its client
together with the PID that made it and builds a fresh one the first time it
is used in another process. The parent's copy is dropped, not closed:
closing it in the child could send a TLS close_notify or an AMQP close on a
socket the parent still uses.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PerProcess"]

T = TypeVar("T")


class PerProcess(Generic[T]):
    """A lazily built value, rebuilt in every new process (after ``fork``)."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._value: T | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        pid = os.getpid()
        if self._pid != pid:
            # First use here, or first use after a fork. A lock held by another
            # thread at fork time would stay locked forever in the child, so
            # the lock is replaced along with the value.
            self._lock = threading.Lock()
            self._value = None
            self._pid = pid
        value = self._value
        if value is None:
            with self._lock:
                if self._value is None:
                    self._value = self._factory()
                value = self._value
        return value

    def peek(self) -> T | None:
        """The value of this process, if it was built (None after a fork)."""
        return self._value if self._pid == os.getpid() else None

    def reset(self) -> T | None:
        """Forget this process's value (the caller closes it) and return it."""
        with self._lock:
            value = self.peek()
            self._value = None
            return value
