"""Durable tasks: the outbox row tracks the task's execution (issue 10, items 3 and 4).

Real ``celery worker`` and ``celery beat`` processes of a user's app
(tests/apps/durable_app.py, relay installed into it) on a real Redis: a
worker killed mid-body, a broker that forgets its queue and a backlog that
expires lose no task and keep every task id; failures are rescheduled in the
database by the task's own retry options, or end dead; duplicate and stale
runs leave one effect; a chain's next step is written with its
predecessor's ``done``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery, chain

import outbox_relay
from outbox_relay import store
from outbox_relay.celery import DurableTask, write_durable
from outbox_relay.celery.durable import plain_options
from outbox_relay.errors import ConfigError, InvalidMessage, OutboxError
from outbox_relay.model import LeaseRef
from tests.apps import durable_app
from tests.apps.durable_app import (
    boom,
    effect,
    exhaust,
    first,
    flaky,
    patient,
    plain,
    poison,
    second,
    timed,
)

from . import services
from .celery_procs import CeleryProcs, Proc, wait_for
from .test_celery_pipeline import EventTap, _client

pytestmark = pytest.mark.celery

TABLES = """
CREATE TABLE runs (key text NOT NULL, task_id text, pid int NOT NULL, at timestamptz NOT NULL);
CREATE TABLE effects (key text NOT NULL, task_id text, value text);
"""
LEASE = 6.0


@pytest.fixture
def app_dsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    return dsn


class Setup:
    """Worker and beat processes of the durable app, and the queues they use."""

    def __init__(self, dsn: str, broker: str, folder: Path) -> None:
        self.dsn = dsn
        self.broker = broker
        # The broker may be shared with other suites: queues of our own.
        self.queue = f"dq-{uuid.uuid4().hex[:8]}"
        self.relay_queue = f"dr-{uuid.uuid4().hex[:8]}"
        self.procs = CeleryProcs(
            {
                "DURABLE_DSN": dsn,
                "DURABLE_BROKER_URL": broker,
                "DURABLE_QUEUE": self.queue,
                "DURABLE_LEASE": str(LEASE),
                "OUTBOX_QUEUE": self.relay_queue,
                "OUTBOX_CLAIM_INTERVAL_SECONDS": "1",
            },
            folder,
            app="tests.apps.durable_app",
        )

    def worker(
        self,
        *queues: str,
        concurrency: int = 2,
        events: bool = False,
        prefetch: int | None = None,
        **env: str,
    ) -> Proc:
        args: tuple[str, ...] = ("-Q", ",".join(queues)) if queues else ()
        if prefetch is not None:
            args += ("--prefetch-multiplier", str(prefetch))
        return self.procs.worker(concurrency=concurrency, events=events, args=args, env=env)

    def relay_only(self, **env: str) -> Proc:
        """A worker of the relay's queue alone (the tasks wait in theirs),
        whose claims send five rows of a following task at once: they keep
        twice what it takes ahead queued, 2 x 2 x 3 = 12 (docs/durable.md)."""
        return self.worker(self.relay_queue, prefetch=3, **env)

    def beat(self) -> Proc:
        return self.procs.beat()

    def capped_beat(self, *, batch: int, interval: float = 60, **env: str) -> dict[str, str]:
        """Beat for a relay that claims ``batch`` rows at a time under an
        in-flight cap of as many, ticking every ``interval`` seconds; the
        settings are returned for its workers to start with."""
        settings = {
            "OUTBOX_CLAIM_INTERVAL_SECONDS": str(interval),
            "OUTBOX_BATCH_SIZE": str(batch),
            "OUTBOX_MAX_IN_FLIGHT": str(batch),
            **env,
        }
        self.procs.beat(env=settings)
        return settings

    def drain_worker(
        self,
        *,
        batch: int,
        concurrency: int,
        events: bool = False,
        args: tuple[str, ...] = (),
        **env: str,
    ) -> Proc:
        """A worker of the app and the relay under ``capped_beat`` (beat's
        tick a minute away), once its listener is up: a commit's NOTIFY then
        starts the drain, and the claims that follow it carry it on."""
        settings = self.capped_beat(batch=batch, **env)
        worker = self.procs.worker(concurrency=concurrency, events=events, args=args, env=settings)
        time.sleep(3)
        return worker

    def logs(self) -> str:
        return self.procs.logs()


@pytest.fixture
def setup(app_dsn: str, tmp_path: Path) -> Iterator[Any]:
    made: list[Setup] = []

    def factory(broker: str | None = None) -> Setup:
        s = Setup(app_dsn, broker or services.redis_url(), tmp_path)
        made.append(s)
        return s

    yield factory
    for s in made:
        s.procs.stop_all()


def _rows(dsn: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def _write(dsn: str, sig: Any, **options: Any) -> Any:
    """A business transaction that writes one durable task call."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        return write_durable(conn, None, sig, options)


def _row(dsn: str, task_id: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT id, status, attempts, lease_version, available_at, last_error, created_at,"
            " done_at, now() AS now FROM outbox WHERE payload->>'id' = %s",
            (task_id,),
        )
        names = [d.name for d in cur.description or []]
        found = cur.fetchone()
    assert found is not None, f"no outbox row for task {task_id}"
    return dict(zip(names, found))


def _all_done(dsn: str, task_ids: list[str]) -> bool:
    return all(_row(dsn, t)["status"] == "done" for t in task_ids)


def _runs(dsn: str, key: str) -> list[tuple[Any, ...]]:
    return _rows(dsn, "SELECT task_id, pid, at FROM runs WHERE key = %s ORDER BY at", (key,))


def _effects(dsn: str, key: str) -> list[tuple[Any, ...]]:
    return _rows(dsn, "SELECT task_id, value FROM effects WHERE key = %s", (key,))


def _assert_once_each(dsn: str, results: dict[str, Any]) -> None:
    """Every task done, one effect each, and only ever its fixed task id."""
    for key, result in results.items():
        assert [e[0] for e in _effects(dsn, key)] == [result.id], key
        assert {r[0] for r in _runs(dsn, key)} == {result.id}, key


