"""Shared pieces of the progress, hang, queue and packaging tests.

Not an app: plain helpers the test modules import (kept here, next to the
apps they drive, so those tests share one copy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import redis

import outbox_relay

from .receiver import DDL as RECEIVER_DDL

ROOT = Path(__file__).resolve().parent.parent.parent


def unique(prefix: str) -> str:
    """A name no other test run uses (queues on a broker several suites share)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def redis_client(url: str) -> redis.Redis:
    if url.startswith("redis+socket://"):
        return redis.Redis(unix_socket_path=url[len("redis+socket://") :])
    return redis.Redis.from_url(url)


def prepare_receiver(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(RECEIVER_DDL)


def status_counts(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT status, count(*) FROM outbox GROUP BY status").fetchall()
    return {status: int(n) for status, n in rows}


def delivered_ids(dsn: str) -> set[int]:
    """Messages whose publish returned normally at least once."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT DISTINCT message_id FROM received WHERE delivered").fetchall()
    return {int(r[0]) for r in rows}


def calls(dsn: str, message_id: int) -> list[dict[str, Any]]:
    """Every publish call the receiver saw for one message, oldest first."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT seq, attempts, lease_version, pid, thread, delivered, at"
            " FROM received WHERE message_id = %s ORDER BY seq",
            (message_id,),
        )
        names = [d.name for d in cur.description or []]
        return [dict(zip(names, row)) for row in cur.fetchall()]


def row(dsn: str, message_id: int) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            "SELECT id, status, attempts, lease_version, lease_until, last_error, done_at"
            " FROM outbox WHERE id = %s",
            (message_id,),
        )
        names = [d.name for d in cur.description or []]
        found = cur.fetchone()
    assert found is not None, f"outbox row {message_id} missing"
    return dict(zip(names, found))


def enqueue(
    dsn: str,
    n: int,
    *,
    threads: int = 4,
    per_transaction: int = 10,
    payload: Callable[[int], Any] = lambda i: {"order": i},
) -> list[int]:
    """Business transactions from several threads, each writing outbox rows with enqueue()."""
    ids: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def produce(start: int) -> None:
        try:
            with psycopg.connect(dsn) as conn:
                mine = list(range(start, n, threads))
                for at in range(0, len(mine), per_transaction):
                    with conn.transaction():
                        made = [
                            outbox_relay.enqueue(
                                conn,
                                aggregate_type="order",
                                aggregate_id=str(i),
                                event_type="order.created",
                                payload=payload(i),
                            )
                            for i in mine[at : at + per_transaction]
                        ]
                    with lock:
                        ids.extend(made)
        except BaseException as exc:  # surfaced in the test thread below
            errors.append(exc)

    workers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if errors:
        raise errors[0]
    return sorted(ids)


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic() of the sample
    counts: Mapping[str, int]

    def get(self, status: str) -> int:
        return self.counts.get(status, 0)


class StatusSampler:
    """Reads ``SELECT status, count(*)`` (and the live leases, as ``"live"``)
    every ``interval`` seconds in a thread."""

    def __init__(self, dsn: str, *, interval: float = 0.2) -> None:
        self.dsn = dsn
        self.interval = interval
        self.samples: list[Sample] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-sampler", daemon=True)

    def _run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self._stop.is_set():
                    # "live": processing rows whose lease has not expired,
                    # what the in-flight cap counts.
                    rows = conn.execute(
                        "SELECT status, count(*) FROM outbox GROUP BY status"
                        " UNION ALL SELECT 'live', count(*) FROM outbox"
                        " WHERE status = 'processing' AND lease_until > now()"
                    ).fetchall()
                    self.samples.append(Sample(time.monotonic(), {s: int(n) for s, n in rows}))
                    self._stop.wait(self.interval)
        except BaseException as exc:
            self.errors.append(exc)

    def start(self) -> StatusSampler:
        self._thread.start()
        return self

    def halt(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def stop(self) -> list[Sample]:
        """Stop sampling; return the samples (fails if sampling itself failed)."""
        self.halt()
        assert not self.errors, f"status sampler failed: {self.errors[0]!r}"
        return list(self.samples)


def longest_stall(samples: Iterable[Sample], *, since: float, total: int) -> float:
    """Longest stretch after ``since`` in which ``done`` did not grow while work remained."""
    stall = 0.0
    last_change: float | None = None
    last_done: int | None = None
    for s in samples:
        if s.at < since:
            last_done = s.get("done")
            continue
        if last_change is None:
            last_change = since
        if last_done is None or s.get("done") != last_done:
            last_change = s.at
            last_done = s.get("done")
        elif last_done < total:
            stall = max(stall, s.at - last_change)
    return stall


def wait_until(
    check: Callable[[], Any],
    *,
    timeout: float,
    interval: float = 0.2,
    describe: Callable[[], Any] | None = None,
    what: str = "condition",
) -> float:
    """Poll ``check`` until truthy; return the seconds it took. On timeout, say what was seen."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        if check():
            return time.monotonic() - started
        if time.monotonic() >= deadline:
            seen = describe() if describe is not None else None
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; saw {seen}")
        time.sleep(interval)


def module_json(module: str, *args: str, timeout: float = 60.0) -> Any:
    """Run ``python -m module args...`` (a scenario needing a process of its own,
    such as Django's once-per-process settings) and parse its last output line."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def client_app(broker: str) -> Any:
    """A Celery app that only sends tasks (what a web process holds)."""
    from celery import Celery

    app = Celery("test-client", broker=broker)
    app.conf.task_serializer = "json"
    app.conf.broker_connection_retry_on_startup = True
    return app


def active_queues(
    app: str, nodename: str, env: Mapping[str, str], *, cwd: Path, timeout: float = 20.0
) -> list[str]:
    """Queue names one worker consumes, asked with ``celery inspect active_queues --json``.

    The reply of ``nodename`` only: other test runs may have workers on the
    same broker answering the same broadcast.
    """
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                app,
                "inspect",
                "active_queues",
                "--json",
                "-d",
                nodename,
                "--timeout",
                "3",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            cwd=str(cwd),
            timeout=60,
            check=False,
        )
        last = result.stdout + result.stderr
        for line in result.stdout.splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            replies = json.loads(line)
            if nodename in replies:
                return sorted(q["name"] for q in replies[nodename])
        time.sleep(0.5)
    raise AssertionError(f"no active_queues reply from {nodename}:\n{last[-3000:]}")
