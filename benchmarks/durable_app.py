"""The durable-task benchmark's app: the baseline's one UPDATE, as a DurableTask.

``bench.durable_update`` does what ``baseline_app``'s ``bench.update`` does
(one PostgreSQL UPDATE and commit), written through ``self.outbox_conn`` so
that it commits with its outbox row's fenced ``done``. The relay is
installed into this app and sends the rows to it; one pool runs both.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import worker_process_init

import outbox_relay
from benchmarks import counting, timeline
from outbox_relay.celery import DurableTask

app = Celery("bench-durable", broker=os.environ.get("CELERY_BROKER_URL"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_default_queue="bench-durable",
    broker_connection_retry_on_startup=True,
    # As docs/durable.md advises (the worker looks it up for every message
    # with an expiry, as durable tasks have); the same in both apps.
    timezone="UTC",
)


@app.task(
    name="bench.durable_update",
    base=DurableTask,
    bind=True,
    # Off: every row runs from its own message (pipelines.durable's follow).
    outbox_follow=os.environ.get("BENCH_DURABLE_FOLLOW") != "false",
)
def durable_update(self: Any, item: int) -> None:
    self.outbox_conn.execute("UPDATE bench_items SET done = true WHERE id = %s", (item,))


counting.install()  # statements, as in the relay's own app (benchmarks/relay_app.py)


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _timeline_in_child(**_: Any) -> None:
    counting.install()
    timeline.install()  # when BENCH_TIMELINE_DIR is set; durable runs count as "other"


if os.environ.get("BENCH_ACK_EMULATION") == "false":
    # A worker that runs only durable tasks and the relay's own: the outbox
    # re-sends a durable task whose message a SIGKILLed worker took with it
    # (its lease lapses), so kombu's emulated acks, two Redis transactions
    # per task in the worker's main process, guard nothing there
    # (docs/durable.md, "A worker of their own").
    app.conf.broker_transport_options = {"ack_emulation": False}

if os.environ.get("OUTBOX_DSN"):
    outbox_relay.install(app, publisher="benchmarks.publishers:noop")
