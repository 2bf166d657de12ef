"""A stand-in for a prefork Celery worker, for tests/test_metrics.py.

``python -m tests.metrics_worker DSN CHILDREN`` with ``PROMETHEUS_MULTIPROC_DIR``
set: the parent creates the ``MetricsObserver`` (as ``install()`` would, before
the pool forks), claims every due row and closes its connection; each forked
child connects on its own and delivers its share through ``Deliverer.deliver``.
Event type ``bad`` fails permanently, everything else is delivered.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import psycopg

from outbox_relay import Deliverer, DirectDatabase, Message, PermanentError, store
from outbox_relay.metrics import MetricsObserver


def publish(message: Message) -> None:
    if message.event_type == "bad":
        raise PermanentError("rejected by the receiver")


def main(dsn: str, children: int) -> int:
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR"), "multiprocess mode is the point"
    observer = MetricsObserver()
    with psycopg.connect(dsn, autocommit=True) as conn:
        claimed = store.claim(conn, owner="parent", batch=1000, lease=timedelta(minutes=5))
    shares = [claimed[i::children] for i in range(children)]
    pids = []
    for share in shares:
        pid = os.fork()
        if pid == 0:  # a pool child: its own connection, its own metric files
            code = 0
            try:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    relay = Deliverer(
                        publish, db=DirectDatabase(conn), observer=observer, concurrency=1
                    )
                    report = relay.deliver([c.ref for c in share])
                    code = 0 if report.done + report.dead == len(share) else 3
            except BaseException:
                code = 4
            finally:
                os._exit(code)
        pids.append(pid)
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    print(f"children={len(pids)} failed={failed} claimed={len(claimed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    args: list[Any] = sys.argv[1:]
    sys.exit(main(args[0], int(args[1])))
