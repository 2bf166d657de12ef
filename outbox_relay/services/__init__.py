"""The relay's services, each with one job and a ``run_once``.

* ``Claimer``: leases due rows under the in-flight cap.
* ``Deliverer``: begin, publish, classify, fenced finalize (one chunk).
* ``Completer``: a process's published first attempts marked done together.
* ``LeaseKeeper``: a bounded heartbeat for long chunks, measured by the database.
* ``Rescuer``: frees expired leases on its own tick, whatever the room.
* ``Purger``: deletes finished rows past retention.

The Celery tasks (``outbox_relay.celery``) and ``RelayLoop`` drive them alike.
"""

from __future__ import annotations

from .claimer import Claimer, ClaimResult
from .completer import Completer
from .deliverer import Deliverer, DeliveryReport, Observer, Publisher
from .keeper import Hold, LeaseKeeper
from .loop import RelayLoop, dispatch_once
from .policy import RetryPolicy, classify
from .purger import Purger
from .rescuer import Rescuer

__all__ = [
    "ClaimResult",
    "Claimer",
    "Completer",
    "Deliverer",
    "DeliveryReport",
    "Hold",
    "LeaseKeeper",
    "Observer",
    "Publisher",
    "Purger",
    "RelayLoop",
    "Rescuer",
    "RetryPolicy",
    "classify",
    "dispatch_once",
]
