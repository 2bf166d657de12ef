"""A user's Celery app that relays its own outbox to its own tasks.

Run by tests/test_celery_pipeline.py as real worker processes::

    celery -A tests.apps.pipeline worker [-Q ...]

The relay is installed into this app (``outbox_relay.install``), so the
relay's app *is* the user's app, and the ``celery:`` publisher sends tasks
registered right here. Configured from the environment:

* ``PIPELINE_BROKER_URL``: the broker; ``PIPELINE_DSN``: the outbox and the
  tables ``runs``, ``attempts`` and ``effects`` (created by the test);
* ``PIPELINE_PUBLISHER``: ``task`` (the ``record`` Task object),
  ``signature`` (a Signature of it, with a partial keyword argument) or any
  publisher spec (``celery:pipeline.record``); unset: no relay settings;
* ``PIPELINE_DEFAULT_QUEUE``: ``task_default_queue`` (the relay's queue is
  ``OUTBOX_QUEUE``);
* ``PIPELINE_RECORD_QUEUE``: when set, ``pipeline.record`` is routed there;
* ``PIPELINE_APPLY_QUEUE``: the queue of ``pipeline.apply`` (default
  ``pipeline-apply``); ``PIPELINE_DEAD_LETTER``: when set (RabbitMQ), that
  queue is declared with a dead-letter route to the queue of this name;
* ``PIPELINE_VISIBILITY_TIMEOUT``: Redis's visibility timeout, seconds.

No relay timeout settings: the relay runs with its defaults.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
from celery import Celery
from kombu import Exchange, Queue

import outbox_relay
from outbox_relay.inbox import current_connection, inbox_task

DSN = os.environ.get("PIPELINE_DSN", "")
APPLY_QUEUE = os.environ.get("PIPELINE_APPLY_QUEUE", "pipeline-apply")

app = Celery("pipeline", broker=os.environ.get("PIPELINE_BROKER_URL", "memory://"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_default_queue=os.environ.get("PIPELINE_DEFAULT_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    # The broker is shared with other suites: answer no broadcast commands.
    worker_enable_remote_control=False,
    # Deliberately NOT task_acks_late / task_reject_on_worker_lost: the
    # inbox task must be safe with Celery's defaults.
)
_routes: dict[str, dict[str, str]] = {"pipeline.apply": {"queue": APPLY_QUEUE}}
if os.environ.get("PIPELINE_RECORD_QUEUE"):
    _routes["pipeline.record"] = {"queue": os.environ["PIPELINE_RECORD_QUEUE"]}
app.conf.task_routes = _routes
if os.environ.get("PIPELINE_DEAD_LETTER"):
    # RabbitMQ: a rejected message goes to this queue (through the default
    # exchange, by name) instead of vanishing.
    app.conf.task_queues = [
        Queue(
            APPLY_QUEUE,
            # Celery's own choice for a queue it creates: a direct exchange
            # of the queue's name (the test's client publishes to it).
            Exchange(APPLY_QUEUE, type="direct"),
            routing_key=APPLY_QUEUE,
            queue_arguments={
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": os.environ["PIPELINE_DEAD_LETTER"],
            },
        )
    ]
if os.environ.get("PIPELINE_VISIBILITY_TIMEOUT"):
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["PIPELINE_VISIBILITY_TIMEOUT"]),
        # kombu scans for expired unacked messages every interval x throttle
        # seconds (10 x 10 by default): scan every second instead.
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }


def _write(sql: str, params: tuple[Any, ...]) -> None:
    """Outside any inbox transaction: visible even when the body's rolls back."""
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql, params)


@app.task(name="pipeline.record", bind=True)
def record(self: Any, payload: dict[str, Any], tag: str | None = None) -> None:
    """What the relay's ``celery:`` publisher delivers to: records how it arrived."""
    request = self.request
    headers = request.headers or {}
    _write(
        "INSERT INTO runs (n, tag, task_id, pid, hostname, is_eager, routing_key, argsrepr,"
        " kwargsrepr, outbox_id, lease_version) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s,"
        " %s, %s)",
        (
            payload.get("n"),
            tag,
            request.id,
            os.getpid(),
            request.hostname,
            bool(request.is_eager),
            (request.delivery_info or {}).get("routing_key"),
            request.argsrepr,
            request.kwargsrepr,
            headers.get("outbox-id", getattr(request, "outbox-id", None)),
            headers.get("outbox-lease-version", getattr(request, "outbox-lease-version", None)),
        ),
    )


@inbox_task(app, name="pipeline.apply", consumer="pipeline", dsn=DSN or None)
def apply(key: str, amount: int, sleep: float = 0.0, fail_first: bool = False) -> None:
    """An effect applied once per task id, whatever the broker does.

    Every run is counted in ``attempts`` (committed on its own, before the
    effect). ``sleep`` holds the first run mid-body (after its uncommitted
    write) so a test can kill it; ``fail_first`` makes the first run raise.
    """
    _write("INSERT INTO attempts (key, pid) VALUES (%s, %s)", (key, os.getpid()))
    with psycopg.connect(DSN, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM attempts WHERE key = %s", (key,)).fetchone()
    first = row is not None and row[0] == 1
    current_connection().execute(
        "INSERT INTO effects (key, amount, pid) VALUES (%s, %s, %s)", (key, amount, os.getpid())
    )
    if first and sleep:
        time.sleep(sleep)
    if first and fail_first:
        raise RuntimeError(f"the first run of {key} fails (test)")


def _publisher() -> Any:
    spec = os.environ.get("PIPELINE_PUBLISHER")
    if spec == "task":
        return record
    if spec == "signature":
        return record.s(tag="from-signature")
    return spec


if os.environ.get("PIPELINE_PUBLISHER"):
    outbox_relay.install(app, dsn=DSN, publisher=_publisher())