# --------------------------------------------------------------- producing
def test_write_durable_fixes_the_task_id_and_writes_one_row(dsn, conn) -> None:
    result = _write(dsn, effect.s("k1").set(queue="billing"), countdown=30)
    [(event_type, payload, headers, wait)] = conn.execute(
        "SELECT event_type, payload, headers, available_at - now() FROM outbox"
    ).fetchall()
    assert event_type == "celery.durable"
    assert payload["id"] == result.id and payload["task"] == "durable.effect"
    assert payload["args"] == ["k1"] and payload["kwargs"] == {}
    assert payload["options"] == {"queue": "billing"}
    assert payload["track"] is True
    # Its lease and its attempt limit (Celery's default max_retries=3, plus one).
    assert headers == {"lease_seconds": durable_app.LEASE, "max_attempts": 4}
    assert timedelta(seconds=25) < wait <= timedelta(seconds=30)
    # The convenience on the task writes the same kind of row.
    again = effect.enqueue(conn, "k2", sleep=1.5)
    assert again.id != result.id
    rows = conn.execute("SELECT payload->'kwargs' FROM outbox ORDER BY id").fetchall()
    assert rows[1][0] == {"sleep": 1.5}


def test_apply_async_and_its_asyncio_form_write_a_durable_row(dsn, conn) -> None:
    import asyncio

    from celery import chain

    from outbox_relay import aio

    with psycopg.connect(dsn) as sync_conn, sync_conn.transaction():
        one = outbox_relay.apply_async(sync_conn, effect.s("k1"))
        two = outbox_relay.apply_async(sync_conn, chain(effect.s("k2"), effect.s("k3")))

    async def write() -> Any:
        async with await psycopg.AsyncConnection.connect(dsn) as aconn, aconn.transaction():
            return await aio.apply_async(aconn, effect.s("k4"))

    three = asyncio.run(write())
    rows = conn.execute(
        "SELECT event_type, payload->>'id', jsonb_array_length(payload->'chain'), ordered "
        "FROM outbox ORDER BY id"
    ).fetchall()
    # One tracked row each; a chain's later steps ride in its first row.
    assert rows == [
        ("celery.durable", one.id, 0, False),
        ("celery.durable", two.parent.id, 1, False),
        ("celery.durable", three.id, 0, False),
    ]


def test_write_durable_refuses_what_it_cannot_run(dsn, conn) -> None:
    with pytest.raises(InvalidMessage, match=r"no task named 'durable\.efect'.*did you mean"):
        _write(dsn, effect.app.signature("durable.efect", args=("k",)))
    with pytest.raises(InvalidMessage, match="not a DurableTask"):
        _write(dsn, plain.s("x", "k"))
    with pytest.raises(InvalidMessage, match="args must be JSON-serializable"):
        _write(dsn, effect.s(object()))
    with pytest.raises(InvalidMessage, match=r"'link' is not supported.*chain"):
        _write(dsn, effect.s("k"), link=effect.s("j"))
    with (
        pytest.raises(InvalidMessage, match="reserved for durable Celery tasks"),
        conn.transaction(),
    ):
        outbox_relay.enqueue(
            conn, aggregate_type="a", aggregate_id="1", event_type="celery.durable", payload={}
        )
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)


def test_apply_async_refuses_a_durable_task_where_it_would_run_untracked(conn) -> None:
    """Inside a group, a chord, a callback or after a plain chain step, a
    durable task would go out as part of a plain canvas and fail on its first
    use of outbox_conn; apply_async refuses it while the transaction can
    still roll back (write_durable refused the chain case already)."""
    from celery import chain, chord, group

    untracked = [
        group(effect.s("a"), effect.s("b")),
        chain(plain.s("x", "k"), effect.s("k")),
        chord([effect.s("h")], plain.s("x")),
        plain.s("x", "k").set(link=effect.s("j")),
    ]
    for sig in untracked:
        with (
            pytest.raises(InvalidMessage, match=r"durable\.effect is a DurableTask inside"),
            conn.transaction(),
        ):
            outbox_relay.apply_async(conn, sig)
    with (
        pytest.raises(InvalidMessage, match=r"durable\.effect is a DurableTask inside"),
        conn.transaction(),
    ):
        outbox_relay.apply_async(conn, plain.s("x", "k"), link_error=effect.s("j"))
    # A chain that does begin with its durable step but goes on with a group
    # or a chord: the refusal says so, and where such a fan-out is written.
    for sig, kind in [
        (chain(effect.s("c"), group(plain.s("x"), plain.s("y"))), "group"),
        (chain(effect.s("c"), chord([plain.s("x"), plain.s("y")], plain.s("z"))), "chord"),
        (chain(effect.s("c"), group(plain.s("x"), plain.s("y")) | plain.s("z")), "chord"),
    ]:
        with (
            pytest.raises(
                InvalidMessage,
                match=rf"begins with the DurableTask durable\.effect and goes on with a {kind}; "
                r".*apply_async\(self\.outbox_conn",
            ),
            conn.transaction(),
        ):
            outbox_relay.apply_async(conn, sig)
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)


def test_the_plain_loop_never_publishes_a_durable_row(dsn, conn) -> None:
    result = _write(dsn, effect.s("loop"))
    published: list[Any] = []
    assert outbox_relay.dispatch_once(conn, published.append, owner="loop") == 1
    assert published == []
    row = _row(dsn, result.id)
    assert row["status"] == "dead"
    assert "only the Celery relay (outbox_relay.install) runs it" in row["last_error"]


def test_a_bad_lease_setting_fails_where_the_task_is_defined() -> None:
    app = Celery("lease-check", set_as_current=False)

    def body() -> None:
        """Never runs."""

    # shared=False: Celery would otherwise add it to every app made later.
    task = app.task(name="bad_lease", base=DurableTask, outbox_lease_seconds=-1, shared=False)(body)
    with pytest.raises(ConfigError, match="bad_lease: outbox_lease_seconds must be a positive"):
        task.name  # noqa: B018  # Celery defines the task on first use


def test_a_direct_call_runs_the_body_untracked() -> None:
    app = Celery("direct", set_as_current=False)

    @app.task(base=DurableTask, bind=True, name="direct.add", shared=False)
    def add(self: Any, a: int, b: int) -> int:
        return a + b

    @app.task(base=DurableTask, bind=True, name="direct.conn", shared=False)
    def conn_of(self: Any) -> Any:
        return self.outbox_conn

    assert add(1, 2) == 3
    with pytest.raises(OutboxError, match="only while a durable task runs as sent by the relay"):
        conn_of()


