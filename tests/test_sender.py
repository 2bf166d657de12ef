"""The fan-out's sender puts on the broker what ``Task.apply_async`` would.

``outbox_relay.celery.sender.RoundSender`` works out once per round what
``apply_async`` works out per message (routing, the task's options, the
expiry). Here both send the same task with the fan-out's options through a
real Redis broker, and the two messages read back from Redis must match in
everything but their ids and the instant their expiry was computed; the
publish signals fire for both.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import after_task_publish, before_task_publish

from outbox_relay.celery.sender import RoundSender

from . import services

OPTIONS: dict[str, Any] = {
    "expires": 50.0,
    "serializer": "json",
    "time_limit": 30,
    "parent_id": "claim-task-id",
    "root_id": "root-task-id",
    "add_to_parent": False,
    "declare": [],
}


@pytest.fixture(params=["utc", "local time"])
def app_and_queue(request: pytest.FixtureRequest) -> Iterator[tuple[Celery, str]]:
    queue = f"routed-{uuid.uuid4().hex[:8]}"
    app = Celery("sender-test", broker=services.redis_url())
    if request.param == "local time":
        # Celery then writes the expiry in this zone: so must the sender.
        app.conf.update(enable_utc=False, timezone="America/New_York")
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        # The user's routes decide, as for the relay's own tasks.
        task_routes={"sender.deliver": {"queue": queue}},
        # An annotation the task's own options carry (apply_async merges them).
        task_annotations={"sender.deliver": {"soft_time_limit": 25}},
    )

    @app.task(name="sender.deliver", ignore_result=True, typing=False, shared=False)
    def deliver(outbox_id: int, lease_version: int, drain: Any = False) -> None:
        return None

    app.finalize()
    yield app, queue
    client = redis.Redis.from_url(services.redis_url())
    client.delete(queue)
    client.close()


def _read(url: str, queue: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(url)
    try:
        raw = client.lrange(queue, 0, -1)
    finally:
        client.close()
    # kombu's Redis transport LPUSHes: the oldest message is last.
    return [json.loads(item) for item in reversed(raw)]


def test_a_round_sender_message_matches_apply_async(app_and_queue: tuple[Celery, str]) -> None:
    app, queue = app_and_queue
    task = app.tasks["sender.deliver"]
    published: list[tuple[str, str]] = []

    def before(sender: str, headers: dict[str, Any], **_: Any) -> None:
        published.append(("before", headers["id"]))

    def after(sender: str, headers: dict[str, Any], **_: Any) -> None:
        published.append(("after", headers["id"]))

    before_task_publish.connect(before, weak=False)
    after_task_publish.connect(after, weak=False)
    try:
        with app.producer_or_acquire() as producer:
            task.apply_async(
                (7, 3),
                {"drain": "start"},
                producer=producer,
                argsrepr="(outbox #7 v3)",
                kwargsrepr="{'drain': 'start'}",
                **OPTIONS,
            )
            sender = RoundSender(app, task, producer, dict(OPTIONS))
            sent_id = sender.send(
                (7, 3),
                {"drain": "start"},
                argsrepr="(outbox #7 v3)",
                kwargsrepr="{'drain': 'start'}",
            )
    finally:
        before_task_publish.disconnect(before)
        after_task_publish.disconnect(after)

    by_apply, by_sender = _read(services.redis_url(), queue)
    assert by_sender["headers"]["id"] == sent_id
    # Each publish ran through Celery's signals, before and after.
    ids = [by_apply["headers"]["id"], sent_id]
    assert published == [(when, i) for i in ids for when in ("before", "after")]

    # The body: the same arguments, keyword arguments and (empty) canvas.
    assert base64.b64decode(by_sender["body"]) == base64.b64decode(by_apply["body"])

    # The headers: the same but for the task's own id and the expiry's instant.
    apply_headers, sender_headers = dict(by_apply["headers"]), dict(by_sender["headers"])
    expiries = [datetime.fromisoformat(h.pop("expires")) for h in (apply_headers, sender_headers)]
    assert abs((expiries[1] - expiries[0]).total_seconds()) < 5
    for headers in (apply_headers, sender_headers):
        headers.pop("id")
    assert sender_headers == apply_headers
    assert sender_headers["timelimit"] == [30, 25]  # the annotation's soft limit came along
    assert (sender_headers["parent_id"], sender_headers["root_id"]) == (
        "claim-task-id",
        "root-task-id",
    )
    assert sender_headers["ignore_result"] is True

    # The properties: the broker's TTL, routing and encoding alike.
    apply_props, sender_props = dict(by_apply["properties"]), dict(by_sender["properties"])
    for props in (apply_props, sender_props):
        assert props.pop("correlation_id") in ids
        props.pop("delivery_tag")
    # apply_async also copies the two reprs into the properties (its options
    # go to kombu whole); Celery's worker, events and Flower read the headers'.
    assert (apply_props.pop("argsrepr"), apply_props.pop("kwargsrepr")) == (
        sender_headers["argsrepr"],
        sender_headers["kwargsrepr"],
    )
    assert sender_props == apply_props
    # The broker's TTL (kombu's Redis transport keeps it in milliseconds).
    assert float(sender_props["expiration"]) == 50_000
    assert sender_props["delivery_info"]["routing_key"] == queue
