"""The fan-out's sender puts on the broker what ``Task.apply_async`` would.

``outbox_relay.celery.sender.RoundSender`` works out once per round what
``apply_async`` and ``send_task`` work out per message (routing, the task's
options, the expiry). Here each pair sends the same task with the relay's
options through a real Redis broker (a delivery task as the fan-out sends
it, a durable row's task as its send does), and the two messages read back
from Redis must match in everything but their ids and the instant their
expiry was computed; the publish signals fire for both.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from celery import Celery
from celery.signals import after_task_publish, before_task_publish

from outbox_relay.celery.durable_send import declare_queue
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

    def by_parity(name: str, args: Any, kwargs: Any, options: Any, **_: Any) -> Any:
        # A user's router that reads the task's arguments (durable rows only).
        if name in ("sender.durable", "sender.elsewhere"):
            return {"queue": f"{queue}-{'even' if args[0] % 2 == 0 else 'odd'}"}
        return None

    if request.param == "local time":
        # Celery then writes the expiry in this zone: so must the sender.
        app.conf.update(enable_utc=False, timezone="America/New_York")
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        # The user's routes decide, as for the relay's own tasks.
        task_routes=[{"sender.deliver": {"queue": queue}}, by_parity],
        # An annotation the task's own options carry (apply_async merges them).
        task_annotations={
            "sender.deliver": {"soft_time_limit": 25},
            "sender.durable": {"priority": 3},
        },
    )

    @app.task(name="sender.deliver", ignore_result=True, typing=False, shared=False)
    def deliver(outbox_id: int, lease_version: int, drain: Any = False) -> None:
        return None

    @app.task(name="sender.durable", typing=False, shared=False)
    def durable(order: int, *, note: str = "") -> None:
        return None

    app.finalize()
    yield app, queue
    client = services.redis_client(services.redis_url())
    client.delete(queue, f"{queue}-even", f"{queue}-even\x06\x163")
    client.close()


def _read(url: str, queue: str) -> list[dict[str, Any]]:
    client = services.redis_client(url)
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
            sender = RoundSender(app, producer)
            sent_id = sender.send(
                sender.for_task(task, dict(OPTIONS)),
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
    sender_headers, sender_props = _assert_same(by_apply, by_sender)
    assert sender_headers["timelimit"] == [30, 25]  # the annotation's soft limit came along
    assert (sender_headers["parent_id"], sender_headers["root_id"]) == (
        "claim-task-id",
        "root-task-id",
    )
    assert sender_headers["ignore_result"] is True
    # The broker's TTL (kombu's Redis transport keeps it in milliseconds).
    assert float(sender_props["expiration"]) == 50_000
    assert sender_props["delivery_info"]["routing_key"] == queue


def _assert_same(
    by_celery: dict[str, Any], by_sender: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both messages alike but for ids and the expiry's instant; returns the
    sender's headers and properties (without those)."""
    # The body: the same arguments, keyword arguments and canvas.
    assert base64.b64decode(by_sender["body"]) == base64.b64decode(by_celery["body"])

    # The headers: the same but for the task's own id and the expiry's instant.
    celery_headers, sender_headers = dict(by_celery["headers"]), dict(by_sender["headers"])
    expiries = [h.pop("expires") for h in (celery_headers, sender_headers)]
    if expiries[0] is None:
        assert expiries[1] is None
    else:
        instants = [datetime.fromisoformat(e) for e in expiries]
        assert abs((instants[1] - instants[0]).total_seconds()) < 5
    for headers in (celery_headers, sender_headers):
        headers.pop("id")
    assert sender_headers == celery_headers

    # The properties: the broker's TTL, routing and encoding alike.
    celery_props, sender_props = dict(by_celery["properties"]), dict(by_sender["properties"])
    for props, message in ((celery_props, by_celery), (sender_props, by_sender)):
        # Celery's correlation id is the message's own task id.
        assert props.pop("correlation_id") == message["headers"]["id"]
        props.pop("delivery_tag")
    # apply_async and send_task also copy the two reprs into the properties
    # (their options go to kombu whole); Celery's worker, events and Flower
    # read the headers'.
    assert (celery_props.pop("argsrepr"), celery_props.pop("kwargsrepr")) == (
        sender_headers["argsrepr"],
        sender_headers["kwargsrepr"],
    )
    assert sender_props == celery_props
    return sender_headers, sender_props


@pytest.mark.parametrize("kind", ["tracked", "hand-off", "not registered here"])
def test_a_durable_rows_message_matches_send_task(
    app_and_queue: tuple[Celery, str], kind: str
) -> None:
    """A durable row's task as its send sends it, against ``app.send_task``
    with the options the relay gave it before: the row's own routing options
    under the registered task's, a router that reads the arguments, the
    row's fixed task id, the fence in the headers and the lease's expiry
    (tracked), or the rest of the chain (a hand-off)."""
    app, queue = app_and_queue
    name = "sender.elsewhere" if kind == "not registered here" else "sender.durable"
    task_id = f"durable-{uuid.uuid4().hex[:8]}"
    args, kwargs = [8], {"note": "x"}
    row_options = {"time_limit": 40, "soft_time_limit": 35}
    lineage = {"parent_id": "claim-task-id", "root_id": "root-task-id", "add_to_parent": False}
    chain: list[Any] | None = None
    extra: dict[str, Any] = {}
    if kind == "hand-off":
        chain = [app.signature("sender.durable", args=(9,))]
    else:
        extra = {"headers": {"outbox-durable-id": 12, "outbox-durable-lease-version": 4}}
        extra["expires"] = 45.0
    reprs = {"argsrepr": "(outbox #12 v4)", "kwargsrepr": "{'note': ...}"}
    with app.producer_or_acquire() as producer:
        sender = RoundSender(app, producer)
        options = {**row_options, **lineage, "declare": [], "serializer": "json"}
        if "expires" in extra:
            options["expires"] = extra["expires"]
        route = sender.for_name(name, options, args, kwargs)
        # As the fan-out does once per round (both sends say declare=[]).
        declare_queue(producer, route.options["queue"], set())
        app.send_task(
            name,
            args=args,
            kwargs=kwargs,
            task_id=task_id,
            producer=producer,
            chain=chain,
            **{**row_options, **lineage, "declare": [], "serializer": "json"},
            **reprs,
            **extra,
        )
        sender.send(
            route,
            args,
            kwargs,
            task_id=task_id,
            headers=extra.get("headers"),
            chain=chain,
            **reprs,
        )
    # The router read the first argument: 8 is even.
    assert route.options["queue"].name == f"{queue}-even"
    # kombu's Redis transport keeps a list per priority step (the annotation's 3).
    registered = kind != "not registered here"
    key = f"{queue}-even" + ("\x06\x163" if registered else "")
    by_celery, by_sender = _read(services.redis_url(), key)
    assert by_celery["headers"]["id"] == by_sender["headers"]["id"] == task_id
    headers, props = _assert_same(by_celery, by_sender)
    assert headers["timelimit"] == [40, 35]
    if kind == "hand-off":
        assert json.loads(base64.b64decode(by_sender["body"]))[2]["chain"][0]["args"] == [9]
        assert "outbox-durable-id" not in headers  # not tracked: no fence to check
    else:
        assert (headers["outbox-durable-id"], headers["outbox-durable-lease-version"]) == (12, 4)
        assert float(props["expiration"]) == 45_000
    # The registered task's own priority came along, as send_task merges it
    # (kombu writes 0 for none).
    assert props["priority"] == (3 if registered else 0)
