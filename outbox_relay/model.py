"""The shapes a row takes outside the database.

``Claimed`` is what ``claim`` returns: a row plus the lease that makes it
ours (``lease_version`` is the fencing token every finalize must present).
``Message`` is what a publisher sees: the same content plus the stable
idempotency key the receiver uses to drop duplicates. ``Outcome`` is how one
delivery ended, as the fenced finalize writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

__all__ = ["Claimed", "LeaseRef", "Message", "Outcome", "Status", "idempotency_key"]

Status = Literal["done", "pending", "dead"]


def idempotency_key(message_id: int, operation_key: str | None, prefix: str = "outbox-") -> str:
    """The receiver-facing de-duplication key: stable across retries and leases."""
    return operation_key if operation_key else f"{prefix}{message_id}"


@dataclass(frozen=True)
class LeaseRef:
    """What a Celery fan-out message carries: a row id and the lease it was claimed under."""

    id: int
    lease_version: int


@dataclass(frozen=True)
class Claimed:
    """A row this worker leased. ``False`` from a finalize means the lease was lost.

    From a claim without content (the Celery relay's, ``store.claim_batch(...,
    content=False)``) ``payload``, ``created_at`` and ``lease_until`` are None
    and ``headers`` empty, except for a durable Celery task's row;
    ``store.begin`` returns the full row (with ``chain_only``, a durable
    task's run, a payload of its chain alone: ``{"chain": ...}``).
    """

    id: int
    lease_version: int
    attempts: int
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: Any
    headers: dict[str, Any] = field(default_factory=dict)
    operation_key: str | None = None
    created_at: datetime | None = None
    lease_until: datetime | None = None
    # Written by the producer: claimed in id order within its aggregate.
    ordered: bool = False
    # From a claim: the row's previous delivery began and never ended (its
    # lease ran out under it: the process died or hung, perhaps because of
    # this very message). A delivery that ended with an outcome, a retry
    # included, leaves it False.
    interrupted: bool = False
    # From a claim: the payload's size as stored (compressed where PostgreSQL
    # compressed it), for the fan-out's byte budget per chunk.
    stored_bytes: int = 0

    @property
    def ref(self) -> LeaseRef:
        return LeaseRef(self.id, self.lease_version)

    def to_message(self, prefix: str = "outbox-") -> Message:
        return Message(
            id=self.id,
            idempotency_key=idempotency_key(self.id, self.operation_key, prefix),
            aggregate_type=self.aggregate_type,
            aggregate_id=self.aggregate_id,
            event_type=self.event_type,
            payload=self.payload,
            headers=dict(self.headers or {}),
            attempts=self.attempts,
            lease_version=self.lease_version,
            created_at=self.created_at,
        )


@dataclass(frozen=True)
class Message:
    """One outbox message as a publisher receives it."""

    id: int
    idempotency_key: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: Any
    headers: dict[str, Any]
    attempts: int
    lease_version: int
    created_at: datetime | None


@dataclass(frozen=True)
class Outcome:
    """How one delivery ended, as the fenced finalize will write it."""

    id: int
    lease_version: int
    status: Status
    delay: timedelta = timedelta(0)
    refund_attempt: bool = False
    error: str | None = None
    # Written only if no delivery began the row under this lease version
    # (a release by someone other than that delivery).
    unless_begun: bool = False

    @property
    def plainly_done(self) -> bool:
        """Published and nothing else to write (``store.finalize``'s short form)."""
        return self.status == "done" and not (
            self.refund_attempt or self.error or self.unless_begun
        )

    @classmethod
    def done(cls, ref: LeaseRef | Claimed) -> Outcome:
        return cls(ref.id, ref.lease_version, "done")

    @classmethod
    def retry(
        cls,
        ref: LeaseRef | Claimed,
        *,
        delay: timedelta,
        error: str | None,
        refund_attempt: bool = False,
    ) -> Outcome:
        return cls(ref.id, ref.lease_version, "pending", delay, refund_attempt, error)

    @classmethod
    def release(
        cls,
        ref: LeaseRef | Claimed,
        *,
        reason: str,
        refund_attempt: bool = False,
        unless_begun: bool = False,
    ) -> Outcome:
        """Give a row back unpublished, due at once (``refund_attempt``: an
        attempt was counted for it and never used). ``unless_begun``: the
        caller is not the delivery that began the row (the fan-out, a
        duplicated task), so a row some delivery began under this lease is
        left to that delivery."""
        return cls(
            ref.id,
            ref.lease_version,
            "pending",
            timedelta(0),
            refund_attempt,
            f"released unpublished: {reason}",
            unless_begun,
        )

    @classmethod
    def dead(cls, ref: LeaseRef | Claimed, *, error: str) -> Outcome:
        return cls(ref.id, ref.lease_version, "dead", error=error)
