"""Errors raised by outbox-relay, and the failure classes publishers raise.

Publishers translate whatever their SDK throws into one of three classes:

* ``RetryableError``: transient (timeout, 5xx, 429). The row goes back to
  ``pending`` with full-jitter backoff, or to ``dead`` once attempts run out.
* ``PermanentError``: retrying will not help (a 4xx validation error). ``dead`` now.
* ``Defer``: not a failure; the message cannot go out *yet* for a business
  reason. The attempt is refunded, bounded by a maximum defer age.
"""

from __future__ import annotations

from datetime import timedelta

__all__ = [
    "ConfigError",
    "Defer",
    "InvalidIdentifier",
    "InvalidMessage",
    "OperationKeyConflict",
    "OutboxError",
    "PermanentError",
    "PublishError",
    "RetryableError",
]


class OutboxError(Exception):
    """Base class of every error outbox-relay raises on purpose."""


class ConfigError(OutboxError, ValueError):
    """A setting is missing or wrong; the message names the setting."""


class InvalidIdentifier(ConfigError):
    """A schema or table name that is not a plain SQL identifier."""


class InvalidMessage(OutboxError, ValueError):
    """``enqueue`` was given something that cannot be stored (not JSON, too big...)."""


class OperationKeyConflict(OutboxError):
    """The operation key already names a different message."""

    def __init__(self, operation_key: str, existing_id: int, *, same_batch: bool = False) -> None:
        # same_batch: two messages of one enqueue_many; the id named would be
        # rolled back with the rest (nothing is written), so none is named.
        where = (
            "is given twice in this enqueue_many"
            if same_batch
            else f"is already used by outbox message {existing_id}"
        )
        super().__init__(
            f"operation_key {operation_key!r} {where} with different content; an operation "
            "key must name one business action"
        )
        self.operation_key = operation_key
        self.existing_id = existing_id


class PublishError(OutboxError):
    """Base class of the failure classes a publisher raises."""


class RetryableError(PublishError):
    """A transient failure: back off (full jitter) and try again.

    ``retry_after`` (seconds or a timedelta), when the receiver said how long to
    wait (HTTP ``Retry-After``), is the *minimum* delay before the next attempt.
    """

    def __init__(self, *args: object, retry_after: float | timedelta | None = None) -> None:
        super().__init__(*args)
        if isinstance(retry_after, (int, float)):
            retry_after = timedelta(seconds=float(retry_after))
        self.retry_after: timedelta | None = retry_after


class PermanentError(PublishError):
    """A failure that retrying will not fix: the message goes ``dead`` at once."""


class Defer(PublishError):
    """Postpone delivery for a business reason without spending an attempt."""

    def __init__(self, delay: float | timedelta, reason: str = "deferred") -> None:
        super().__init__(reason)
        if isinstance(delay, (int, float)):
            delay = timedelta(seconds=float(delay))
        if delay < timedelta(0):
            raise ValueError("Defer delay must not be negative")
        self.delay: timedelta = delay
        self.reason = reason
