"""A consumer service's Celery app: what a user's own pipeline looks like.

Run by tests/test_publisher_celery_task.py as a real worker process::

    celery -A tests.apps.consumer worker -Q $CONSUMER_QUEUE

Configured from the environment: CONSUMER_BROKER_URL, CONSUMER_DSN (the
consumer's database, holding ``effects``, ``arrivals`` and the inbox) and
CONSUMER_QUEUE.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from celery import Celery
from celery.signals import task_prerun

from outbox_relay.inbox import current_connection, inbox_task, message_id_from_request

DSN = os.environ.get("CONSUMER_DSN", "")

app = Celery("tests.apps.consumer", broker=os.environ.get("CONSUMER_BROKER_URL", "memory://"))
app.conf.update(
    task_default_queue=os.environ.get("CONSUMER_QUEUE", "consumer"),
    task_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # The tests share a Redis database with other suites: answer no one's
    # broadcast control commands (ping, inspect) but our own queue's tasks.
    worker_enable_remote_control=False,
)


@inbox_task(app, name="consumer.record_effect", consumer="billing", dsn=DSN or None)
def record_effect(payload: dict[str, Any]) -> str:
    """The business effect: one row per payment, written in the inbox transaction."""
    request = record_effect.request
    current_connection().execute(
        "INSERT INTO effects (message_id, task_id, amount, event_type) VALUES (%s, %s, %s, %s)",
        (
            message_id_from_request(request),
            request.id,
            payload["amount"],
            (request.headers or {}).get("outbox-event-type"),
        ),
    )
    return "charged"


@inbox_task(app, name="consumer.record_message", consumer="audit", dsn=DSN or None)
def record_message(**message: Any) -> None:
    """Receives the whole outbox message as keyword arguments (args_from="message")."""
    current_connection().execute(
        "INSERT INTO effects (message_id, task_id, amount, event_type) VALUES (%s, %s, %s, %s)",
        (message["idempotency_key"], str(message["id"]), 0, message["event_type"]),
    )


@task_prerun.connect
def _log_arrival(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    # Outside the inbox transaction, so duplicates that the inbox skips are
    # still visible to the test.
    if not DSN or task is None:
        return
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute("INSERT INTO arrivals (task_id, task) VALUES (%s, %s)", (task_id, task.name))
