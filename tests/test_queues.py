"""Celery's conventions hold for an app that adopted the relay with ``install``.

Real ``celery -A tests.apps.shop_app worker``/``beat`` processes (see
tests/apps/shop_app.py), a real Redis broker and the test's database:

1. ``-Q`` means what it means in Celery: a worker started for ``billing``
   consumes ``billing`` only, runs none of the relay's start-up checks and
   opens no PostgreSQL connection for it, while the same app started
   without ``-Q`` consumes its default queue and ``outbox`` and refuses to
   start with a bad relay configuration.
2. The relay's tasks follow the user's ``task_routes``.
3. ``task_annotations`` in every form Celery accepts (dict, list, an object
   with ``annotate(task)``) are read as the deliver task's retry policy.
"""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from . import services
from .apps import kit
from .celery_procs import CeleryProcs

pytestmark = pytest.mark.celery

APP = "tests.apps.shop_app"
BAD_PUBLISHER = "tests.apps.no_such_module:publish"


@pytest.fixture
def shop_dsn(dsn: str) -> str:
    kit.prepare_receiver(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE charges (order_id int, amount int, pid int)")
    return dsn


@pytest.fixture
def shop(shop_dsn: str, tmp_path: Path) -> Any:
    made: list[CeleryProcs] = []

    def factory(**env: str) -> CeleryProcs:
        procs = CeleryProcs(
            {
                "SHOP_BROKER_URL": services.redis_url(),
                "SHOP_DSN": shop_dsn,
                "SHOP_PUBLISHER": "tests.apps.receiver:record",
                "SHOP_EFFECTS_DSN": shop_dsn,
                "RECEIVER_DSN": shop_dsn,
                "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
                **env,
            },
            tmp_path,
            app=APP,
        )
        made.append(procs)
        return procs

    yield factory
    for procs in made:
        procs.stop_all()


def _node() -> tuple[str, str]:
    """(the -n argument, the node name it expands to): unique on a shared broker."""
    name = f"shop-{uuid.uuid4().hex[:8]}"
    return f"{name}@%h", f"{name}@{socket.gethostname()}"


def _exited_or_ready(worker: Any) -> str:
    """The worker's log once it has exited or become ready."""
    kit.wait_until(
        lambda: not worker.alive() or " ready." in worker.text(),
        timeout=60,
        what="the worker to exit or get ready",
    )
    return str(worker.text())


def _charges(dsn: str, order_id: int) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM charges WHERE order_id = %s", (order_id,)
        ).fetchone()
    return int(row[0]) if row else 0


def _relay_connections(dsn: str, application_name: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
            (application_name,),
        ).fetchone()
    return int(row[0]) if row else 0


# ------------------------------------------------------------------ 1. -Q
def test_worker_for_billing_only_ignores_a_broken_relay_configuration(shop, shop_dsn, tmp_path):
    missing = make_conninfo(shop_dsn, dbname=f"outbox_missing_{uuid.uuid4().hex[:8]}")
    procs = shop(SHOP_DSN=missing, SHOP_PUBLISHER=BAD_PUBLISHER)
    arg, node = _node()
    try:
        worker = procs.worker(args=("-n", arg, "-Q", "billing"))
    except AssertionError as exc:
        raise AssertionError(
            f"a worker for -Q billing must start whatever the relay's settings:\n{exc}"
        ) from None
    assert kit.active_queues(APP, node, procs.env, cwd=tmp_path) == ["billing"]
    order = int(time.time() * 1000) % 2_000_000_000
    kit.client_app(procs.env["SHOP_BROKER_URL"]).send_task(
        "shop.charge", args=(order, 1999), queue="billing"
    )
    kit.wait_until(lambda: _charges(shop_dsn, order) == 1, timeout=20, what="shop.charge ran")
    assert worker.alive()
    assert BAD_PUBLISHER not in worker.text()


def test_worker_for_billing_only_opens_no_relay_connection(shop, shop_dsn, tmp_path):
    marker = f"relay-probe-{uuid.uuid4().hex[:8]}"
    procs = shop(SHOP_DSN=make_conninfo(shop_dsn, application_name=marker))
    arg, node = _node()
    seen: list[int] = []
    procs.worker(args=("-n", arg, "-Q", "billing"), ready=False)
    deadline = time.monotonic() + 60
    while " ready." not in procs.procs[-1].text():
        assert procs.procs[-1].alive(), procs.logs()
        assert time.monotonic() < deadline, procs.logs()
        seen.append(_relay_connections(shop_dsn, marker))
        time.sleep(0.05)
    # A message for the relay: a relay living in this worker would wake on
    # its NOTIFY and deliver it.
    [message_id] = kit.enqueue(shop_dsn, 1, threads=1)
    order = 42
    kit.client_app(procs.env["SHOP_BROKER_URL"]).send_task(
        "shop.charge", args=(order, 10), queue="billing"
    )
    kit.wait_until(lambda: _charges(shop_dsn, order) == 1, timeout=20, what="shop.charge ran")
    end = time.monotonic() + 3
    while time.monotonic() < end:
        seen.append(_relay_connections(shop_dsn, marker))
        time.sleep(0.05)
    assert max(seen) == 0, f"the billing worker held {max(seen)} relay connection(s)"
    assert kit.row(shop_dsn, message_id)["status"] == "pending"
    assert kit.active_queues(APP, node, procs.env, cwd=tmp_path) == ["billing"]
    # The banner lists the relay's tasks (registered, as Celery does for any
    # imported task); none of them may have run here.
    assert "Task outbox_relay." not in procs.procs[-1].text()
    # But it says so: a worker started with the wrong -Q by mistake left rows
    # waiting without a word.
    assert (
        "this worker does not consume the relay's queue 'outbox' (it consumes billing)"
        in procs.procs[-1].text()
    ), procs.logs()


