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
import time
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["IdlePool", "PerProcess"]

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


# How often, at most, the sweeper looks for items idle too long.
SWEEP_SECONDS = 5.0


class _Sweeper:
    """One daemon thread per process that closes what idle pools kept too long.

    Without it, items expired only when another was given back: a relay that
    went quiet after a burst kept every connection the burst opened (up to a
    chunk's threads per pool process: 800 AMQP connections for four
    processes at chunks of 200) until the next message, however late.
    """

    def __init__(self) -> None:
        self.pools: weakref.WeakSet[IdlePool[Any]] = weakref.WeakSet()
        self.lock = threading.Lock()
        self.added = threading.Event()  # a new pool may need a shorter period
        threading.Thread(target=self._run, name="outbox-idle-sweeper", daemon=True).start()

    def add(self, pool: IdlePool[Any]) -> None:
        with self.lock:
            self.pools.add(pool)
        self.added.set()

    def _run(self) -> None:
        while True:
            self.added.clear()  # before the listing: a pool added after it wakes us
            with self.lock:
                pools = list(self.pools)
            self.added.wait(min([SWEEP_SECONDS, *(p.idle_seconds / 2 for p in pools)]))
            for pool in pools:
                pool.sweep()
            del pools  # weakly held: a pool nobody uses any more can go


# Per process: after a fork the parent's sweeper thread does not run in the
# child, and the child's must never touch the parent's pools (closing them
# would close sockets the parent still uses).
_sweeper: PerProcess[_Sweeper] = PerProcess(_Sweeper)


class IdlePool(Generic[T]):
    """Connections (or clients holding one) that publishing threads take and
    give back, for one process.

    Last in, first out: a chunk's threads take what the chunk before gave
    back, and what nobody takes any more is closed once idle for
    ``idle_seconds`` (by the next give-back, or by the process's sweeper
    thread within ``SWEEP_SECONDS`` after, when nothing is given back). There
    is no cap below the thread count: with one (16 links, or a shared
    client's 32), every chunk whose threads outnumbered it opened and closed
    the rest again (docs/benchmarks-changes.md items 28, 29). ``usable``: checked on
    taking; an item that fails it is closed, not handed out (a connection
    the server closed while it sat idle).
    """

    def __init__(
        self,
        close: Callable[[T], object],
        *,
        idle_seconds: float = 60.0,
        usable: Callable[[T], bool] | None = None,
    ) -> None:
        self._close = close
        self.idle_seconds = idle_seconds
        self._usable = usable
        self._idle: list[tuple[float, T]] = []  # oldest first
        self._lock = threading.Lock()
        _sweeper.get().add(self)

    def take(self) -> T | None:
        """The item given back last that is still usable, or None."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                _, item = self._idle.pop()
            if self._usable is None or self._usable(item):
                return item
            self._close(item)

    def give_back(self, item: T) -> None:
        now = time.monotonic()
        with self._lock:
            self._idle.append((now, item))
            expired = self._expired(now)
        for old in expired:
            self._close(old)

    def sweep(self) -> None:
        """Close what has been idle longer than ``idle_seconds``."""
        with self._lock:
            expired = self._expired(time.monotonic())
        for old in expired:
            self._close(old)

    def _expired(self, now: float) -> list[T]:
        """Remove and return the items idle too long (under ``_lock``)."""
        stale = 0
        while stale < len(self._idle) and now - self._idle[stale][0] > self.idle_seconds:
            stale += 1
        expired = [old for _, old in self._idle[:stale]]
        del self._idle[:stale]
        return expired

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, item in idle:
            self._close(item)
