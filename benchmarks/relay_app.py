"""The standalone relay app with statement counting, for ``run.py``'s workers.

``celery -A benchmarks.relay_app worker`` runs exactly ``outbox_relay.app``;
only the driver-side counters of ``benchmarks/counting.py`` are added, in the
main process and again in every pool child after it forks.
"""

from __future__ import annotations

import os
from typing import Any

from celery.signals import worker_process_init

from benchmarks import counting
from outbox_relay.app import app

__all__ = ["app"]

counting.install()

if os.environ.get("BENCH_ACK_EMULATION") == "false":
    # The relay's tasks are hints (the database is the truth): a lost one
    # costs a lease, so the Redis transport's unacked bookkeeping is optional
    # for them. Measured as a variant, not the default.
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        "ack_emulation": False,
    }


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _count_in_child(**_: Any) -> None:
    counting.install()