# --------------------------------------------------------------- crashes
@pytest.mark.parametrize("ack_emulation", ["true", "false"])
def test_a_worker_killed_mid_body_loses_no_task(setup, ack_emulation: str) -> None:
    # With kombu's emulated acks off, the two messages the worker had
    # prefetched die with it too: the outbox alone sends them again.
    s = setup()
    s.beat()
    # Every body it runs sleeps.
    w1 = s.worker(DURABLE_SLOW="60", DURABLE_ACK_EMULATION=ack_emulation)
    results = {f"kill-{i}": _write(s.dsn, effect.s(f"kill-{i}")) for i in range(4)}
    wait_for(
        lambda: len(_rows(s.dsn, "SELECT 1 FROM runs")) >= 2,
        timeout=60,
        what=lambda: f"two bodies running\n{s.logs()}",
    )
    w1.kill(signal.SIGKILL)  # the worker and its pool, mid-body
    w1.popen.wait(10)
    s.worker()
    ids = [r.id for r in results.values()]
    wait_for(lambda: _all_done(s.dsn, ids), timeout=120, what=lambda: f"all done\n{s.logs()}")
    _assert_once_each(s.dsn, results)
    assert any(len(_runs(s.dsn, key)) >= 2 for key in results)  # a killed run was re-run


def test_a_broker_that_forgets_its_queue_loses_no_task(setup, owned_redis) -> None:
    s = setup(owned_redis.url)
    s.beat()
    s.relay_only()
    results = {f"flush-{i}": _write(s.dsn, effect.s(f"flush-{i}")) for i in range(5)}
    client = owned_redis.client()
    wait_for(lambda: client.llen(s.queue) == 5, timeout=60, what=lambda: f"5 queued\n{s.logs()}")
    client.flushall()
    s.worker(s.queue)
    ids = [r.id for r in results.values()]
    wait_for(lambda: _all_done(s.dsn, ids), timeout=120, what=lambda: f"all done\n{s.logs()}")
    _assert_once_each(s.dsn, results)


def test_the_relay_declares_a_queue_no_worker_consumes_yet_over_rabbitmq(setup) -> None:
    # RabbitMQ drops a message routed to a queue that does not exist: the
    # relay declares each durable task's queue (once per round) before it
    # sends there, even when no worker has declared it by consuming it.
    from kombu import Connection

    amqp = services.amqp_url()
    if amqp is None:
        pytest.skip("RabbitMQ not configured: set OUTBOX_TEST_AMQP_URL")
    s = setup(amqp)
    try:
        s.beat()
        s.relay_only()  # nobody consumes the tasks' queue yet
        results = {f"amqp-{i}": _write(s.dsn, effect.s(f"amqp-{i}")) for i in range(5)}

        def waiting() -> int:
            with Connection(amqp, connect_timeout=5) as conn:
                try:
                    return int(conn.default_channel.queue_declare(s.queue, passive=True)[1])
                except Exception:  # not declared (yet)
                    return 0

        wait_for(lambda: waiting() == 5, timeout=60, what=lambda: f"5 queued\n{s.logs()}")
        s.worker(s.queue)
        ids = [r.id for r in results.values()]
        wait_for(lambda: _all_done(s.dsn, ids), timeout=120, what=lambda: f"all done\n{s.logs()}")
        _assert_once_each(s.dsn, results)
    finally:
        s.procs.stop_all()
        with Connection(amqp, connect_timeout=5) as conn:
            for name in (s.queue, s.relay_queue):
                with contextlib.suppress(Exception):
                    conn.default_channel.queue_delete(name)


def test_a_backlog_of_many_batches_drains_without_waiting_for_beat(setup) -> None:
    """A claim of durable rows only that came back full claims again at once.

    Before, such a round left the next claim to its runs' claim hints (one
    per process every half second at most): once a round's runs all
    finished within one half second, nothing claimed until beat's next
    tick. Beat ticks once a minute here; 300 rows in batches of 20 must not
    wait for it. The in-flight cap of one batch keeps the queue shorter than
    the messages' expiry (these tasks' lease is a few seconds) on a busy host.
    """
    s = setup()
    s.drain_worker(batch=20, concurrency=2)
    with psycopg.connect(s.dsn) as conn, conn.transaction():
        results = {f"b-{i}": write_durable(conn, None, effect.s(f"b-{i}"), {}) for i in range(300)}
    ids = [r.id for r in results.values()]
    # Drained by claims and their follow-ups alone: well inside beat's minute.
    wait_for(lambda: _all_done(s.dsn, ids), timeout=40, what=lambda: f"all done\n{s.logs()}")
    _assert_once_each(s.dsn, results)


def test_a_backlog_that_expired_is_sent_again_and_runs(setup) -> None:
    """Celery puts the id of an expired message on the worker's revoked list;
    the same id sent again under a new lease must still run."""
    s = setup()
    s.beat()
    s.worker(s.relay_queue)
    results = {f"late-{i}": _write(s.dsn, effect.s(f"late-{i}")) for i in range(2)}
    wait_for(
        lambda: all(_row(s.dsn, r.id)["lease_version"] >= 1 for r in results.values()),
        timeout=30,
        what="claimed and sent",
    )
    # The leases their first messages were sent under (read after the claim:
    # read at the write, they could already be the claim's, as in a CI run of
    # 2026-12-05 where the NOTIFY's claim came first).
    versions = {k: _row(s.dsn, r.id)["lease_version"] for k, r in results.items()}
    time.sleep(LEASE)  # past the messages' expiry (lease minus the begin margin)
    consumer = s.worker(s.queue)
    ids = [r.id for r in results.values()]
    wait_for(lambda: _all_done(s.dsn, ids), timeout=90, what=lambda: f"all done\n{s.logs()}")
    _assert_once_each(s.dsn, results)
    # The row is done before the worker logs the task's success.
    wait_for(
        lambda: all(
            f"durable.effect[{r.id}] succeeded" in consumer.text() for r in results.values()
        ),
        timeout=10,
        what="the success lines",
    )
    log = consumer.text()
    for result in results.values():
        # The expired message was dropped, not run late; the one sent under
        # the next lease, with the same id, ran on the same worker.
        dropped = log.find(f"Discarding revoked task: durable.effect[{result.id}]")
        ran = log.find(f"durable.effect[{result.id}] succeeded")
        assert 0 <= dropped < ran, log
    assert all(_row(s.dsn, r.id)["lease_version"] > versions[k] for k, r in results.items())


