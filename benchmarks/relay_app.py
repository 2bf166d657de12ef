"""The standalone relay app with statement counting, for ``run.py``'s workers.

``celery -A benchmarks.relay_app worker`` runs exactly ``outbox_relay.app``;
only the driver-side counters of ``benchmarks/counting.py`` are added, in the
main process and again in every pool child after it forks, and in each pool
child the task timeline of ``benchmarks/timeline.py``.
"""

from __future__ import annotations

import os
from typing import Any

from celery.signals import worker_process_init

from benchmarks import counting, timeline
from outbox_relay.app import app

__all__ = ["app"]

counting.install()


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _count_in_child(**_: Any) -> None:
    counting.install()
    timeline.install()  # when BENCH_TIMELINE_DIR is set


if os.environ.get("BENCH_ACK_EMULATION") == "true":
    # The standalone app turns the Redis transport's emulated acks off (its
    # tasks are hints; see outbox_relay/app.py). Measured as a variant: what
    # the relay costs in a worker whose app also runs the user's own tasks
    # (outbox_relay.install(app) leaves the transport alone).
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        "ack_emulation": True,
    }
