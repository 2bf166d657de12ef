"""How a publish result becomes database state: the retry policy and ``classify``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..backoff import full_jitter_backoff
from ..errors import Defer, PermanentError, RetryableError
from ..model import Claimed, Outcome

__all__ = ["RetryPolicy", "classify", "classify_task", "describe"]


@dataclass(frozen=True)
class RetryPolicy:
    """How failures become database state.

    ``retry_on`` lists extra exception classes treated as transient (the
    Celery layer fills it from a deliver task's ``autoretry_for``). Any other
    unexpected exception is also retried, but logged with its traceback.
    ``max_defer`` bounds a ``Defer`` (counted from the message's creation)
    and a receiver's ``Retry-After`` alike, so no row is pushed out for years.
    """

    max_attempts: int = 12
    backoff_base: float = 1.0
    backoff_cap: float = 300.0
    jitter: bool = True
    max_defer: timedelta = timedelta(days=1)
    retry_on: tuple[type[BaseException], ...] = ()

    def backoff(self, attempt: int) -> timedelta:
        if self.jitter:
            return full_jitter_backoff(attempt, base=self.backoff_base, cap=self.backoff_cap)
        return timedelta(seconds=min(self.backoff_cap, self.backoff_base * 2.0 ** min(attempt, 64)))

    def is_classified(self, exc: BaseException) -> bool:
        return isinstance(exc, (RetryableError, PermanentError, Defer, *self.retry_on))


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def classify(
    exc: BaseException | None,
    msg: Claimed,
    policy: RetryPolicy,
    *,
    age_seconds: float = 0.0,
) -> Outcome:
    """Map a publish result onto the fenced write that records it."""
    if exc is None:
        return Outcome.done(msg)
    if isinstance(exc, Defer):
        if age_seconds + exc.delay.total_seconds() > policy.max_defer.total_seconds():
            return Outcome.dead(
                msg,
                error=f"deferred past the maximum defer age ({policy.max_defer}): {exc.reason}",
            )
        return Outcome.retry(
            msg, delay=exc.delay, error=f"deferred: {exc.reason}", refund_attempt=True
        )
    if isinstance(exc, PermanentError):
        return Outcome.dead(msg, error=f"permanent: {describe(exc)}")
    prefix = "retryable" if isinstance(exc, (RetryableError, *policy.retry_on)) else "unexpected"
    if msg.attempts >= policy.max_attempts:
        return Outcome.dead(
            msg,
            error=f"retries exhausted after {msg.attempts} attempts; last: {prefix}: "
            f"{describe(exc)}",
        )
    delay = policy.backoff(msg.attempts)
    retry_after = getattr(exc, "retry_after", None)
    if isinstance(retry_after, timedelta) and retry_after > delay:
        # The receiver's word, but never past the longest we defer anything.
        delay = min(retry_after, policy.max_defer)
    return Outcome.retry(msg, delay=delay, error=f"{prefix}: {describe(exc)}")


def classify_task(
    exc: BaseException | None,
    msg: Claimed,
    policy: RetryPolicy,
    *,
    age_seconds: float = 0.0,
) -> Outcome:
    """``classify`` for a durable task's body, by Celery's own rule: only the
    exceptions in ``autoretry_for`` (``retry_on``) and outbox-relay's failure
    classes are retried; any other exception ends the row ``dead`` at once."""
    if exc is None or policy.is_classified(exc):
        return classify(exc, msg, policy, age_seconds=age_seconds)
    return Outcome.dead(
        msg, error=f"failed with an exception not in autoretry_for: {describe(exc)}"
    )