# -------------------------------------------------------------- failures
def test_failures_follow_the_tasks_own_retry_options(setup) -> None:
    s = setup()
    # Beat's tick far away: a retry runs when due, not at the next tick.
    s.procs.env["OUTBOX_CLAIM_INTERVAL_SECONDS"] = "30"
    s.beat()
    worker = s.worker()
    retried = _write(s.dsn, flaky.s("flaky", 2))
    exhausted = _write(s.dsn, exhaust.s("exhaust"))
    broken = _write(s.dsn, boom.s("boom"))

    # After the first failure: pending again, due after retry_backoff x 2^1 s.
    def first_failure() -> dict[str, Any] | None:
        row = _row(s.dsn, retried.id)
        return row if row["status"] == "pending" and row["attempts"] == 1 else None

    row = wait_for(
        first_failure, timeout=60, interval=0.05, what=lambda: f"rescheduled\n{s.logs()}"
    )
    assert "Flaky: run of flaky fails" in row["last_error"]
    assert timedelta(0) < row["available_at"] - row["now"] <= timedelta(seconds=2)

    ids = [retried.id, exhausted.id, broken.id]
    wait_for(
        lambda: all(_row(s.dsn, t)["status"] in ("done", "dead") for t in ids),
        timeout=90,
        what=lambda: f"finished\n{s.logs()}",
    )
    done = _row(s.dsn, retried.id)
    assert (done["status"], done["attempts"]) == ("done", 3)
    at = [r[2] for r in _runs(s.dsn, "flaky")]
    assert len(at) == 3
    # No jitter, retry_backoff=1 on Celery's schedule: 1 s after the first
    # failure, 2 s after the second (database time).
    assert 1.0 <= (at[1] - at[0]).total_seconds() < 4.0, at
    assert 2.0 <= (at[2] - at[1]).total_seconds() < 5.0, at
    assert [e[0] for e in _effects(s.dsn, "flaky")] == [retried.id]

    dead = _row(s.dsn, exhausted.id)
    assert (dead["status"], dead["attempts"]) == ("dead", 2)  # max_retries=1
    assert "retries exhausted after 2 attempts" in dead["last_error"]
    assert _effects(s.dsn, "exhaust") == []  # each failed run's effect rolled back

    dead = _row(s.dsn, broken.id)
    assert (dead["status"], dead["attempts"]) == ("dead", 1)
    assert "not in autoretry_for: ValueError: boom is broken" in dead["last_error"]
    assert len(_runs(s.dsn, "boom")) == 1
    # Monitoring sees failures: Celery's FAILURE line and the relay's ERROR
    # line (logged after the row is written: wait for them).
    lines = [
        f"outbox message {dead['id']} v1 (celery.durable) is dead",
        f"durable.boom[{broken.id}] raised unexpected: ValueError",
        f"durable.flaky[{retried.id}] retry: rescheduled in the database, due in 1.0s",
        f"durable.flaky[{retried.id}] retry: rescheduled in the database, due in 2.0s",
    ]
    wait_for(lambda: all(x in worker.text() for x in lines), timeout=10, what="log lines")


def test_a_body_that_kills_its_worker_ends_dead_after_its_own_max_retries(setup) -> None:
    s = setup()
    s.beat()
    s.worker()
    result = _write(s.dsn, poison.s("poison"))  # max_retries=1: two attempts
    wait_for(
        lambda: _row(s.dsn, result.id)["status"] == "dead",
        timeout=90,
        what=lambda: f"dead\n{s.logs()}",
    )
    row = _row(s.dsn, result.id)
    assert row["attempts"] == 2
    assert "lease expired on the last attempt (2 of 2)" in row["last_error"]
    assert len(_runs(s.dsn, "poison")) == 2


# ------------------------------------------------------ duplicates, stale
def test_a_frozen_worker_past_its_lease_leaves_one_effect(setup) -> None:
    s = setup()
    s.beat()
    frozen = s.worker(concurrency=1)
    result = _write(s.dsn, effect.s("frozen", sleep=LEASE * 2))
    wait_for(lambda: _runs(s.dsn, "frozen"), timeout=60, what=lambda: f"the body runs\n{s.logs()}")
    frozen.kill(signal.SIGSTOP)  # no renewals: its lease lapses, the relay re-sends
    try:
        s.worker()
        wait_for(
            lambda: _row(s.dsn, result.id)["status"] == "done",
            timeout=90,
            what=lambda: f"done by the other worker\n{s.logs()}",
        )
    finally:
        frozen.kill(signal.SIGCONT)
    wait_for(
        lambda: "effect was rolled back" in frozen.text() or "failed, but outbox" in frozen.text(),
        timeout=60,
        what=f"the stale run ends\n{frozen.text()[-3000:]}",
    )
    runs = _runs(s.dsn, "frozen")
    assert len(runs) == 2 and {r[0] for r in runs} == {result.id}
    assert [e[0] for e in _effects(s.dsn, "frozen")] == [result.id]
    assert _row(s.dsn, result.id)["status"] == "done"


def test_a_stale_message_skips_the_body(setup) -> None:
    s = setup()
    s.beat()
    worker = s.worker()
    result = _write(s.dsn, effect.s("stale"))
    wait_for(lambda: _row(s.dsn, result.id)["status"] == "done", timeout=60, what=s.logs())
    row = _row(s.dsn, result.id)
    # The broker delivers an old message again (same id, the lease it was sent under).
    client = durable_app.app.__class__("client", broker=s.broker, set_as_current=False)
    client.conf.update(task_serializer="json", accept_content=["json"])
    client.send_task(
        "durable.effect",
        args=["stale"],
        task_id=result.id,
        queue=s.queue,
        headers={
            "outbox-durable-id": row["id"],
            "outbox-durable-lease-version": row["lease_version"],
        },
    )
    wait_for(lambda: "is no longer processing under this lease" in worker.text(), timeout=30)
    assert len(_runs(s.dsn, "stale")) == 1  # the body did not run again
    assert [e[0] for e in _effects(s.dsn, "stale")] == [result.id]


def test_the_relay_sends_the_task_where_its_own_options_route_it(setup) -> None:
    s = setup()
    s.beat()
    custom = f"dc-{uuid.uuid4().hex[:8]}"
    s.worker(s.relay_queue, custom)  # not the app's default queue
    result = _write(s.dsn, effect.s("routed"), queue=custom)
    wait_for(lambda: _row(s.dsn, result.id)["status"] == "done", timeout=60, what=s.logs())
    assert [e[0] for e in _effects(s.dsn, "routed")] == [result.id]


