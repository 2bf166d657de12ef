"""Baselines on the same broker and pool as the relay: the Celery ceiling.

``noop`` does nothing. ``update`` does what the relay's per-message task
must at least do: one PostgreSQL UPDATE and commit, on a connection per process.
Its statements are counted as the relay's are (``benchmarks/counting.py``):
the same column of the table for both sides of a ratio.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from celery import Celery
from celery.signals import worker_process_init

from benchmarks import counting, timeline

app = Celery("bench-baseline", broker=os.environ.get("CELERY_BROKER_URL"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_default_queue="baseline",
    broker_connection_retry_on_startup=True,
    # As docs/durable.md advises (the worker looks it up for every message
    # with an expiry, as durable tasks have); the same in both apps.
    timezone="UTC",
)


if os.environ.get("BENCH_ACK_EMULATION") == "false":
    # The like-for-like baseline of the relay's standalone app and of durable
    # tasks on a worker of their own, which run without kombu's emulated acks.
    app.conf.broker_transport_options = {"ack_emulation": False}

counting.install()


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _timeline_in_child(**_: Any) -> None:
    counting.install()  # when BENCH_COUNT_DIR is set
    timeline.install()  # when BENCH_TIMELINE_DIR is set; these tasks count as "other"


_conn: psycopg.Connection[Any] | None = None
_pid: int | None = None


def _connection() -> psycopg.Connection[Any]:
    global _conn, _pid
    if _conn is None or _pid != os.getpid():
        _conn = psycopg.connect(os.environ["BENCH_DSN"])
        _pid = os.getpid()
    return _conn


@app.task(name="bench.noop")
def noop(item: int) -> None:
    return None


@app.task(name="bench.update")
def update(item: int) -> None:
    conn = _connection()
    conn.execute("UPDATE bench_items SET done = true WHERE id = %s", (item,))
    conn.commit()
