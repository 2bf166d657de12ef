"""outbox-relay: deliver transactional-outbox rows from PostgreSQL through Celery.

The public API. Producers call ``enqueue`` (or ``Outbox.enqueue``), or
``apply_async`` for a Celery task or canvas, inside their business
transaction; relays claim rows under a lease with a fencing
token (``lease_version``), publish outside any transaction, and finalize
only while the fence holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .backoff import full_jitter_backoff
from .config import ProducerSettings, Settings
from .db import Database, DirectDatabase
from .errors import (
    ConfigError,
    Defer,
    InvalidIdentifier,
    InvalidMessage,
    OperationKeyConflict,
    OutboxError,
    PermanentError,
    PublishError,
    RetryableError,
)
from .model import Claimed, LeaseRef, Message, Outcome, idempotency_key
from .outbox import Outbox, configure, default_outbox, migrate
from .producer import NewMessage, enqueue, enqueue_many
from .services import (
    Claimer,
    Deliverer,
    DeliveryReport,
    LeaseKeeper,
    Purger,
    RelayLoop,
    Rescuer,
    RetryPolicy,
    classify,
    dispatch_once,
)
from .store import (
    claim,
    extend_lease,
    extend_leases,
    finalize,
    mark_dead,
    mark_done,
    reap,
    reschedule,
    rescue,
    stats,
)
from .table import OutboxTable

__version__ = "0.1.0"

__all__ = [
    "Claimed",
    "Claimer",
    "ConfigError",
    "Database",
    "Defer",
    "Deliverer",
    "DeliveryReport",
    "DirectDatabase",
    "InvalidIdentifier",
    "InvalidMessage",
    "LeaseKeeper",
    "LeaseRef",
    "Message",
    "NewMessage",
    "OperationKeyConflict",
    "Outbox",
    "OutboxError",
    "OutboxTable",
    "Outcome",
    "PermanentError",
    "ProducerSettings",
    "PublishError",
    "Purger",
    "RelayLoop",
    "Rescuer",
    "RetryPolicy",
    "RetryableError",
    "Settings",
    "__version__",
    "aio",
    "apply_async",
    "claim",
    "classify",
    "configure",
    "default_outbox",
    "dispatch_once",
    "enqueue",
    "enqueue_many",
    "extend_lease",
    "extend_leases",
    "finalize",
    "full_jitter_backoff",
    "idempotency_key",
    "install",
    "mark_dead",
    "mark_done",
    "migrate",
    "reap",
    "reschedule",
    "rescue",
    "stats",
]


def apply_async(conn: Any, sig: Any, **options: Any) -> Any:
    """``sig.apply_async(**options)`` through the outbox: one row in ``conn``'s
    transaction, sent by the relay after the commit.

    The row goes to the table that the relay installed in the signature's
    Celery app reads (its ``Outbox``), else to the process's default
    outbox's. Returns the ``AsyncResult`` (``GroupResult`` for a group)
    with every task id fixed now. See ``Outbox.apply_async`` and
    docs/celery.md.
    """
    from .celery.runtime import outbox_for

    return outbox_for(_app_of(sig)).apply_async(conn, sig, **options)


def _app_of(sig: Any) -> Any:
    """The Celery app of a signature or canvas (Celery's current app when none
    is bound); None for what is not one (apply_async then names the problem)."""
    try:
        return getattr(sig, "app", None)
    except Exception:
        return None


if TYPE_CHECKING:
    # Served by __getattr__ at run time (Celery is imported on first use);
    # typed here, so that a checker sees install's parameters and result.
    from . import aio
    from .celery.install import install


def __getattr__(name: str) -> Any:
    # The Celery integration is imported on first use, so producers that only
    # call enqueue() never pay for importing Celery.
    if name == "install":
        from .celery.install import install

        return install
    if name == "aio":
        # outbox_relay.aio.enqueue(...) after a plain ``import outbox_relay``.
        import importlib

        return importlib.import_module(".aio", __name__)
    raise AttributeError(f"module 'outbox_relay' has no attribute {name!r}")
