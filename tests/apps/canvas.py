"""A user's Celery app whose web code calls ``outbox_relay.apply_async``.

Run by tests/test_celery_canvas.py as real worker and beat processes::

    celery -A tests.apps.canvas worker|beat

The relay is installed into this app with **no publisher setting**: rows
written by ``apply_async`` need none. Configured from the environment:

* ``CANVAS_BROKER_URL``: the broker; ``CANVAS_BACKEND_URL``: the result
  backend (chords need one; default: none);
* ``CANVAS_DSN``: the outbox and the tables ``steps`` and ``effects``
  (``DDL``, created by the test);
* ``CANVAS_QUEUE``: ``task_default_queue`` (the relay's is ``OUTBOX_QUEUE``).

The same module is the producer's app in the test process: the tasks are
registered there too, as in a web process that imports its tasks.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
from celery import Celery

import outbox_relay
from outbox_relay.inbox import current_connection, inbox_task

DSN = os.environ.get("CANVAS_DSN", "")

DDL = """
CREATE TABLE steps (
    seq bigint GENERATED ALWAYS AS IDENTITY, tag text, prev jsonb, task_id text, name text,
    root_id text, parent_id text, group_id text, argsrepr text, outbox_id bigint, at timestamptz
    DEFAULT clock_timestamp()
);
CREATE TABLE effects (tag text NOT NULL, task_id text NOT NULL);
CREATE TABLE orders (id int PRIMARY KEY);
"""


class CanvasSettings:
    """Read with ``config_from_object``, as most teams configure Celery (a
    settings module, Django's settings): not ``conf.update``, whose values
    alone the relay's canvas app once copied. It then had no broker (and
    sent to amqp://localhost), no result backend and no queues."""

    broker_url = os.environ.get("CANVAS_BROKER_URL", "memory://")
    result_backend = os.environ.get("CANVAS_BACKEND_URL") or None
    task_serializer = "json"
    accept_content = ("json",)
    result_serializer = "json"
    task_default_queue = os.environ.get("CANVAS_QUEUE", "celery")
    broker_connection_retry_on_startup = True
    worker_prefetch_multiplier = 1
    # The broker is shared with other suites: answer no broadcast commands.
    worker_enable_remote_control = False
    # A chord's callback waits for its header's results: keep them.
    task_ignore_result = False
    result_expires = 600


app = Celery("canvas")
app.config_from_object(CanvasSettings)


def _record(task: Any, tag: str, prev: Any) -> None:
    request = task.request
    headers = request.headers or {}
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO steps (tag, prev, task_id, name, root_id, parent_id, group_id,"
            " argsrepr, outbox_id) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                tag,
                psycopg.types.json.Jsonb(prev),
                request.id,
                task.name,
                request.root_id,
                request.parent_id,
                request.group,
                request.argsrepr,
                headers.get("outbox-id", getattr(request, "outbox-id", None)),
            ),
        )


@app.task(name="canvas.step", bind=True)
def step(self: Any, prev: Any = None, tag: str = "", sleep: float = 0.0) -> str:
    """One step of a canvas: records how it ran; returns its tag for the next."""
    if sleep:
        time.sleep(sleep)
    _record(self, tag, prev)
    return tag


@app.task(name="canvas.collect", bind=True)
def collect(self: Any, results: list[Any], tag: str = "") -> list[Any]:
    """A chord's callback: records the header's results."""
    _record(self, tag, results)
    return results


@inbox_task(app, name="canvas.once", consumer="canvas", dsn=DSN or None, bind=True)
def once(self: Any, tag: str) -> None:
    """An effect applied once per task id (the inbox), however often it arrives."""
    current_connection().execute(
        "INSERT INTO effects (tag, task_id) VALUES (%s, %s)", (tag, self.request.id)
    )


outbox_relay.install(app, dsn=DSN or None)
