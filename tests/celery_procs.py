"""Start real ``celery worker`` and ``celery beat`` processes for a test.

Each process runs in its own session (process group) so a test can SIGKILL a
worker together with its pool children, as an OOM killer or a node loss
would. Logs go to files under the test's tmp_path; a test reads them to
check what the relay said.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
CELERY = [sys.executable, "-m", "celery"]


class Proc:
    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in self.text():
                return
            if not self.alive():
                raise AssertionError(f"{self.name} exited early:\n{self.text()[-4000:]}")
            time.sleep(0.1)
        raise AssertionError(f"{self.name} not ready after {timeout}s:\n{self.text()[-4000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the worker and its pool children)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 15.0) -> None:
        if not self.alive():
            return
        self.kill(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.popen.wait(10)


class CeleryProcs:
    """Starts workers and beats with one environment; stops them all at the end."""

    def __init__(self, env: Mapping[str, str], folder: Path, app: str = "outbox_relay.app"):
        self.env = {
            **os.environ,
            # Only what the test sets: not the example celeryconfig.py that
            # PYTHONPATH would otherwise make importable.
            "CELERY_CONFIG_MODULE": "tests.apps.no_celeryconfig",
            **env,
            "PYTHONPATH": str(ROOT),
        }
        self.folder = folder
        self.app = app
        self.procs: list[Proc] = []
        self._n = 0
        # In every worker's node name: the same "w1@host" in two tests, one
        # after the other on RabbitMQ, collided on the node's exclusive pidbox
        # queue while the first test's worker connection was still closing
        # (RESOURCE_LOCKED, and the second worker exited at start-up).
        self.tag = uuid.uuid4().hex[:6]

    def _start(
        self,
        name: str,
        args: list[str],
        env: Mapping[str, str] | None,
        netns: str | None = None,
    ) -> Proc:
        self._n += 1
        log = self.folder / f"{self._n:02d}-{name}.log"
        handle = log.open("wb")
        popen = subprocess.Popen(
            # In a network namespace of its own: a host of its own, as far
            # as the network goes (``ip netns exec`` execs, so the pid and
            # process group are the worker's).
            [*(["ip", "netns", "exec", netns] if netns else []), *CELERY, "-A", self.app, *args],
            cwd=str(self.folder),
            env={**self.env, **(env or {})},
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        handle.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def worker(
        self,
        *,
        concurrency: int = 2,
        pool: str = "prefork",
        env: Mapping[str, str] | None = None,
        args: tuple[str, ...] = (),
        ready: bool = True,
        events: bool = True,
        netns: str | None = None,
    ) -> Proc:
        name = f"w{self._n + 1}"
        proc = self._start(
            name,
            [
                "worker",
                "-n",
                f"{name}-{self.tag}@%h",
                "-P",
                pool,
                "-c",
                str(concurrency),
                "-l",
                "info",
                *(["-E"] if events else []),
                "--without-gossip",
                "--without-mingle",
                *args,
            ],
            env,
            netns,
        )
        if ready:
            proc.wait_ready()
        return proc

    def beat(self, *, env: Mapping[str, str] | None = None, netns: str | None = None) -> Proc:
        n = self._n + 1
        return self._start(
            f"beat{n}",
            ["beat", "-l", "info", "-s", str(self.folder / f"beat-{n}-schedule")],
            env,
            netns,
        )

    def flower(self, port: int) -> Proc:
        """Flower on loopback, as an operator runs it to watch the workers."""
        return self._start(
            "flower",
            ["flower", f"--port={port}", "--address=127.0.0.1"],
            # Flower 2 serves its JSON API only with auth or this opt-in.
            {"FLOWER_UNAUTHENTICATED_API": "true"},
        )

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.text()[-6000:]}" for p in self.procs)


def standalone_relay(dsn: str, folder: Path, broker: str, queue: str, **env: str) -> CeleryProcs:
    """The standalone relay on ``queue``, delivering to the test receiver
    (tests/apps/receiver.py), which records each publish in ``dsn``."""
    return CeleryProcs(
        {
            "OUTBOX_DSN": dsn,
            "CELERY_BROKER_URL": broker,
            "OUTBOX_QUEUE": queue,
            "OUTBOX_PUBLISHER": "tests.apps.receiver:record",
            "RECEIVER_DSN": dsn,
            **env,
        },
        folder,
    )


def wait_for(
    check: Callable[[], Any],
    *,
    timeout: float,
    interval: float = 0.2,
    what: str | Callable[[], str] = "condition",
) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout``.

    ``what`` may be a function, called only on failure: the processes' logs
    as they are when the wait ends, not as they were when it began.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    said = what() if callable(what) else what
    raise AssertionError(f"timed out after {timeout}s waiting for {said} (last: {last!r})")


def pool_pids(worker: Proc) -> set[int]:
    """The worker's process group: the main process and its pool children."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == worker.popen.pid:
                    pids.add(int(entry))
    return pids


def counts(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT status, count(*) FROM outbox GROUP BY status").fetchall()
    return {status: n for status, n in rows}


class EventTap:
    """Collects the Celery events on the broker, as Flower does."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.app.connection() as conn:
            receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            with receiver.consumer_context(wakeup=False) as (connection, _channel, _consumers):
                self._ready.set()
                while not self._stop.is_set():
                    with contextlib.suppress(TimeoutError, OSError):
                        connection.drain_events(timeout=0.5)

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e.get("type") == kind]

    def __enter__(self) -> EventTap:
        self._thread.start()
        assert self._ready.wait(10)
        time.sleep(0.3)  # subscribed before anything is sent
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)
