"""A user's own Celery app that adopts the relay with ``outbox_relay.install``.

Run by tests/test_queues.py as real processes::

    celery -A tests.apps.shop_app worker [-Q billing]
    celery -A tests.apps.shop_app beat

Configured from the environment (names outside ``OUTBOX_*``):

* ``SHOP_BROKER_URL``: the broker;
* ``SHOP_DSN``, ``SHOP_PUBLISHER``: passed to ``install(app, dsn=..., publisher=...)``;
* ``SHOP_EFFECTS_DSN``: where ``shop.charge`` records its effect (table ``charges``);
* ``SHOP_RELAY_QUEUE``: when set, ``install(..., queue=...)``;
* ``SHOP_RELAY_ROUTE``: when set, ``task_routes`` sends ``outbox_relay.*`` to that queue;
* ``SHOP_ANNOTATIONS``: ``dict``, ``list`` or ``object``: ``task_annotations``
  in that form giving ``outbox_relay.deliver`` ``max_retries=0``.

The shop's own task ``shop.charge`` is routed to the queue ``billing``.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from celery import Celery

import outbox_relay

app = Celery("shop", broker=os.environ.get("SHOP_BROKER_URL", "memory://"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    task_routes={"shop.charge": {"queue": "billing"}},
)

_route = os.environ.get("SHOP_RELAY_ROUTE")
if _route:
    app.conf.task_routes = [
        {"outbox_relay.*": {"queue": _route}},
        {"shop.charge": {"queue": "billing"}},
    ]


class DeliverNoRetries:
    """The class form of ``task_annotations``: Celery calls ``annotate(task)``."""

    def annotate(self, task: Any) -> dict[str, Any] | None:
        if task.name == "outbox_relay.deliver":
            return {"max_retries": 0}
        return None


_annotations = os.environ.get("SHOP_ANNOTATIONS")
if _annotations == "dict":
    app.conf.task_annotations = {"outbox_relay.deliver": {"max_retries": 0}}
elif _annotations == "list":
    app.conf.task_annotations = [
        {"shop.charge": {"rate_limit": "100/s"}},
        {"outbox_relay.deliver": {"max_retries": 0}},
    ]
elif _annotations == "object":
    app.conf.task_annotations = DeliverNoRetries()
elif _annotations:
    raise RuntimeError(f"SHOP_ANNOTATIONS={_annotations!r}: use dict, list or object")


@app.task(name="shop.charge")
def charge(order_id: int, amount: int) -> None:
    with psycopg.connect(os.environ["SHOP_EFFECTS_DSN"], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO charges (order_id, amount, pid) VALUES (%s, %s, %s)",
            (order_id, amount, os.getpid()),
        )


_relay_settings: dict[str, Any] = {}
if os.environ.get("SHOP_RELAY_QUEUE"):
    _relay_settings["queue"] = os.environ["SHOP_RELAY_QUEUE"]

outbox_relay.install(
    app,
    dsn=os.environ.get("SHOP_DSN"),
    publisher=os.environ.get("SHOP_PUBLISHER"),
    **_relay_settings,
)
