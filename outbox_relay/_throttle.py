"""One log line a while for a failure that repeats (an outage), with a count.

A broker or database outage made the relay log a line, often a traceback,
per committed row or per tick. ``Throttle`` counts the occurrences and says
when a line is due, with how many it stands for and whether it is the first
of the outage (which may carry the traceback); ``clear`` ends the outage.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

__all__ = ["Due", "Throttle"]


@dataclass(frozen=True)
class Due:
    """A line to log: it stands for ``count`` occurrences; ``first`` of the outage."""

    count: int
    first: bool


class Throttle:
    """At most one line every ``seconds``; thread-safe."""

    def __init__(self, seconds: float = 60.0) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._count = 0
        self._logged_at: float | None = None

    def hit(self) -> Due | None:
        """One more occurrence: the line to log now, or None."""
        now = time.monotonic()
        with self._lock:
            self._count += 1
            if self._logged_at is not None and now - self._logged_at < self.seconds:
                return None
            due = Due(self._count, first=self._logged_at is None)
            self._count, self._logged_at = 0, now
            return due

    def clear(self) -> bool:
        """The failure is over; whether a line was logged since the last clear."""
        with self._lock:
            logged = self._logged_at is not None
            self._count, self._logged_at = 0, None
            return logged