def test_flower_sees_the_row_never_the_arguments(setup) -> None:
    s = setup()
    s.beat()
    s.worker(events=True)  # -E: task events, as Flower reads them
    with EventTap(_client(s.broker)) as tap:
        result = _write(s.dsn, effect.s("card-4242-4242", sleep=0.1))
        received = wait_for(
            lambda: [e for e in tap.of_type("task-received") if e.get("uuid") == result.id],
            timeout=60,
            what=lambda: f"task-received\n{s.logs()}",
        )
    row = _row(s.dsn, result.id)
    assert received[0]["name"] == "durable.effect"
    assert received[0]["args"] == f"(outbox #{row['id']} v1)"
    assert received[0]["kwargs"] == "{'sleep': ...}"
    # Arguments never show; a return value does, as Celery shows any task's.
    shown = [{k: v for k, v in e.items() if k != "result"} for e in tap.events]
    assert "card-4242" not in repr(shown)


# ----------------------------------------------------------------- chains
def test_a_chain_runs_each_step_after_the_previous_committed(setup) -> None:
    s = setup()
    s.beat()
    s.worker()
    both = _write(s.dsn, chain(first.s("chain"), second.s("chain")))
    handoff = _write(s.dsn, chain(first.s("tail"), plain.s("tail")))
    first_id, second_id = both.parent.id, both.id
    wait_for(
        lambda: len(_effects(s.dsn, "chain")) == 2 and len(_effects(s.dsn, "tail")) == 2,
        timeout=90,
        what=lambda: f"both chains ran\n{s.logs()}",
    )
    wait_for(lambda: _all_done(s.dsn, [first_id, second_id, handoff.id]), timeout=30)
    effects = dict((value, task_id) for task_id, value in _effects(s.dsn, "chain"))
    # The second step saw the first one's effect committed, and got its result.
    assert effects == {"first": first_id, "second after 1 first; got chain:from-first": second_id}
    runs = _runs(s.dsn, "chain")
    assert [r[0] for r in runs] == [first_id, second_id]
    # Written in the transaction of the first step's done (now() is that
    # transaction's start: the two are equal).
    assert _row(s.dsn, second_id)["created_at"] == _row(s.dsn, first_id)["done_at"]
    # A plain last step is handed to Celery by the relay, with its fixed id.
    tail = {value: task_id for task_id, value in _effects(s.dsn, "tail")}
    assert tail["plain got tail:from-first"] == handoff.id


