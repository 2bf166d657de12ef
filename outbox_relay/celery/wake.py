"""A claim for the moment a waiting row falls due, not at beat's next tick.

A retry's backoff (``available_at`` a fraction of a second ahead) and a
message enqueued with a delay are claimed by the first claim after they fall
due. When the relay is idle that was beat's next tick (5 s by default): the
backoff the docs promised was the tick. Now whoever learns of such a row (a
delivery that rescheduled one, a durable run that failed, a claim that found
the table holding rows not yet due) sends a claim with a countdown to its due
time, when that comes before the next tick.

It is a wake-up, not a retry: the retry lives in the row's ``available_at``,
the claim carries no message, and a lost or duplicated one costs nothing (the
tick is still the safety net; a second claim finds nothing to take). It is
never longer than the claim interval, so no broker holds it for long (see
DESIGN.md, Celery rule 2: retries never wait in the broker).
"""

from __future__ import annotations

import threading
import time

__all__ = ["WAKE_MARGIN_SECONDS", "WAKE_SLACK_SECONDS", "WakeSchedule"]

# Sent this much after the due time: the row is due by the database's clock
# when the claim runs (the countdown is measured by this host's).
WAKE_MARGIN_SECONDS = 0.02
# A claim already sent for at most this long after a new due time serves it:
# the claim that runs then takes every row due by then, and looks up the
# next due time itself. It bounds the wake-ups a process sends, however many
# rows fail at once: about ten a second per process with 300 rows failing
# twice (a walkthrough; half of them found nothing, each one short claim).
WAKE_SLACK_SECONDS = 0.25


class WakeSchedule:
    """The claims one process has sent for later, by when they run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # time.monotonic() of the earliest claim sent for later that has not
        # run yet (0.0: none).
        self._next = 0.0

    def take(self, delay: float, *, within: float) -> float | None:
        """The countdown to send a claim with, for a row due in ``delay``
        seconds; None when the tick (every ``within`` seconds) comes first,
        or a claim this process sent already runs in time for it."""
        if delay >= within:
            return None
        now = time.monotonic()
        due = now + max(delay, 0.0) + WAKE_MARGIN_SECONDS
        with self._lock:
            if now < self._next <= due + WAKE_SLACK_SECONDS:
                return None
            self._next = due if self._next <= now else min(self._next, due)
        return due - now

    def reset(self) -> None:
        """Forget what the parent process sent (after fork)."""
        with self._lock:
            self._next = 0.0
