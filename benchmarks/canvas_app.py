"""The app of the ``canvas`` benchmark: a no-op task, and the relay installed with no publisher.

``bench.canvas_noop`` goes to the queue ``bench-canvas``; the relay's tasks
to ``OUTBOX_QUEUE``; one worker started without ``-Q`` consumes both, as a
user's worker would.
"""

from __future__ import annotations

import os

from celery import Celery

import outbox_relay

app = Celery("bench-canvas", broker=os.environ.get("CELERY_BROKER_URL"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_default_queue="bench-canvas",
    broker_connection_retry_on_startup=True,
)


@app.task(name="bench.canvas_noop")
def noop(item: int) -> None:
    return None


outbox_relay.install(app, dsn=os.environ.get("OUTBOX_DSN"))