def test_a_chain_on_the_relays_own_grants_ends_dead_naming_the_grant(
    setup, app_dsn: str, tmp_path: Path
) -> None:
    """A worker that runs durable tasks writes a chain's next step, and the
    relay kind's grants have no INSERT: found by a new user running the
    docs' chain under the documented relay role. The worker warns at start;
    the step ends dead, its effect rolled back, its last_error naming the
    grant and the command that sends it back; with the producer's grants
    added, ``dead retry`` runs the chain to its end."""
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    from outbox_relay import operations

    role = f"outbox_durable_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    with psycopg.connect(app_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
        admin.execute(operations.grants(role, "relay"))
        # The bodies' own tables: the application's to grant.
        admin.execute(sql.SQL("GRANT SELECT, INSERT ON runs, effects TO {}").format(ident))
    s = Setup(make_conninfo(app_dsn, user=role), services.redis_url(), tmp_path)
    try:
        s.beat()
        worker = s.worker()
        assert "may not insert into public.outbox" in worker.text(), worker.text()[-3000:]
        assert f"outbox-relay grant --role {role} --kind producer" in worker.text()
        both = _write(app_dsn, chain(first.s("grants"), second.s("grants")))
        first_id = both.parent.id
        wait_for(
            lambda: _row(app_dsn, first_id)["status"] == "dead",
            timeout=60,
            what=lambda: f"the first step dead\n{s.logs()[-3000:]}",
        )
        dead = _row(app_dsn, first_id)
        assert "permission denied for table outbox" in dead["last_error"], dead
        assert f"outbox-relay grant --role {role} --kind producer" in dead["last_error"]
        assert f"outbox-relay dead retry {dead['id']}" in dead["last_error"]
        assert _effects(app_dsn, "grants") == []  # rolled back with the done
        with psycopg.connect(app_dsn, autocommit=True) as admin:
            admin.execute(operations.grants(role, "producer"))
        # The command as the message gives it, run as a person would.
        result = subprocess.run(
            [str(Path(sys.executable).parent / "outbox-relay"), "dead", "retry", str(dead["id"])],
            env={**os.environ, "OUTBOX_DSN": app_dsn},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        wait_for(
            lambda: len(_effects(app_dsn, "grants")) == 2,
            timeout=60,
            what=lambda: f"the chain ran to its end\n{s.logs()[-3000:]}",
        )
        wait_for(lambda: _all_done(app_dsn, [first_id, both.id]), timeout=30)
    finally:
        s.procs.stop_all()
        with psycopg.connect(app_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(ident))
            admin.execute(sql.SQL("DROP ROLE {}").format(ident))


# -------------------------------------------------------------- following
def _done_and_take(conn: psycopg.Connection[Any], ref: LeaseRef) -> tuple[bool, LeaseRef | None]:
    done, began = store.done_and_take_durable(
        conn,
        ref,
        task="durable.effect",
        owner="w",
        lease=timedelta(seconds=30),
        options=plain_options(effect),
        max_attempts=12,
    )
    if began is None:
        return done, None
    # Leased as a claim leases it (the task's own lease), begun, with the
    # whole payload (the run reads its arguments from it).
    assert began.started and durable_app.LEASE - 1 < began.lease_left_seconds <= durable_app.LEASE
    assert began.claimed.payload["task"] == "durable.effect"
    return done, began.claimed.ref


def test_a_done_takes_only_its_tasks_next_plain_row(dsn, conn) -> None:
    """What a finished run may take to run next in its process, with its
    done: a due row of its own task, sent as a plain call would be."""
    _write(dsn, effect.s("previous"))
    [claimed] = store.claim_batch(
        conn, owner="w", batch=1, lease=timedelta(seconds=30), content=False
    ).claimed
    ids = {}
    for key, sig, options in [
        ("other-task", flaky.s("x", 0), {}),
        ("routed", effect.s("r"), {"queue": "elsewhere"}),
        ("later", effect.s("l"), {"countdown": 60}),
        ("interrupted", effect.s("i"), {}),
        ("plain-1", effect.s("p1"), {}),
        ("plain-2", effect.s("p2"), {}),
    ]:
        _write(dsn, sig, **options)
        ids[key] = conn.execute("SELECT max(id) FROM outbox").fetchone()[0]
    # A run began under the row's last lease and never finished: it is
    # delivered alone, as the claim would.
    conn.execute(
        "UPDATE outbox SET lease_version = 1, began_version = 1 WHERE id = %s",
        (ids["interrupted"],),
    )
    # A stale run (another lease version) writes nothing and takes nothing.
    assert _done_and_take(conn, LeaseRef(claimed.id, claimed.lease_version + 1)) == (False, None)
    done, first = _done_and_take(conn, claimed.ref)
    assert done and first == LeaseRef(ids["plain-1"], 1)
    done, second = _done_and_take(conn, first)
    assert done and second == LeaseRef(ids["plain-2"], 1)
    assert _done_and_take(conn, second) == (True, None)
    rows = {
        r[0]: tuple(r[1:])
        for r in conn.execute(
            "SELECT id, status, attempts, lease_version, began_version IS NOT DISTINCT FROM"
            " lease_version FROM outbox"
        ).fetchall()
    }
    assert rows[claimed.id][0] == "done"
    assert rows[ids["plain-1"]] == ("done", 1, 1, True)  # leased, counted, begun, done
    for key in ("other-task", "routed", "later"):
        assert rows[ids[key]] == ("pending", 0, 0, False), key
    assert rows[ids["interrupted"]][0] == "pending"
    # A row out of attempts goes dead, as a claim would send it; none is taken.
    _write(dsn, effect.s("spent"))
    conn.execute("UPDATE outbox SET attempts = 4 WHERE payload->'args' = '[\"spent\"]'")
    _write(dsn, effect.s("last"))
    [last] = store.claim_batch(
        conn, owner="w", batch=1, lease=timedelta(seconds=30), content=False
    ).claimed
    assert _done_and_take(conn, last.ref) == (True, None)
    [(status, error)] = conn.execute(
        "SELECT status, last_error FROM outbox WHERE payload->'args' = '[\"spent\"]'"
    ).fetchall()
    assert status == "dead" and "retries exhausted" in error


def _hold_claim(conn: psycopg.Connection[Any], **options: Any) -> set[str]:
    """A claim of the Celery relay's kind that leaves following rows while
    two such messages are queued; the keys of the rows it leased."""
    claimed = store.claim_batch(
        conn,
        owner="w",
        batch=100,
        lease=timedelta(seconds=30),
        content=False,
        max_in_flight=100,
        park=True,
        **{"follow_queue": 2, "hold": timedelta(seconds=60), **options},
    ).claimed
    return {c.payload["args"][0] for c in claimed}


def test_a_claim_leaves_a_following_tasks_rows_for_its_runs_while_its_queue_is_long(
    dsn, conn
) -> None:
    """A backlog within the in-flight cap is not sent whole by message: the
    claim sends a following task's rows until its queue holds a few, and
    leaves the rest for the runs to take as they end (or for a later claim,
    once the queue is short or the rows waited the hold out)."""
    for i in range(6):
        _write(dsn, effect.s(f"e{i}"))
    _write(dsn, timed.s("timed"))  # a time limit: its runs never take rows
    _write(dsn, effect.s("routed"), queue="elsewhere")  # not a plain call's options
    marked = dict(
        conn.execute(
            "SELECT payload->'args'->>0, headers ? 'follows' FROM outbox ORDER BY id"
        ).fetchall()
    )
    assert marked == {**{f"e{i}": True for i in range(6)}, "timed": False, "routed": False}
    # Two sent (the queue it keeps), every row no run would take sent too.
    assert _hold_claim(conn) == {"e0", "e1", "timed", "routed"}
    assert _hold_claim(conn) == set()  # its two messages are still queued
    # One of them began: one more goes, to keep two queued.
    [e0] = conn.execute(
        "SELECT id, lease_version FROM outbox WHERE payload->'args'->>0 = 'e0'"
    ).fetchall()
    assert store.begin(conn, [LeaseRef(*e0)], needed=timedelta(seconds=1))
    assert _hold_claim(conn) == {"e2"}
    # A run's done takes a row the claim left, as it would any due row.
    done, taken = _done_and_take(conn, LeaseRef(*e0))
    assert done and taken is not None
    assert conn.execute(
        "SELECT payload->'args'->>0 FROM outbox WHERE id = %s", (taken.id,)
    ).fetchone() == ("e3",)
    assert _hold_claim(conn) == set()
    # Rows that waited the hold out go, whatever the queue.
    assert _hold_claim(conn, hold=timedelta(0)) == {"e4", "e5"}


def test_a_claim_without_follow_queue_sends_every_row(dsn, conn) -> None:
    for i in range(4):
        _write(dsn, effect.s(f"e{i}"))
    assert _hold_claim(conn, follow_queue=None) == {f"e{i}" for i in range(4)}


def _received(worker: Proc, task_id: str) -> bool:
    """Whether the worker's main process received a message for the task (its log line)."""
    return f"[{task_id}] received" in worker.text()


def test_a_run_goes_on_with_its_tasks_next_rows_as_the_worker_would(setup) -> None:
    """A finished run takes its task's next due row with its done and runs it
    in its process: each once, under its own task id, attempt counted, with
    the events Flower reads, and without a message of its own."""
    s = setup()
    worker = s.drain_worker(batch=1, concurrency=1, events=True)
    with EventTap(_client(s.broker)) as tap:
        with psycopg.connect(s.dsn) as conn, conn.transaction():
            results = {
                f"f-{i}": write_durable(conn, None, effect.s(f"f-{i}"), {}) for i in range(30)
            }
        ids = [r.id for r in results.values()]
        wait_for(lambda: _all_done(s.dsn, ids), timeout=60, what=lambda: f"all done\n{s.logs()}")
        wait_for(
            lambda: {e["uuid"] for e in tap.of_type("task-succeeded")} >= set(ids),
            timeout=30,
            what=lambda: f"a task-succeeded event for each\n{tap.events[-5:]}",
        )
    _assert_once_each(s.dsn, results)  # each body once, under its own task id
    assert all(_row(s.dsn, t)["attempts"] == 1 for t in ids)
    assert any(_received(worker, t) for t in ids)  # the log line looked for
    inline = [t for t in ids if not _received(worker, t)]
    assert inline, f"every row came by its own message\n{worker.text()[-3000:]}"
    for t in inline:
        # The worker's log line for it, as for any task it runs.
        assert f"Task durable.effect[{t}] succeeded in" in worker.text()
        row = _row(s.dsn, t)
        [received] = [e for e in tap.of_type("task-received") if e["uuid"] == t]
        assert received["name"] == "durable.effect"
        assert received["args"] == f"(outbox #{row['id']} v{row['lease_version']})"
        assert any(e["uuid"] == t for e in tap.of_type("task-started")), [
            e for e in tap.events if e.get("uuid") == t
        ]
    assert "Traceback" not in worker.text()


def test_a_row_run_after_another_that_fails_is_retried_with_its_traceback_in_flower(
    setup,
) -> None:
    """A row taken to run after another fails: rescheduled in the database
    as any run's failure is, and Flower gets its task-retried event with the
    exception and the traceback the worker logged."""
    s = setup()
    worker = s.drain_worker(batch=1, concurrency=1, events=True)
    with EventTap(_client(s.broker)) as tap:
        with psycopg.connect(s.dsn) as conn, conn.transaction():
            ok = write_durable(conn, None, flaky.s("ok", 0), {})
            bad = write_durable(conn, None, flaky.s("bad", 1), {})
        wait_for(
            lambda: _all_done(s.dsn, [ok.id, bad.id]),
            timeout=60,
            what=lambda: f"both done\n{s.logs()}",
        )
        wait_for(
            lambda: any(e["uuid"] == bad.id for e in tap.of_type("task-retried")),
            timeout=30,
            what=lambda: f"a task-retried event\n{tap.events[-5:]}",
        )
    # Two runs of "bad", one message: its first run came after "ok"'s.
    assert _row(s.dsn, bad.id)["attempts"] == 2
    assert worker.text().count(f"[{bad.id}] received") == 1, worker.text()[-3000:]
    [retried] = [e for e in tap.of_type("task-retried") if e["uuid"] == bad.id]
    assert "Flaky" in retried["exception"], retried
    assert "Traceback" in retried["traceback"] and "run of bad fails" in retried["traceback"]


def test_a_backlog_within_the_cap_is_mostly_run_by_following(setup) -> None:
    """A burst far inside the in-flight cap: the claim sends a few of its
    messages (enough to start the pool), and the runs take the rest as they
    end, instead of one message a row. Every row once, attempt 1."""
    s = setup()
    worker = s.drain_worker(batch=500, concurrency=2)
    with psycopg.connect(s.dsn) as conn, conn.transaction():
        results = {f"c-{i}": write_durable(conn, None, effect.s(f"c-{i}"), {}) for i in range(120)}
    ids = [r.id for r in results.values()]
    wait_for(lambda: _all_done(s.dsn, ids), timeout=60, what=lambda: f"all done\n{s.logs()}")
    _assert_once_each(s.dsn, results)
    assert all(_row(s.dsn, t)["attempts"] == 1 for t in ids)
    by_message = [t for t in ids if _received(worker, t)]
    # The claim keeps 2 x (2 processes x prefetch 1) queued; before, all 120.
    assert 0 < len(by_message) <= 40, (len(by_message), worker.text()[-3000:])


def test_rows_left_for_runs_that_never_take_them_go_after_the_hold(setup) -> None:
    """A worker whose runs do not follow (a time limit set on its command
    line, which the producer's app does not know) while the claims leave
    rows for them: each row waits at most the hold (a quarter of the
    relay's lease: 13 s / 4) before a claim sends it, and the worker says why.
    Beat ticks once a minute: the claims are the runs' hints and the wake-up
    sent for the hold's end."""
    s = setup()
    worker = s.drain_worker(
        batch=500, concurrency=1, args=("--time-limit", "60"), OUTBOX_LEASE_SECONDS="13"
    )
    with psycopg.connect(s.dsn) as conn, conn.transaction():
        results = {f"h-{i}": write_durable(conn, None, effect.s(f"h-{i}"), {}) for i in range(40)}
    ids = [r.id for r in results.values()]
    wait_for(lambda: _all_done(s.dsn, ids), timeout=30, what=lambda: f"all done\n{s.logs()}")
    _assert_once_each(s.dsn, results)
    assert all(_received(worker, t) for t in ids)  # none run by following
    [waited] = _rows(
        s.dsn,
        "SELECT max(extract(epoch FROM e.at - o.created_at)) FROM outbox o"
        " JOIN runs e ON e.task_id = o.payload->>'id'",
    )
    assert waited[0] < 14, waited  # the hold (3.25 s), a claim and the run, on a busy host
    assert worker.text().count("but this worker's runs do not") == 1, worker.text()[-3000:]


def test_a_worker_killed_in_a_row_it_took_loses_no_task_and_counts_the_attempt(setup) -> None:
    """A row taken with the done before it was begun in that commit: a worker
    killed in its body counts that attempt, and the row runs again, once."""
    s = setup()
    one_at_a_time = s.capped_beat(batch=1, interval=2)
    w1 = s.worker(concurrency=1, **one_at_a_time)
    time.sleep(3)  # the worker's listener is up: the commit's NOTIFY starts the drain
    with psycopg.connect(s.dsn) as conn, conn.transaction():
        results = {
            f"k-{i}": write_durable(conn, None, effect.s(f"k-{i}", sleep=60 if i == 4 else 0), {})
            for i in range(8)
        }
    slow = results["k-4"].id
    wait_for(lambda: _runs(s.dsn, "k-4"), timeout=60, what=lambda: f"k-4 runs\n{s.logs()}")
    assert not _received(w1, slow), "k-4 came by its own message"
    w1.kill(signal.SIGKILL)  # the worker and its pool, in the body of a row it took
    w1.popen.wait(10)
    s.worker(concurrency=1, **one_at_a_time)
    ids = [r.id for r in results.values()]
    wait_for(lambda: _all_done(s.dsn, ids), timeout=120, what=lambda: f"all done\n{s.logs()}")
    _assert_once_each(s.dsn, results)
    assert len(_runs(s.dsn, "k-4")) == 2
    assert _row(s.dsn, slow)["attempts"] == 2  # the killed run counted


def test_a_message_that_waited_long_in_the_queue_runs_alone(setup, owned_redis) -> None:
    """A run whose message waited a quarter of its lease or more takes no row
    after it: the messages queued behind it go first (each run that follows
    holds its process up to half a second longer, and they would expire)."""
    s = setup(owned_redis.url)
    s.beat()
    capped = {"OUTBOX_BATCH_SIZE": "5", "OUTBOX_MAX_IN_FLIGHT": "5"}
    s.relay_only(**capped)
    with psycopg.connect(s.dsn) as conn, conn.transaction():
        results = {f"w-{i}": write_durable(conn, None, patient.s(f"w-{i}"), {}) for i in range(10)}
    client = owned_redis.client()
    wait_for(lambda: client.llen(s.queue) == 5, timeout=60, what=lambda: f"5 queued\n{s.logs()}")
    time.sleep(6)  # past a quarter of the 20 s lease, short of the messages' expiry (13 s)
    worker = s.worker(s.queue, concurrency=1, **capped)
    ids = [r.id for r in results.values()]
    wait_for(lambda: _all_done(s.dsn, ids), timeout=90, what=lambda: f"all done\n{s.logs()}")
    _assert_once_each(s.dsn, results)
    # The five that waited ran alone, each from its message, before any of
    # the five behind them (a run of theirs would have run those first).
    waited = [results[f"w-{i}"].id for i in range(5)]
    assert all(_received(worker, t) for t in waited), worker.text()[-3000:]
    first = max(_runs(s.dsn, f"w-{i}")[0][2] for i in range(5))
    assert all(_runs(s.dsn, f"w-{i}")[0][2] > first for i in range(5, 10)), worker.text()[-3000:]


def test_a_row_the_router_sends_elsewhere_by_its_arguments_runs_there(setup) -> None:
    """A run takes its task's next row only where that row's message would
    have come: with a router that reads the arguments, a row routed to
    another queue is given back and runs on the worker of that queue."""
    s = setup()
    other = f"dk-{uuid.uuid4().hex[:8]}"
    env = s.capped_beat(batch=1, interval=1, DURABLE_QUEUE_BY_KEY=other)
    here = s.worker(s.relay_queue, s.queue, concurrency=1, **env)
    there = s.worker(other, concurrency=1, **env)
    time.sleep(3)  # the listener is up: the commit's NOTIFY starts the drain
    with psycopg.connect(s.dsn) as conn, conn.transaction():
        results = {
            key: write_durable(conn, None, effect.s(key), {})
            for i in range(6)
            for key in (f"a-{i}", f"b-{i}")
        }
    ids = [r.id for r in results.values()]
    wait_for(lambda: _all_done(s.dsn, ids), timeout=90, what=lambda: f"all done\n{s.logs()}")
    _assert_once_each(s.dsn, results)
    for key, result in results.items():
        ran_here = f"[{result.id}] succeeded" in here.text()
        ran_there = f"[{result.id}] succeeded" in there.text()
        assert (ran_here, ran_there) == (key.startswith("a-"), key.startswith("b-")), (
            f"{key}\n{s.logs()[-4000:]}"
        )


def test_a_timed_task_or_a_routed_row_runs_from_its_own_message(setup) -> None:
    """Not taken to run after another: a task with a time limit (it counts
    from the message, and a row run after it would have less) and a row
    sent to a queue of its own."""
    s = setup()
    s.beat()
    custom = f"dc-{uuid.uuid4().hex[:8]}"
    worker = s.worker(s.relay_queue, s.queue, custom, concurrency=1)
    with psycopg.connect(s.dsn) as conn, conn.transaction():
        results = {f"t-{i}": write_durable(conn, None, timed.s(f"t-{i}"), {}) for i in range(8)}
        results |= {
            f"q-{i}": write_durable(conn, None, effect.s(f"q-{i}"), {"queue": custom})
            for i in range(8)
        }
    ids = [r.id for r in results.values()]
    wait_for(lambda: _all_done(s.dsn, ids), timeout=90, what=lambda: f"all done\n{s.logs()}")
    _assert_once_each(s.dsn, results)
    assert all(_received(worker, t) for t in ids), worker.text()[-3000:]


# ------------------------------------------------------------------- docs
DOCS = Path(__file__).resolve().parent.parent / "docs" / "durable.md"


def test_the_docs_example_runs_as_written(dsn, tmp_path) -> None:
    """docs/durable.md's example app and commands, on this test's database and Redis."""
    text = DOCS.read_text()
    section = text[text.index("## Example") : text.index("## What the row records")]
    (tmp_path / "shop_tasks.py").write_text(section.split("```python\n")[1].split("```")[0])
    commands = section.split("```sh\n")[1].split("```")[0].strip().splitlines()
    env = {
        **os.environ,
        "OUTBOX_DSN": dsn,
        "CELERY_BROKER_URL": services.redis_url(),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    # This checkout's package (the shared virtualenv may install another).
    env["PYTHONPATH"] = str(DOCS.parent.parent)
    background: list[subprocess.Popen[bytes]] = []
    logs = tmp_path / "procs.log"
    try:
        with logs.open("wb") as log:
            for line in commands:
                if line.startswith("export "):
                    continue  # the test's own database and broker instead
                if line.endswith("&"):
                    background.append(
                        subprocess.Popen(
                            line[:-1],
                            shell=True,
                            cwd=tmp_path,
                            env=env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
                    continue
                if line.startswith("sleep "):
                    # "sleep 10; check": poll the check instead of trusting 10 s.
                    check = line.split(";", 1)[1].split("#", 1)[0].strip()

                    def shipped(check: str = check) -> bool:
                        out = subprocess.run(
                            check, shell=True, cwd=tmp_path, env=env, capture_output=True
                        )
                        return out.stdout.strip().endswith(b"shipped")

                    wait_for(shipped, timeout=60, what=f"shipped\n{logs.read_text()[-3000:]}")
                    continue
                out = subprocess.run(
                    line, shell=True, cwd=tmp_path, env=env, capture_output=True, timeout=60
                )
                assert out.returncode == 0, f"{line}: {out.stdout!r} {out.stderr!r}"
    finally:
        for proc in background:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert _rows(dsn, "SELECT status, count(*) FROM outbox GROUP BY status") == [("done", 2)]