def test_worker_without_queues_consumes_default_and_outbox(shop, tmp_path):
    procs = shop()
    arg, node = _node()
    procs.worker(args=("-n", arg))
    assert kit.active_queues(APP, node, procs.env, cwd=tmp_path) == ["celery", "outbox"]


def test_worker_without_queues_validates_the_relay(shop):
    procs = shop(SHOP_PUBLISHER=BAD_PUBLISHER)
    worker = procs.worker(ready=False)
    worker.popen.wait(60)
    log = worker.text()
    assert worker.popen.returncode != 0, log[-3000:]
    assert " ready." not in log
    assert "OUTBOX_PUBLISHER" in log and "no_such_module" in log, log[-3000:]


def test_a_worker_for_the_relay_queue_refuses_settings_it_cannot_read(shop):
    # With -Q outbox and a setting that cannot be read, the worker ran on
    # ("this worker ignores them") and failed every claim it took: the queue
    # the settings name, as written, is the one it consumes.
    procs = shop(OUTBOX_LEASE_SECONDS="abc")
    worker = procs.worker(args=("-Q", "outbox"), ready=False)
    log = _exited_or_ready(worker)
    assert " ready." not in log, f"a relay worker started with OUTBOX_LEASE_SECONDS=abc:\n{log}"
    assert "OUTBOX_LEASE_SECONDS" in log, log[-3000:]
    # A worker for the app's other queues still starts, and says why it ignores them.
    billing = procs.worker(args=("-n", _node()[0], "-Q", "billing"))
    assert "outbox relay settings are invalid" in billing.text()


# ------------------------------------------------------------ 2. task_routes
def test_relay_tasks_follow_the_users_task_routes(shop, shop_dsn, tmp_path):
    queue = kit.unique("relay-q")
    procs = shop(SHOP_RELAY_ROUTE=queue)
    arg, node = _node()
    worker = procs.worker(args=("-n", arg, "-Q", queue))
    procs.beat()
    assert kit.active_queues(APP, node, procs.env, cwd=tmp_path) == [queue]
    ids = kit.enqueue(shop_dsn, 20, threads=2, per_transaction=5)
    kit.wait_until(
        lambda: kit.status_counts(shop_dsn) == {"done": 20},
        timeout=40,
        describe=lambda: kit.status_counts(shop_dsn),
        what=f"20 messages delivered by a worker consuming only {queue}",
    )
    assert kit.delivered_ids(shop_dsn) == set(ids)
    log = worker.text()
    assert "outbox_relay.claim[" in log and "outbox_relay.deliver[" in log


def test_worker_for_the_routed_relay_queue_validates_the_relay(shop):
    # The worker that consumes the queue the relay's tasks are routed to is a
    # relay worker, whatever the relay's own queue setting says: a bad
    # publisher must stop it at start, as it stops a worker without -Q.
    queue = kit.unique("relay-q")
    procs = shop(SHOP_RELAY_ROUTE=queue, SHOP_PUBLISHER=BAD_PUBLISHER)
    worker = procs.worker(args=("-Q", queue), ready=False)
    log = _exited_or_ready(worker)
    assert " ready." not in log, f"a relay worker started with a bad publisher:\n{log[-3000:]}"
    assert "OUTBOX_PUBLISHER" in log and "no_such_module" in log, log[-3000:]


# ------------------------------------------------------ 3. task_annotations
@pytest.mark.parametrize("form", ["dict", "list", "object"])
def test_task_annotations_set_the_retry_policy(shop, shop_dsn, form):
    procs = shop(
        SHOP_ANNOTATIONS=form,
        SHOP_PUBLISHER="tests.apps.receiver:fail",
        SHOP_RELAY_QUEUE=kit.unique("outbox-annot"),
    )
    procs.worker()
    procs.beat()
    [message_id] = kit.enqueue(shop_dsn, 1, threads=1)

    def settled() -> bool:
        r = kit.row(shop_dsn, message_id)
        return r["status"] == "dead" or r["attempts"] >= 2

    kit.wait_until(
        settled,
        timeout=30,
        describe=lambda: kit.row(shop_dsn, message_id),
        what="the failing message to die or be retried",
    )
    r = kit.row(shop_dsn, message_id)
    assert (r["status"], r["attempts"]) == ("dead", 1), (
        f"max_retries=0 in {form}-form task_annotations: expected dead after 1 attempt, got {r}"
    )
    assert len(kit.calls(shop_dsn, message_id)) == 1
