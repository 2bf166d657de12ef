"""Full-jitter exponential backoff.

Every retry waits a uniformly random time between zero and an exponentially
growing cap. When a receiver comes back after an outage, the backlog then
returns spread out instead of in one synchronized wave.
"""

from __future__ import annotations

import random
from datetime import timedelta

__all__ = ["full_jitter_backoff"]


def full_jitter_backoff(
    attempt: int,
    *,
    base: float = 1.0,
    cap: float = 300.0,
    rng: random.Random | None = None,
) -> timedelta:
    """Return ``uniform(0, min(cap, base * 2**attempt))`` as a timedelta."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    if base < 0 or cap < 0:
        raise ValueError("base and cap must be >= 0")
    # Clamp the exponent first: 2**attempt for a large attempt is a huge int
    # that would overflow a float multiplication.
    ceiling = cap if attempt >= 64 else min(cap, base * (2.0**attempt))
    draw = (rng or random).uniform(0.0, ceiling)
    return timedelta(seconds=draw)
