"""A user's Celery app with durable tasks, run as real workers by tests/test_durable.py::

    celery -A tests.apps.durable_app worker|beat

The relay is installed into this app; its tasks are ``DurableTask``s whose
rows the relay sends to them. Configured from the environment:
``DURABLE_DSN`` (the outbox, and the tables ``runs`` and ``effects`` made by
the test), ``DURABLE_BROKER_URL``, ``DURABLE_QUEUE`` (the durable tasks'
queue), ``OUTBOX_QUEUE`` (the relay's), ``DURABLE_LEASE`` (the tasks'
``outbox_lease_seconds``).

Every run records itself in ``runs`` at once (autocommit, so it survives
whatever happens to the run); the effect goes to ``effects`` through
``self.outbox_conn``, committed only with the row's ``done``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psycopg
from celery import Celery

import outbox_relay
from outbox_relay.celery import DurableTask

DSN = os.environ.get("DURABLE_DSN", "")
LEASE = float(os.environ.get("DURABLE_LEASE", "4"))

app = Celery("durable", broker=os.environ.get("DURABLE_BROKER_URL", "memory://"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_default_queue=os.environ.get("DURABLE_QUEUE", "durable"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    # The broker may be shared with other suites: answer no broadcast commands.
    worker_enable_remote_control=False,
)

if os.environ.get("DURABLE_QUEUE_BY_KEY"):
    # A router that reads the arguments: effect("b-...") goes to a queue of
    # its own (tests/test_durable.py, a routed row is never run elsewhere).
    def _by_key(
        name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
    ) -> Any:
        if name == "durable.effect" and args and str(args[0]).startswith("b-"):
            return {"queue": os.environ["DURABLE_QUEUE_BY_KEY"]}
        return None

    app.conf.task_routes = (_by_key,)

if os.environ.get("DURABLE_ACK_EMULATION") == "false":
    # A worker of their own (docs/durable.md): kombu keeps no copy of a
    # message it handed to this worker, so a SIGKILL takes the prefetched
    # ones with it and only the outbox brings them back.
    app.conf.broker_transport_options = {"ack_emulation": False}


class Flaky(Exception):
    """A failure the tasks below retry (their autoretry_for)."""


def _runs(key: str) -> int:
    """Record this run (outside the effect's transaction); return how many runs ``key`` had."""
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO runs (key, task_id, pid, at) VALUES (%s, %s, %s, clock_timestamp())",
            (key, _current_id(), os.getpid()),
        )
        row = conn.execute("SELECT count(*) FROM runs WHERE key = %s", (key,)).fetchone()
    return int(row[0]) if row else 0


def _current_id() -> str | None:
    from celery import current_task

    return current_task.request.id if current_task else None


def _effect(task: Any, key: str, value: Any = None) -> None:
    task.outbox_conn.execute(
        "INSERT INTO effects (key, task_id, value) VALUES (%s, %s, %s)",
        (key, task.request.id, None if value is None else str(value)),
    )


_DURABLE: dict[str, Any] = {"base": DurableTask, "bind": True, "outbox_lease_seconds": LEASE}


@app.task(name="durable.effect", **_DURABLE)
def effect(self: Any, key: str, sleep: float = 0.0) -> str:
    """Writes one effect, then sleeps: ``sleep`` seconds on its first run, and
    always ``DURABLE_SLOW`` seconds in a worker started with that variable."""
    first = _runs(key) == 1
    _effect(self, key)
    pause = float(os.environ.get("DURABLE_SLOW") or 0) or (sleep if first else 0.0)
    if pause:
        time.sleep(pause)
    return key


@app.task(
    name="durable.flaky",
    autoretry_for=(Flaky,),
    max_retries=3,
    retry_backoff=1,
    retry_backoff_max=60,
    retry_jitter=False,
    **_DURABLE,
)
def flaky(self: Any, key: str, fails: int) -> str:
    """Fails with Flaky on its first ``fails`` runs, then writes its effect."""
    if _runs(key) <= fails:
        raise Flaky(f"run of {key} fails (test)")
    _effect(self, key)
    return key


@app.task(name="durable.exhaust", autoretry_for=(Flaky,), max_retries=1, **_DURABLE)
def exhaust(self: Any, key: str) -> None:
    """Always fails with a retried exception: dead after max_retries + 1 attempts."""
    _runs(key)
    _effect(self, key)
    raise Flaky(f"{key} always fails (test)")


@app.task(name="durable.boom", autoretry_for=(Flaky,), **_DURABLE)
def boom(self: Any, key: str) -> None:
    """Fails with an exception not in autoretry_for: dead at once."""
    _runs(key)
    raise ValueError(f"{key} is broken (test)")


@app.task(name="durable.timed", soft_time_limit=60, **_DURABLE)
def timed(self: Any, key: str) -> str:
    """``effect`` with a soft time limit: each run comes from its own message."""
    _runs(key)
    _effect(self, key)
    return key


@app.task(name="durable.patient", base=DurableTask, bind=True, outbox_lease_seconds=20.0)
def patient(self: Any, key: str) -> str:
    """``effect`` with a lease of 20 s: its messages may wait in the queue
    for 13 s before they expire (durable_run.begin_margin)."""
    _runs(key)
    _effect(self, key)
    return key


@app.task(name="durable.poison", max_retries=1, **_DURABLE)
def poison(self: Any, key: str) -> None:
    """Kills the pool process running it, every time (an OOM kill, say)."""
    _runs(key)
    os.kill(os.getpid(), signal.SIGKILL)


@app.task(name="durable.first", **_DURABLE)
def first(self: Any, key: str) -> str:
    """The first step of a chain: its effect, then its result for the next step."""
    _runs(key)
    _effect(self, key, "first")
    time.sleep(0.5)  # the second step must wait for this commit, not race it
    return f"{key}:from-first"


@app.task(name="durable.second", **_DURABLE)
def second(self: Any, previous: str, key: str) -> None:
    """The second step: records whether the first step's effect was committed."""
    _runs(key)
    with psycopg.connect(DSN, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM effects WHERE key = %s AND value = 'first'", (key,)
        ).fetchone()
    _effect(self, key, f"second after {row[0] if row else 0} first; got {previous}")


@app.task(name="durable.plain", bind=True)
def plain(self: Any, previous: str, key: str) -> None:
    """A non-durable last step of a durable chain."""
    _runs(key)
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO effects (key, task_id, value) VALUES (%s, %s, %s)",
            (key, self.request.id, f"plain got {previous}"),
        )


class _Publisher:
    """The relay needs a publisher for plain rows; these tests write none."""

    def __call__(self, message: Any) -> None:
        raise outbox_relay.PermanentError("no plain messages in this app")


publish = _Publisher()

if DSN:
    outbox_relay.install(app, dsn=DSN, publisher="tests.apps.durable_app:publish")
